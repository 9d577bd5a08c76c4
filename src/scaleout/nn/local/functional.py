"""The differentiable operations of a locally connected layer: W x (+ b) and W^T y with
hand-written backward passes, the `F.unfold` reference, and unit-norm rows.

The backward passes recompute X[p] from the input instead of saving the unfolded input,
(field/step)^2 times the input's size, and run faster than autograd through `F.unfold`
(`local_linear_unfold`, kept as the reference; `python -m benchmarks local` measures both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from scaleout.nn.local.geometry import LocalGeometry
from scaleout.nn.local.kernels import (
    block_sums,
    from_hwcn,
    local_forward,
    local_transpose,
    local_weight_grad,
    to_hwcn,
)

__all__ = [
    "inverse_row_norms",
    "local_linear",
    "local_linear_t",
    "local_linear_unfold",
    "normalize_rows",
]

# Rows of a weight matrix normalised per chunk: small enough that a chunk stays in cache
# between its reads, large enough that Python overhead is negligible.
NORMALIZE_CHUNK_VALUES = 1 << 18


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
