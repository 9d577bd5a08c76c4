"""The sparse autoencoder of Le et al. 2012 / COTS HPC section 3: stacks of filter -> L2 pool ->
local contrast normalisation, trained greedily, one stack at a time.

A stack's filtering layer has weights W (one row per neuron, each constrained to unit norm
by W = W~ / ||W~||, the optimised variable being W~) and a scalar alpha. On a minibatch of
N examples it minimises (COTS HPC eq. 1, divided by N so the step size does not depend on
the batch size)

    reconstruction  (1/N) sum_i ||W^T (alpha W x_i) - x_i||^2
  + sparsity        (1/N) lambda sum_i sum_j sqrt(eps + V_j (alpha W x_i)^2)

with lambda = 0.1 and V_j the pooling windows of the stack's own L2 pooling layer (5x5,
weights 1). The decoder is W^T: there is no second weight matrix. The reconstruction is
summed over the input pixels some receptive field reaches (the others cannot be
reconstructed and add only a constant).

The modules: `tied` (the fused codes-and-reconstruction with its memory-lean backward),
`stack` (one stack and its objective, written once for one process and for a worker's part
of a partitioned network), `network` (the stacks and greedy layer-wise training) and
`image` (filters as a picture). Importing this package registers the model kind
"sparse_autoencoder".
"""

from scaleout.nn.autoencoder.image import write_filter_image
from scaleout.nn.autoencoder.network import SparseAutoencoderNetwork, StackPhases
from scaleout.nn.autoencoder.stack import ObjectiveTerms, SparseAutoencoderStack
from scaleout.nn.autoencoder.tied import tied_autoencode

__all__ = [
    "ObjectiveTerms",
    "SparseAutoencoderNetwork",
    "SparseAutoencoderStack",
    "StackPhases",
    "tied_autoencode",
    "write_filter_image",
]
