"""The fused tied autoencoder of a stack's filtering layer: codes h = alpha W x and the
reconstruction r = W^T h in one pass over the rows of block positions, with W = W~ / ||W~||
row by row (the optimised variable is W~).

Its backward writes the gradient of W~ (both uses of W and the unit-norm projection) straight
into one weight-sized buffer. Autograd through the generic layers would hold two or three
weight-sized gradients at once (one per use of W, one from the normalisation); for the
1.8-billion-parameter network that is the difference between fitting in memory and not (see
`python -m benchmarks local`). `SparseAutoencoderStack.objective_reference` computes the same
objective through the generic, separately differentiated layers; the tests hold the two
together.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from scaleout.nn.local.functional import inverse_row_norms
from scaleout.nn.local.geometry import LocalGeometry
from scaleout.nn.local.kernels import (
    add_transposed_product,
    from_hwcn,
    gather_blocks,
    gather_fields,
    scatter_blocks,
    to_hwcn,
)

__all__ = ["tied_autoencode"]


class _TiedAutoencoder(torch.autograd.Function):
    """(x, W~, alpha) -> (h, r): codes h = alpha W x and reconstruction r = W^T h, with
    W = W~ / ||W~|| row by row. Saves x, W~ and u = W x; never a weight-sized temporary."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: Tensor, weight: Tensor, alpha: Tensor, g: LocalGeometry
    ) -> tuple[Tensor, Tensor]:
        xt = to_hwcn(x)
        n = xt.shape[-1]
        inv = inverse_row_norms(weight)  # (P_h, P_w, K)
        ut = xt.new_empty(g.out_height, g.out_width, g.depth, n)  # u = W x
        rt = xt.new_zeros(g.in_height, g.in_width, g.in_channels, n)  # r = W^T (alpha u)
        fields = xt.new_empty(g.positions_w, g.field_size, n)
        blocks = xt.new_empty(g.positions_w, g.block_size, n)
        for row in range(g.positions_h):
            scale = inv[row].unsqueeze(-1)  # (P_w, K, 1)
            gather_fields(xt, g, row, fields)
            torch.bmm(weight[row], fields, out=blocks)  # W~ x
            blocks.mul_(scale)  # u = W x
            scatter_blocks(blocks, ut, g, row)
            blocks.mul_(scale * alpha)  # W^T (alpha u) = W~^T (scale * alpha u)
            add_transposed_product(weight[row], blocks, rt, g, row, fields)
        ctx.save_for_backward(xt, weight, alpha, inv, ut)
        ctx.geometry = g  # type: ignore[attr-defined]
        return from_hwcn(ut * alpha), from_hwcn(rt)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_h: Tensor | None, grad_r: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        xt, weight, alpha, inv, ut = ctx.saved_tensors  # type: ignore[attr-defined]
        g: LocalGeometry = ctx.geometry  # type: ignore[attr-defined]
        need_x, need_w, need_alpha, _ = ctx.needs_input_grad  # type: ignore[attr-defined]
        n = xt.shape[-1]
        gh = None if grad_h is None else to_hwcn(grad_h)
        gr = None if grad_r is None else to_hwcn(grad_r)
        grad_w = torch.empty_like(weight) if need_w else None
        grad_xt = torch.zeros_like(xt) if need_x else None
        grad_alpha = torch.zeros_like(alpha)
        x_fields = xt.new_empty(g.positions_w, g.field_size, n)
        r_fields = xt.new_empty(g.positions_w, g.field_size, n)
        d = xt.new_empty(g.positions_w, g.block_size, n)  # dL/dh per block
        u = xt.new_empty(g.positions_w, g.block_size, n)  # u = W x per block
        spare = xt.new_empty(g.positions_w, g.block_size, n)
        for row in range(g.positions_h):
            scale = inv[row].unsqueeze(-1)  # (P_w, K, 1)
            gather_blocks(ut, g, row, u)
            # dL/dh = the codes' own gradient + W dL/dr (the decoder r = W^T h)
            u_dot_decoder = 0.0
            if gr is not None:
                gather_fields(gr, g, row, r_fields)
                torch.bmm(weight[row], r_fields, out=d)
                d.mul_(scale)  # W dL/dr
                u_dot_decoder = torch.linalg.vecdot(u, d)  # (P_w, K): sum_n u (W dL/dr)
                if gh is not None:
                    d.add_(gather_blocks(gh, g, row, spare))
            elif gh is not None:
                gather_blocks(gh, g, row, d)
            else:
                d.zero_()
            u_dot_d = torch.linalg.vecdot(u, d)  # (P_w, K)
            grad_alpha += u_dot_d.sum()  # h = alpha u
            if grad_w is not None:
                gather_fields(xt, g, row, x_fields)
                _weight_gradient(
                    grad_w[row],
                    weight[row],
                    alpha,
                    inv[row],
                    u_dot_d + u_dot_decoder,
                    d,
                    x_fields,
                    None if gr is None else (u, r_fields),
                    spare,
                )
            if grad_xt is not None:  # dL/dx = W^T (alpha dL/dh)
                d.mul_(scale * alpha)
                add_transposed_product(weight[row], d, grad_xt, g, row, x_fields)
        grad_x = None if grad_xt is None else from_hwcn(grad_xt)
        return grad_x, grad_w, grad_alpha if need_alpha else None, None


def _weight_gradient(
    out: Tensor,
    weight: Tensor,
    alpha: Tensor,
    inv: Tensor,
    dots: Tensor,
    d: Tensor,
    x_fields: Tensor,
    decoder: tuple[Tensor, Tensor] | None,
    spare: Tensor,
) -> None:
    """dL/dW~ for one row of block positions, into `out` (P, K, F).

    With W = s W~ (s = 1/||W~||, per row), h = alpha W x and r = W^T h, the gradient with
    respect to W is G = alpha (d x^T + u dr^T) (d = dL/dh, u = W x, dr = dL/dr), and through
    the normalisation dL/dW~ = s G - s^3 <G, W~> W~. The inner products need no pass over G:
    <d x^T + u dr^T, W~>_k = (1/s) sum_n u (d + W dr), which the caller passes as `dots`
    (sum_n u (d + W dr)). The scale alpha s is applied to d and u before the products, so
    the gradient is written once by the GEMMs and corrected by one more pass:
    dL/dW~ = (alpha s d) x^T + (alpha s u) dr^T - alpha s^2 dots W~.
    """
    scale = (alpha * inv).unsqueeze(-1)  # (P, K, 1): alpha s
    torch.mul(d, scale, out=spare)
    torch.bmm(spare, x_fields.transpose(1, 2), out=out)  # (P, K, N) @ (P, N, F)
    if decoder is not None:
        u, r_fields = decoder
        torch.mul(u, scale, out=spare)
        out.baddbmm_(spare, r_fields.transpose(1, 2))
    out.addcmul_(weight, (-alpha * inv**2 * dots).unsqueeze(-1))


def tied_autoencode(
    x: Tensor, weight: Tensor, alpha: Tensor, geometry: LocalGeometry
) -> tuple[Tensor, Tensor]:
    """Codes alpha W x and reconstruction W^T(alpha W x) with W the unit-norm rows of
    `weight`; both (N, ., ., .) views of (H, W, C, N)-ordered memory."""
    if x.dim() != 4 or tuple(x.shape[1:]) != geometry.in_shape:
        raise ValueError(f"input has shape {tuple(x.shape)}; expected (N, {geometry.in_shape})")
    return _TiedAutoencoder.apply(x, weight, alpha, geometry)
