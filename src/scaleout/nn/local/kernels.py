"""The heavy operations of a locally connected layer on (H, W, C, N)-ordered tensors, one row
of block positions at a time, without autograd (`scaleout.nn.local.functional` differentiates
them):

    W x      y[p]  = W[p] @ X[p]              (K, F) @ (F, N)
    W^T y    x[p] += W[p]^T @ Y[p]            overlapping fields are summed
    delta x^T  dW[p] = D[p] @ X[p]^T          (K, N) @ (N, F)

With the minibatch innermost in memory (as in cuda-convnet) a receptive field is `field`
contiguous runs of field*C*N values, so gathering X[p] is a few large copies rather than an
im2col of (field/step)^2 times the input in runs of `field` values, and a block's output is
one contiguous run per output row. Each of those runs is itself a (field*C, N) matrix, so
W x reads the fields where they lie: one batched GEMM per field row, accumulated, and no
gather at all (which saves copying every field before one GEMM).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scaleout.nn.local.geometry import LocalGeometry

__all__ = [
    "add_transposed_product",
    "block_sums",
    "field_rows",
    "from_hwcn",
    "gather_blocks",
    "gather_fields",
    "local_forward",
    "local_transpose",
    "local_weight_grad",
    "scatter_add_fields",
    "scatter_blocks",
    "to_hwcn",
]


def to_hwcn(x: Tensor) -> Tensor:
    """(N, C, H, W) -> contiguous (H, W, C, N); free when `x` already has that memory order."""
    return x.permute(2, 3, 1, 0).contiguous()


def from_hwcn(t: Tensor) -> Tensor:
    """(H, W, C, N) -> the (N, C, H, W) view of it."""
    return t.permute(3, 2, 0, 1)


# --- kernels on (H, W, C, N) tensors, one row of block positions at a time -------------------
# They run without autograd; `local_linear` and `local_linear_t` differentiate them.


def gather_fields(xt: Tensor, g: LocalGeometry, row: int, out: Tensor) -> Tensor:
    """X[p] for the blocks of `row`: out (P_w, F, N) <- the fields of input xt (H, W, C, N)."""
    run = g.in_channels * xt.shape[-1]  # values per input pixel: C*N
    band = xt[row * g.step : row * g.step + g.field]  # (field, W, C, N), contiguous
    fields = band.as_strided(
        (g.positions_w, g.field, g.field * run), (g.step * run, xt.stride(0), 1)
    )
    out.view(g.positions_w, g.field, g.field * run).copy_(fields)
    return out


def field_rows(xt: Tensor, g: LocalGeometry, row: int, field_row: int) -> Tensor:
    """Row `field_row` of the fields of `row`'s blocks, in place: a (P_w, field*C, N) view of
    input xt (H, W, C, N), one contiguous (field*C, N) matrix per block."""
    run = g.in_channels * xt.shape[-1]
    src = xt[row * g.step + field_row]  # (W, C, N)
    return src.as_strided(
        (g.positions_w, g.field * g.in_channels, xt.shape[-1]),
        (g.step * run, xt.shape[-1], 1),
        src.storage_offset(),
    )


def scatter_add_fields(fields: Tensor, xt: Tensor, g: LocalGeometry, row: int) -> None:
    """xt (H, W, C, N) += the fields (P_w, F, N) of `row`'s blocks; overlapping fields sum.

    Fields m = ceil(field/step) positions apart do not overlap, so the row is added in m
    passes of non-overlapping strided views.
    """
    run = g.in_channels * xt.shape[-1]
    band = xt[row * g.step : row * g.step + g.field]
    apart = -(-g.field // g.step)
    for first in range(min(apart, g.positions_w)):
        count = len(range(first, g.positions_w, apart))
        dst = band.as_strided(
            (count, g.field, g.field * run),
            (apart * g.step * run, xt.stride(0), 1),
            band.storage_offset() + first * g.step * run,
        )
        dst.add_(fields[first::apart].view(count, g.field, g.field * run))


# field * C from which W^T y is accumulated straight into the input (`add_transposed_product`):
# from there on the per-row GEMMs are large enough to beat one GEMM into scratch space and a
# scatter; below it they are too small to keep the threads busy.
DIRECT_ADD_MIN_ROWS = 256


def add_transposed_product(
    weight: Tensor, blocks: Tensor, xt: Tensor, g: LocalGeometry, row: int, fields: Tensor
) -> None:
    """xt (H, W, C, N) += W[p]^T Y[p] for the blocks p of `row`: weight (P_w, K, F), blocks
    (P_w, K, N); overlapping fields sum. `fields` (P_w, F, N) is scratch space.

    Small fields: one batched GEMM into `fields`, then `scatter_add_fields`. Large fields
    (field * C >= DIRECT_ADD_MIN_ROWS): each block's product is accumulated into its field
    of xt in place, by a GEMM batched over the field's rows (a field row is field * C * N
    contiguous values), so the (P_w, F, N) product never goes through memory twice.
    """
    cols = g.field * g.in_channels  # values of one field row per example
    if cols < DIRECT_ADD_MIN_ROWS:
        # (P_w, F, K) @ (P_w, K, N)
        bmm_split(weight.transpose(1, 2), blocks, fields, batched_head(g.positions_w))
        scatter_add_fields(fields, xt, g, row)
        return
    n = xt.shape[-1]
    band = xt[row * g.step : row * g.step + g.field]  # (field, W, C, N)
    for col in range(g.positions_w):
        offset = band.storage_offset() + col * g.step * g.in_channels * n
        dst = band.as_strided((g.field, cols, n), (xt.stride(0), n, 1), offset)
        wt = weight[col].reshape(g.block_size, g.field, cols).permute(1, 2, 0)  # (field, cols, K)
        dst.baddbmm_(wt, blocks[col].expand(g.field, -1, -1))


def gather_blocks(yt: Tensor, g: LocalGeometry, row: int, out: Tensor) -> Tensor:
    """Y[p] for the blocks of `row`: out (P_w, K, N) <- output yt (H_out, W_out, depth, N)."""
    run = g.block_width * g.depth * yt.shape[-1]
    band = yt[row * g.block_height : (row + 1) * g.block_height]
    out.view(g.positions_w, g.block_height, run).copy_(
        band.view(g.block_height, g.positions_w, run).transpose(0, 1)
    )
    return out


def scatter_blocks(blocks: Tensor, yt: Tensor, g: LocalGeometry, row: int) -> None:
    """yt (H_out, W_out, depth, N) <- the block outputs (P_w, K, N) of `row`."""
    run = g.block_width * g.depth * yt.shape[-1]
    band = yt[row * g.block_height : (row + 1) * g.block_height]
    band.view(g.block_height, g.positions_w, run).copy_(
        blocks.view(g.positions_w, g.block_height, run).transpose(0, 1)
    )


def batched_head(count: int) -> int:
    """How many of `count` same-shaped GEMMs run as one batched GEMM: the most that split
    evenly over torch's threads. torch splits a batch over its threads whole GEMMs at a
    time, so 5 block positions on 2 threads run 3:2 (at most 83% of both threads); the
    rest (`bmm_split`) run one by one, each GEMM threaded inside."""
    threads = torch.get_num_threads()
    head = count - count % threads
    return head if head > 0 else count


def bmm_split(a: Tensor, b: Tensor, out: Tensor, head: int, accumulate: bool = False) -> None:
    """out (B, M, N) = a (B, M, K) @ b (B, K, N), or += with `accumulate`: the first `head`
    as one batched GEMM, the rest one GEMM each (`batched_head`)."""
    if accumulate:
        out[:head].baddbmm_(a[:head], b[:head])
    else:
        torch.bmm(a[:head], b[:head], out=out[:head])
    for i in range(head, a.shape[0]):
        if accumulate:
            out[i].addmm_(a[i], b[i])
        else:
            torch.mm(a[i], b[i], out=out[i])


def _check_weight(g: LocalGeometry, weight: Tensor) -> None:
    if tuple(weight.shape) != g.weight_shape:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}, the geometry needs {g.weight_shape}"
        )


def _check_activation(t: Tensor, like: Tensor, shape: tuple[int, int, int], what: str) -> None:
    if t.dim() != 4 or tuple(t.shape[:3]) != shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)} (H, W, C, N); expected {shape} + (N,)")
    if t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{what} ({t.dtype}, {t.device}) and weight ({like.dtype}, {like.device}) "
            "must share dtype and device"
        )


def _row_scale(scale: Tensor | float | None, row: int) -> Tensor | float | None:
    if scale is None or isinstance(scale, float | int):
        return scale
    return scale[row].unsqueeze(-1)  # (P_w, K, 1)


@torch.no_grad()
def local_forward(
    xt: Tensor,
    weight: Tensor,
    g: LocalGeometry,
    scale: Tensor | float | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """W x: input xt (H, W, C, N) -> output (H_out, W_out, depth, N).

    `scale` (P_h, P_w, K) multiplies each neuron's response (the unit-norm filters are
    W~ * scale, so normalisation never copies the weight); `bias` (P_h, P_w, K) is added.
    """
    _check_weight(g, weight)
    _check_activation(xt, weight, (g.in_height, g.in_width, g.in_channels), "input")
    xt = xt.contiguous()  # field_rows views it by its (H, W, C, N) strides
    n = xt.shape[-1]
    yt = xt.new_empty(g.out_height, g.out_width, g.depth, n)
    blocks = xt.new_empty(g.positions_w, g.block_size, n)
    cols = g.field * g.in_channels
    head = batched_head(g.positions_w)
    for row in range(g.positions_h):
        w = weight[row].reshape(g.positions_w, g.block_size, g.field, cols)  # (P_w, K, field, cols)
        # (P_w, K, cols) @ (P_w, cols, N), summed over the field's rows
        for field_row in range(g.field):
            x = field_rows(xt, g, row, field_row)
            bmm_split(w[:, :, field_row], x, blocks, head, accumulate=field_row > 0)
        if (s := _row_scale(scale, row)) is not None:
            blocks.mul_(s)
        if bias is not None:
            blocks.add_(bias[row].unsqueeze(-1))
        scatter_blocks(blocks, yt, g, row)
    return yt


@torch.no_grad()
def local_transpose(
    yt: Tensor, weight: Tensor, g: LocalGeometry, scale: Tensor | float | None = None
) -> Tensor:
    """W^T y: output-shaped yt (H_out, W_out, depth, N) -> input-shaped (H, W, C, N).

    Overlapping fields are summed; pixels no field reaches are zero.
    """
    _check_weight(g, weight)
    _check_activation(yt, weight, (g.out_height, g.out_width, g.depth), "output")
    n = yt.shape[-1]
    xt = yt.new_zeros(g.in_height, g.in_width, g.in_channels, n)
    fields = yt.new_empty(g.positions_w, g.field_size, n)
    blocks = yt.new_empty(g.positions_w, g.block_size, n)
    for row in range(g.positions_h):
        gather_blocks(yt, g, row, blocks)
        if (s := _row_scale(scale, row)) is not None:
            blocks.mul_(s)
        add_transposed_product(weight[row], blocks, xt, g, row, fields)
    return xt


@torch.no_grad()
def local_weight_grad(
    dt: Tensor, xt: Tensor, g: LocalGeometry, out: Tensor | None = None
) -> Tensor:
    """delta x^T: dW[p] = D[p] @ X[p]^T for output-shaped dt and input-shaped xt; (P_h, P_w,
    K, F). Written into `out` when given."""
    _check_activation(xt, dt, (g.in_height, g.in_width, g.in_channels), "input")
    _check_activation(dt, xt, (g.out_height, g.out_width, g.depth), "output gradient")
    n = xt.shape[-1]
    if dt.shape[-1] != n:
        raise ValueError(f"output gradient has batch {dt.shape[-1]}, input has {n}")
    out = xt.new_empty(g.weight_shape) if out is None else out
    fields = xt.new_empty(g.positions_w, g.field_size, n)
    blocks = xt.new_empty(g.positions_w, g.block_size, n)
    head = batched_head(g.positions_w)
    for row in range(g.positions_h):
        gather_fields(xt, g, row, fields)
        gather_blocks(dt, g, row, blocks)
        bmm_split(blocks, fields.transpose(1, 2), out[row], head)  # (P_w, K, N) @ (P_w, N, F)
    return out


def block_sums(dt: Tensor, g: LocalGeometry) -> Tensor:
    """Sum over the minibatch of an output-shaped dt, as (P_h, P_w, K): the bias gradient."""
    sums = dt.sum(dim=-1)  # (H_out, W_out, depth)
    sums = sums.view(g.positions_h, g.block_height, g.positions_w, g.block_width, g.depth)
    return sums.permute(0, 2, 1, 3, 4).reshape(g.positions_h, g.positions_w, g.block_size)
