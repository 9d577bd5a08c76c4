"""Locally connected layers (COTS HPC section 4.1, Le et al. 2012): untied block-local filters,
L2 pooling and local contrast normalisation.

`LocallyConnected2d` groups its neurons in blocks of bh x bw x depth that share one receptive
field of field x field pixels over all input channels; the fields sit on a grid with step s.
Because a block's neurons share their field, the block's responses are one dense product
Y_F = W_F X_F (the paper's figure 3), so the weight is stored per block position as a dense
matrix, (P_h, P_w, K, F) with K = bh*bw*depth neurons and F = field*field*C inputs, and the
sparse matrix W is never formed. The three heavy operations are batched GEMMs over one row of
block positions at a time:

    W x      y[p]  = W[p] @ X[p]              (K, F) @ (F, N)
    W^T y    x[p] += W[p]^T @ Y[p]            overlapping fields are summed
    delta x^T  dW[p] = D[p] @ X[p]^T          (K, N) @ (N, F)

Activations are (N, C, H, W) tensors whose memory is ordered (H, W, C, N) (`to_hwcn`; the
minibatch innermost, as in cuda-convnet): a receptive field is then `field` contiguous runs
of field*C*N values, so gathering X[p] is a few large copies rather than an im2col of
(field/step)^2 times the input in runs of `field` values, and a block's output is one
contiguous run per output row. Tensors in this layout are
ordinary NCHW-shaped views; any op accepts them, and the layers below keep the layout.

Weight order: K = (i, j, d) for the neuron at row i, column j, map d of the block; F = (a, b,
c) for field row a, field column b, input channel c. Placement is "valid": fields start at
0, s, 2s, ... while they fit, so there are (size - field) // step + 1 positions per axis and
input pixels no field reaches are ignored. The geometry methods give, for a range of block
positions, the input and output pixel windows they touch, for partitioning over H and W.

The backward passes are written by hand (`torch.autograd.Function`): they recompute X[p] from
the input instead of saving the 25x-expanded unfolded input, and measured faster than
autograd through `F.unfold` (`local_linear_unfold`, kept as the reference; `scaleout bench
local` measures both).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = [
    "L2Pool2d",
    "LocalContrastNorm2d",
    "LocalGeometry",
    "LocallyConnected2d",
    "add_transposed_product",
    "from_hwcn",
    "local_forward",
    "local_linear",
    "local_linear_t",
    "local_linear_unfold",
    "local_transpose",
    "local_weight_grad",
    "normalize_rows",
    "to_hwcn",
]

# Rows of a weight matrix normalised per chunk: small enough that a chunk stays in cache
# between its reads, large enough that Python overhead is negligible.
NORMALIZE_CHUNK_VALUES = 1 << 18


def _pair(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= 1 for v in pair):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return pair  # type: ignore[return-value]


@dataclass(frozen=True)
class LocalGeometry:
    """Where the receptive fields and blocks of a `LocallyConnected2d` lie.

    Block position (r, c) reads input pixels [r*step, r*step + field) x [c*step, c*step +
    field) of every channel and writes output pixels [r*bh, (r+1)*bh) x [c*bw, (c+1)*bw) of
    every map.
    """

    in_channels: int
    in_height: int
    in_width: int
    field: int
    step: int
    block_height: int
    block_width: int
    depth: int

    def __post_init__(self) -> None:
        for name in ("in_channels", "in_height", "in_width", "field", "step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("block_height", "block_width", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"block {name} must be >= 1, got {getattr(self, name)}")
        if self.field > min(self.in_height, self.in_width):
            raise ValueError(
                f"field = {self.field} does not fit the {self.in_height}x{self.in_width} input; "
                f"use a field of at most {min(self.in_height, self.in_width)}"
            )

    @property
    def positions_h(self) -> int:
        return (self.in_height - self.field) // self.step + 1

    @property
    def positions_w(self) -> int:
        return (self.in_width - self.field) // self.step + 1

    @property
    def num_positions(self) -> int:
        return self.positions_h * self.positions_w

    @property
    def block_size(self) -> int:
        """K: neurons per block, the rows of each block's weight matrix."""
        return self.block_height * self.block_width * self.depth

    @property
    def field_size(self) -> int:
        """F: inputs per receptive field, the columns of each block's weight matrix."""
        return self.field * self.field * self.in_channels

    @property
    def out_height(self) -> int:
        return self.positions_h * self.block_height

    @property
    def out_width(self) -> int:
        return self.positions_w * self.block_width

    @property
    def in_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, self.in_height, self.in_width)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.depth, self.out_height, self.out_width)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.positions_h, self.positions_w, self.block_size, self.field_size)

    @property
    def num_weights(self) -> int:
        return self.num_positions * self.block_size * self.field_size

    def matmul_flops(self, batch: int) -> int:
        """FLOPs of one of W x, W^T y, delta x^T on a minibatch (a multiply-add is 2)."""
        return 2 * batch * self.num_weights

    def input_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        """Input pixel rows and columns read by the blocks at `block_rows` x `block_cols`."""
        return (
            self._span(block_rows, self.positions_h, "block_rows"),
            self._span(block_cols, self.positions_w, "block_cols"),
        )

    def output_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        """Output pixel rows and columns written by the blocks at `block_rows` x `block_cols`."""
        rows = self._check(block_rows, self.positions_h, "block_rows")
        cols = self._check(block_cols, self.positions_w, "block_cols")
        return (
            range(rows.start * self.block_height, rows.stop * self.block_height),
            range(cols.start * self.block_width, cols.stop * self.block_width),
        )

    def blocks_reading(self, in_rows: range, in_cols: range) -> tuple[range, range]:
        """Block positions whose fields overlap input pixels `in_rows` x `in_cols`."""
        return (
            self._readers(in_rows, self.positions_h),
            self._readers(in_cols, self.positions_w),
        )

    def sub(self, block_rows: range, block_cols: range) -> LocalGeometry:
        """The geometry of blocks `block_rows` x `block_cols` alone, on their input window:
        `weight[rows.start:rows.stop, cols.start:cols.stop]` applied to that window."""
        rows, cols = self.input_window(block_rows, block_cols)
        return LocalGeometry(
            self.in_channels,
            len(rows),
            len(cols),
            self.field,
            self.step,
            self.block_height,
            self.block_width,
            self.depth,
        )

    def coverage(self, device: torch.device | str | None = None) -> Tensor:
        """(H, W) bool mask of input pixels some field reads."""
        rows = torch.zeros(self.in_height, dtype=torch.bool, device=device)
        cols = torch.zeros(self.in_width, dtype=torch.bool, device=device)
        for r in range(self.positions_h):
            rows[r * self.step : r * self.step + self.field] = True
        for c in range(self.positions_w):
            cols[c * self.step : c * self.step + self.field] = True
        return rows[:, None] & cols[None, :]

    def _check(self, blocks: range, count: int, name: str) -> range:
        if blocks.step != 1 or not 0 <= blocks.start < blocks.stop <= count:
            raise ValueError(f"{name} must be a non-empty range within 0..{count}, got {blocks}")
        return blocks

    def _span(self, blocks: range, count: int, name: str) -> range:
        blocks = self._check(blocks, count, name)
        return range(blocks.start * self.step, (blocks.stop - 1) * self.step + self.field)

    def _readers(self, pixels: range, count: int) -> range:
        first = max(0, -(-(pixels.start - self.field + 1) // self.step))
        last = min(count, (pixels.stop - 1) // self.step + 1)
        return range(first, max(first, last))


# --- layout ----------------------------------------------------------------------------------


def to_hwcn(x: Tensor) -> Tensor:
    """(N, C, H, W) -> contiguous (H, W, C, N); free when `x` already has that memory order."""
    return x.permute(2, 3, 1, 0).contiguous()


def from_hwcn(t: Tensor) -> Tensor:
    """(H, W, C, N) -> the (N, C, H, W) view of it."""
    return t.permute(3, 2, 0, 1)


# --- kernels on (H, W, C, N) tensors, one row of block positions at a time -------------------
# They run without autograd; `local_linear` and `local_linear_t` below differentiate them.


def gather_fields(xt: Tensor, g: LocalGeometry, row: int, out: Tensor) -> Tensor:
    """X[p] for the blocks of `row`: out (P_w, F, N) <- the fields of input xt (H, W, C, N)."""
    run = g.in_channels * xt.shape[-1]  # values per input pixel: C*N
    band = xt[row * g.step : row * g.step + g.field]  # (field, W, C, N), contiguous
    fields = band.as_strided(
        (g.positions_w, g.field, g.field * run), (g.step * run, xt.stride(0), 1)
    )
    out.view(g.positions_w, g.field, g.field * run).copy_(fields)
    return out


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
# measured faster for fields of 32 x 32 x 18 (block 4x4x18: +10% at 1 thread, +40% at 2) and
# slower for 20 x 20 x 8 at 2 threads (its per-row GEMMs of 160 rows are too small).
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
        torch.bmm(weight.transpose(1, 2), blocks, out=fields)  # (P_w, F, K) @ (P_w, K, N)
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
    n = xt.shape[-1]
    yt = xt.new_empty(g.out_height, g.out_width, g.depth, n)
    fields = xt.new_empty(g.positions_w, g.field_size, n)
    blocks = xt.new_empty(g.positions_w, g.block_size, n)
    for row in range(g.positions_h):
        gather_fields(xt, g, row, fields)
        torch.bmm(weight[row], fields, out=blocks)  # (P_w, K, F) @ (P_w, F, N)
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
    for row in range(g.positions_h):
        gather_fields(xt, g, row, fields)
        gather_blocks(dt, g, row, blocks)
        torch.bmm(blocks, fields.transpose(1, 2), out=out[row])  # (P_w, K, N) @ (P_w, N, F)
    return out


def block_sums(dt: Tensor, g: LocalGeometry) -> Tensor:
    """Sum over the minibatch of an output-shaped dt, as (P_h, P_w, K): the bias gradient."""
    sums = dt.sum(dim=-1)  # (H_out, W_out, depth)
    sums = sums.view(g.positions_h, g.block_height, g.positions_w, g.block_width, g.depth)
    return sums.permute(0, 2, 1, 3, 4).reshape(g.positions_h, g.positions_w, g.block_size)


# --- autograd --------------------------------------------------------------------------------


class _LocalLinear(torch.autograd.Function):
    """y = W x + b. Backward: dx = W^T dy, dW = dy x^T (X[p] re-gathered, not saved)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None, g: LocalGeometry
    ) -> Tensor:
        xt = to_hwcn(x)
        yt = local_forward(xt, weight, g, bias=bias)
        ctx.save_for_backward(xt, weight)
        ctx.geometry = g  # type: ignore[attr-defined]
        return from_hwcn(yt)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        xt, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        g: LocalGeometry = ctx.geometry  # type: ignore[attr-defined]
        dt = to_hwcn(grad_y)
        need_x, need_w, need_b, _ = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_x = from_hwcn(local_transpose(dt, weight, g)) if need_x else None
        grad_w = local_weight_grad(dt, xt, g) if need_w else None
        grad_b = block_sums(dt, g) if need_b else None
        return grad_x, grad_w, grad_b, None


class _LocalLinearT(torch.autograd.Function):
    """x = W^T y. Backward: dy = W dx, dW = y dx^T."""

    @staticmethod
    def forward(ctx: FunctionCtx, y: Tensor, weight: Tensor, g: LocalGeometry) -> Tensor:
        yt = to_hwcn(y)
        xt = local_transpose(yt, weight, g)
        ctx.save_for_backward(yt, weight)
        ctx.geometry = g  # type: ignore[attr-defined]
        return from_hwcn(xt)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_x: Tensor) -> tuple[Tensor | None, ...]:
        yt, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        g: LocalGeometry = ctx.geometry  # type: ignore[attr-defined]
        gt = to_hwcn(grad_x)
        need_y, need_w, _ = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_y = from_hwcn(local_forward(gt, weight, g)) if need_y else None
        grad_w = local_weight_grad(yt, gt, g) if need_w else None
        return grad_y, grad_w, None


def _check_input(x: Tensor, shape: tuple[int, int, int], what: str) -> None:
    if x.dim() != 4 or tuple(x.shape[1:]) != shape:
        raise ValueError(
            f"{what} has shape {tuple(x.shape)}; expected (N, {', '.join(map(str, shape))})"
        )


def local_linear(
    x: Tensor, weight: Tensor, geometry: LocalGeometry, bias: Tensor | None = None
) -> Tensor:
    """W x (+ b): x (N, C, H, W) -> (N, depth, H_out, W_out), memory ordered (H, W, C, N)."""
    _check_input(x, geometry.in_shape, "input")
    return _LocalLinear.apply(x, weight, bias, geometry)


def local_linear_t(y: Tensor, weight: Tensor, geometry: LocalGeometry) -> Tensor:
    """W^T y: y (N, depth, H_out, W_out) -> (N, C, H, W); overlapping fields sum."""
    _check_input(y, geometry.out_shape, "output-shaped input")
    return _LocalLinearT.apply(y, weight, geometry)


def local_linear_unfold(
    x: Tensor, weight: Tensor, geometry: LocalGeometry, bias: Tensor | None = None
) -> Tensor:
    """W x through `F.unfold` + bmm, differentiated by autograd: the reference the
    hand-written backward is measured against. It keeps the unfolded input, (field/step)^2
    times the input's size, for the backward pass."""
    g = geometry
    _check_input(x, g.in_shape, "input")
    n = x.shape[0]
    cols = F.unfold(x, g.field, stride=g.step)  # (N, C*f*f, L), ordered (c, a, b)
    cols = cols.view(n, g.in_channels, g.field, g.field, g.num_positions)
    cols = cols.permute(4, 0, 2, 3, 1).reshape(g.num_positions, n, g.field_size)  # (L, N, F)
    w = weight.reshape(g.num_positions, g.block_size, g.field_size)
    y = torch.bmm(cols, w.transpose(1, 2))  # (L, N, K)
    if bias is not None:
        y = y + bias.reshape(g.num_positions, 1, g.block_size)
    y = y.view(g.positions_h, g.positions_w, n, g.block_height, g.block_width, g.depth)
    return y.permute(2, 5, 0, 3, 1, 4).reshape(n, *g.out_shape)


class _NormalizeRows(torch.autograd.Function):
    """w = w~ / ||w~|| over the last dim, chunk by chunk so each chunk is read from cache.

    Backward: dw~ = (dw - w <dw, w>) / ||w~||, also chunked: the pass is bandwidth-bound,
    and chunking keeps it near one read of each operand and one write.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, weight: Tensor) -> Tensor:
        width = weight.shape[-1]
        flat = weight.detach().reshape(-1, width)
        out = torch.empty_like(flat)
        inv = flat.new_empty(flat.shape[0])
        chunk = max(1, NORMALIZE_CHUNK_VALUES // width)
        tiny = torch.finfo(flat.dtype).tiny
        for start in range(0, flat.shape[0], chunk):
            rows = slice(start, start + chunk)
            torch.linalg.vector_norm(flat[rows], dim=1, out=inv[rows])
            inv[rows].clamp_min_(tiny).reciprocal_()
            torch.mul(flat[rows], inv[rows, None], out=out[rows])
        ctx.save_for_backward(out, inv)
        return out.view(weight.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        out, inv = ctx.saved_tensors  # type: ignore[attr-defined]
        flat = grad.reshape(out.shape)
        result = torch.empty_like(out)
        chunk = max(1, NORMALIZE_CHUNK_VALUES // out.shape[1])
        for start in range(0, out.shape[0], chunk):
            rows = slice(start, start + chunk)
            dots = torch.linalg.vecdot(flat[rows], out[rows], dim=1)  # (rows,)
            torch.addcmul(flat[rows], out[rows], dots[:, None], value=-1, out=result[rows])
            result[rows].mul_(inv[rows, None])
        return result.view(grad.shape)


def normalize_rows(weight: Tensor) -> Tensor:
    """Unit-norm filters: `weight / ||weight||` over the last dim, with a fast backward."""
    return _NormalizeRows.apply(weight)


def inverse_row_norms(weight: Tensor) -> Tensor:
    """1 / ||w~|| over the last dim (no autograd): the scale that makes rows unit-norm."""
    norms = torch.linalg.vector_norm(weight.detach(), dim=-1)
    return norms.clamp_min_(torch.finfo(norms.dtype).tiny).reciprocal_()


# --- modules ---------------------------------------------------------------------------------


class LocallyConnected2d(nn.Module):
    """Untied block-local filters: blocks of bh x bw x depth neurons share a field x field
    receptive field over all input channels, on a grid with the given step ("valid").

    x (N, in_channels, H, W) -> (N, depth, P_h * bh, P_w * bw), P = (size - field)//step + 1.
    `transpose(y)` applies W^T (the tied decoder of the sparse autoencoder).
    """

    def __init__(
        self,
        in_channels: int,
        in_size: int | tuple[int, int],
        field: int,
        step: int,
        block: tuple[int, int, int] | list[int],
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        height, width = _pair(in_size, "in_size")
        if len(block) != 3:
            raise ValueError(f"block must be (height, width, depth), got {block!r}")
        self.geometry = LocalGeometry(in_channels, height, width, field, step, *block)
        g = self.geometry
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(g.weight_shape, **factory))
        if bias:
            self.bias = nn.Parameter(
                torch.empty(g.positions_h, g.positions_w, g.block_size, **factory)
            )
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Filters ~ N(0, 1/F): rows of about unit norm; zero bias."""
        nn.init.normal_(self.weight, 0.0, 1.0 / math.sqrt(self.geometry.field_size))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.geometry.in_shape

    def forward(self, x: Tensor) -> Tensor:
        return local_linear(x, self.weight, self.geometry, self.bias)

    def transpose(self, y: Tensor) -> Tensor:
        """W^T y for an output-shaped y (no bias)."""
        return local_linear_t(y, self.weight, self.geometry)

    def input_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        return self.geometry.input_window(block_rows, block_cols)

    def output_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        return self.geometry.output_window(block_rows, block_cols)

    def flops_per_example(self) -> int:
        return self.geometry.matmul_flops(1)

    def extra_repr(self) -> str:
        g = self.geometry
        return (
            f"in={g.in_channels}x{g.in_height}x{g.in_width}, field={g.field}, step={g.step}, "
            f"block={g.block_height}x{g.block_width}x{g.depth}, "
            f"positions={g.positions_h}x{g.positions_w}, out={g.depth}x{g.out_height}x"
            f"{g.out_width}, bias={self.bias is not None}"
        )


def _windowed(x: Tensor, op: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply a per-channel spatial op to (N, C, H, W); (H, W, C, N)-ordered tensors are run as
    one channels-last image with C*N channels, so they keep their layout."""
    n, c, h, w = x.shape
    if x.is_contiguous() or not x.permute(2, 3, 1, 0).is_contiguous():
        return op(x)
    image = x.permute(2, 3, 1, 0).reshape(1, h, w, c * n).permute(0, 3, 1, 2)  # channels-last
    out = op(image)  # (1, C*N, H', W')
    return from_hwcn(out.permute(0, 2, 3, 1).reshape(out.shape[2], out.shape[3], c, n))


def _clip(start: int, stop: int, size: int) -> range:
    return range(max(0, start), min(size, stop))


class L2Pool2d(nn.Module):
    """L2 pooling with fixed weights of 1: out = sqrt(eps + sum over the window of x^2), per
    map, over size x size windows at the given stride (zero padding, if any, adds nothing)."""

    def __init__(self, size: int = 5, stride: int = 1, padding: int = 0, eps: float = 1e-2) -> None:
        super().__init__()
        if size < 1 or stride < 1 or padding < 0 or 2 * padding >= size + 1:
            raise ValueError(
                f"L2Pool2d needs size >= 1, stride >= 1 and 0 <= padding <= size // 2, got "
                f"size={size}, stride={stride}, padding={padding}"
            )
        if eps < 0:
            raise ValueError(f"L2Pool2d eps must be >= 0, got {eps}")
        self.size, self.stride, self.padding, self.eps = size, stride, padding, eps

    def out_size(self, size: int) -> int:
        out = (size + 2 * self.padding - self.size) // self.stride + 1
        if out < 1:
            raise ValueError(f"pool size {self.size} does not fit a map of size {size}")
        return out

    def input_window(
        self, out_rows: range, out_cols: range, in_size: tuple[int, int]
    ) -> tuple[range, range]:
        """Input pixels read by output pixels `out_rows` x `out_cols` (clipped to the map)."""
        return tuple(  # type: ignore[return-value]
            _clip(
                o.start * self.stride - self.padding,
                (o.stop - 1) * self.stride - self.padding + self.size,
                n,
            )
            for o, n in zip((out_rows, out_cols), in_size, strict=True)
        )

    def forward(self, x: Tensor) -> Tensor:
        area = self.size * self.size

        def pool(t: Tensor) -> Tensor:
            return F.avg_pool2d(t, self.size, self.stride, self.padding, count_include_pad=True)

        return (_windowed(x * x, pool) * area + self.eps).sqrt()

    def flops_per_example(self, in_shape: tuple[int, int, int]) -> int:
        c, h, w = in_shape
        # a square per input; size^2 adds, a scale, an add and a square root per output
        outputs = c * self.out_size(h) * self.out_size(w)
        return c * h * w + outputs * (self.size**2 + 3)

    def extra_repr(self) -> str:
        return f"size={self.size}, stride={self.stride}, padding={self.padding}, eps={self.eps}"


def gaussian_window(size: int, sigma: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """1-D Gaussian of `size` taps summing to 1; the 2-D window is its outer product."""
    offsets = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    taps = torch.exp(-(offsets**2) / (2 * sigma**2))
    return (taps / taps.sum()).to(dtype)


class LocalContrastNorm2d(nn.Module):
    """Subtractive then divisive normalisation (Jarrett et al. 2009; Le et al. 2012).

    With G a size x size Gaussian window summing to 1, applied over space and averaged over
    the C maps: v = x - G*x, y = v / sqrt(eps + G*v^2). Output size equals input size; near
    the borders the window is cut off and renormalised to sum 1 (Jarrett's border rule), so
    every output reads only pixels within 2 * (size // 2) of it.
    """

    def __init__(self, size: int = 5, sigma: float = 1.0, eps: float = 1e-2) -> None:
        super().__init__()
        if size < 1 or size % 2 == 0:
            raise ValueError(f"LocalContrastNorm2d size must be odd and >= 1, got {size}")
        if sigma <= 0 or eps < 0:
            raise ValueError(
                f"LocalContrastNorm2d needs sigma > 0 and eps >= 0, got {sigma}, {eps}"
            )
        self.size, self.sigma, self.eps = size, sigma, eps

    def _blur(self, m: Tensor) -> Tensor:
        """Separable Gaussian of a (N, 1, H, W) map, zero padded."""
        taps = gaussian_window(self.size, self.sigma, m.dtype).to(m.device)
        pad = self.size // 2
        m = F.conv2d(m, taps.view(1, 1, -1, 1), padding=(pad, 0))
        return F.conv2d(m, taps.view(1, 1, 1, -1), padding=(0, pad))

    def _local_mean(self, x: Tensor, weight: Tensor) -> Tensor:
        m = x.mean(dim=1, keepdim=True).contiguous()  # (N, 1, H, W)
        return self._blur(m) / weight

    def input_window(
        self, out_rows: range, out_cols: range, in_size: tuple[int, int]
    ) -> tuple[range, range]:
        """Input pixels read by output pixels `out_rows` x `out_cols`."""
        reach = 2 * (self.size // 2)
        return tuple(  # type: ignore[return-value]
            _clip(o.start - reach, o.stop + reach, n)
            for o, n in zip((out_rows, out_cols), in_size, strict=True)
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"LocalContrastNorm2d needs (N, C, H, W), got shape {tuple(x.shape)}")
        # Sum of the window's weights inside the map at each pixel (1 away from the borders).
        weight = self._blur(x.new_ones(1, 1, *x.shape[2:]))
        v = x - self._local_mean(x, weight)
        return v / (self._local_mean(v * v, weight) + self.eps).sqrt()

    def flops_per_example(self, in_shape: tuple[int, int, int]) -> int:
        c, h, w = in_shape
        # two channel means (c adds each), two separable blurs (2 * 2 * size each), the
        # subtraction, square, division, square root per value
        return 2 * (c * h * w + 4 * self.size * h * w) + 4 * c * h * w

    def extra_repr(self) -> str:
        return f"size={self.size}, sigma={self.sigma}, eps={self.eps}"
