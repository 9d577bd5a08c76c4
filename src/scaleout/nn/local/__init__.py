"""Locally connected layers (COTS HPC section 4.1, Le et al. 2012): untied block-local filters,
L2 pooling and local contrast normalisation.

`LocallyConnected2d` groups its neurons in blocks of bh x bw x depth that share one receptive
field of field x field pixels over all input channels; the fields sit on a grid with step s.
Because a block's neurons share their field, the block's responses are one dense product
Y_F = W_F X_F (the paper's figure 3), so the weight is stored per block position as a dense
matrix, (P_h, P_w, K, F) with K = bh*bw*depth neurons and F = field*field*C inputs, and the
sparse matrix W is never formed.

Weight order: K = (i, j, d) for the neuron at row i, column j, map d of the block; F = (a, b,
c) for field row a, field column b, input channel c. Activations are (N, C, H, W) tensors whose
memory is ordered (H, W, C, N) (`to_hwcn`; the minibatch innermost, as in cuda-convnet);
tensors in this layout are ordinary NCHW-shaped views, any op accepts them, and the layers
keep the layout.

The modules, one concept each:

- `geometry`: where fields and blocks lie (`LocalGeometry`), the windows for partitioning;
- `kernels`: W x, W^T y and delta x^T as batched GEMMs over a row of block positions;
- `functional`: their differentiable forms (hand-written backward) and unit-norm rows;
- `layers`: the modules `LocallyConnected2d`, `L2Pool2d`, `LocalContrastNorm2d`.
"""

from scaleout.nn.local.functional import (
    inverse_row_norms,
    local_linear,
    local_linear_t,
    local_linear_unfold,
    normalize_rows,
)
from scaleout.nn.local.geometry import LocalGeometry
from scaleout.nn.local.kernels import (
    add_transposed_product,
    block_sums,
    from_hwcn,
    gather_blocks,
    gather_fields,
    local_forward,
    local_transpose,
    local_weight_grad,
    scatter_add_fields,
    scatter_blocks,
    to_hwcn,
)
from scaleout.nn.local.layers import (
    L2Pool2d,
    LocalContrastNorm2d,
    LocallyConnected2d,
    gaussian_window,
)

__all__ = [
    "L2Pool2d",
    "LocalContrastNorm2d",
    "LocalGeometry",
    "LocallyConnected2d",
    "add_transposed_product",
    "block_sums",
    "from_hwcn",
    "gather_blocks",
    "gather_fields",
    "gaussian_window",
    "inverse_row_norms",
    "local_forward",
    "local_linear",
    "local_linear_t",
    "local_linear_unfold",
    "local_transpose",
    "local_weight_grad",
    "normalize_rows",
    "scatter_add_fields",
    "scatter_blocks",
    "to_hwcn",
]
