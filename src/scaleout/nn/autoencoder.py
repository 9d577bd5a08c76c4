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

`_TiedAutoencoder` computes the codes alpha W x and the reconstruction W^T(alpha W x) in one
pass over the rows of block positions, and its backward writes the gradient of W~ — both uses
of W and the unit-norm projection — straight into one weight-sized buffer. Autograd through
the generic layers would hold two or three weight-sized gradients at once (one per use of W,
one from the normalisation); for the 1.8-billion-parameter network that is the difference
between fitting in memory and not (see `scaleout bench local`). `objective_reference`
computes the same objective through the generic, separately differentiated layers; the tests
hold the two together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from scaleout.nn.local import (
    L2Pool2d,
    LocalContrastNorm2d,
    LocalGeometry,
    LocallyConnected2d,
    add_transposed_product,
    from_hwcn,
    gather_blocks,
    gather_fields,
    inverse_row_norms,
    local_forward,
    local_linear,
    local_linear_t,
    normalize_rows,
    scatter_blocks,
    to_hwcn,
)
from scaleout.nn.models import register_model

__all__ = [
    "ObjectiveTerms",
    "StackPhases",
    "SparseAutoencoderNetwork",
    "SparseAutoencoderStack",
    "tied_autoencode",
    "write_filter_image",
]


class ObjectiveTerms(NamedTuple):
    """The two terms of eq. 1, per example (0-dim tensors)."""

    reconstruction: Tensor
    sparsity: Tensor

    @property
    def total(self) -> Tensor:
        return self.reconstruction + self.sparsity


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


class SparseAutoencoderStack(nn.Module):
    """One stack: untied block-local filter (unit-norm rows, scalar alpha) -> L2 pooling ->
    local contrast normalisation. `forward` gives the stack's features for the next stack;
    `objective` gives the two terms of eq. 1 for training this stack."""

    def __init__(
        self,
        in_channels: int,
        in_size: int | tuple[int, int],
        field: int,
        step: int,
        block: Sequence[int],
        pool_size: int = 5,
        pool_stride: int = 1,
        pool_padding: int = 0,
        lcn_size: int = 5,
        lcn_sigma: float = 1.0,
        lcn_eps: float = 1e-2,
        sparsity_weight: float = 0.1,
        eps: float = 1e-2,
    ) -> None:
        super().__init__()
        self.filter = LocallyConnected2d(
            in_channels, in_size, field, step, tuple(block), bias=False
        )
        self.alpha = nn.Parameter(torch.full((), self.initial_alpha(self.filter.geometry)))
        self.pool = L2Pool2d(pool_size, pool_stride, pool_padding, eps)
        self.lcn = LocalContrastNorm2d(lcn_size, lcn_sigma, lcn_eps)
        self.sparsity_weight = sparsity_weight
        g = self.geometry
        self.out_shape = (
            g.depth,
            self.pool.out_size(g.out_height),
            self.pool.out_size(g.out_width),
        )
        self.register_buffer("coverage", g.coverage(), persistent=False)

    @property
    def geometry(self) -> LocalGeometry:
        return self.filter.geometry

    @staticmethod
    def initial_alpha(g: LocalGeometry) -> float:
        """alpha that makes W^T(alpha W x) about x for random unit-norm filters: K random unit
        rows in F dimensions keep about K/F of x's energy, and a covered pixel lies in `overlap`
        fields on average, so W^T W x is about (K/F) overlap x."""
        overlap = 1.0
        for positions in (g.positions_h, g.positions_w):
            overlap *= positions * g.field / ((positions - 1) * g.step + g.field)
        return g.field_size / (g.block_size * overlap)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.geometry.in_shape

    def encode(self, x: Tensor) -> Tensor:
        """alpha W x, W = W~ / ||W~||: differentiable when autograd needs it, else one pass
        that folds the normalisation into a per-neuron scale."""
        weight = self.filter.weight
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or self.alpha.requires_grad
        ):
            return self.alpha * local_linear(x, normalize_rows(weight), self.geometry)
        scale = inverse_row_norms(weight) * self.alpha.detach()
        return from_hwcn(local_forward(to_hwcn(x), weight.detach(), self.geometry, scale))

    def forward(self, x: Tensor) -> Tensor:
        return self.lcn(self.pool(self.encode(x)))

    @torch.no_grad()
    def fit_alpha_(self, x: Tensor) -> float:
        """Set alpha to the least-squares scale of the reconstruction on x,
        <W^T W x, x> / ||W^T W x||^2 over covered pixels: a start that fits whatever the
        stack's input looks like (stacks above the first see LCN output, not white noise),
        where `initial_alpha` can be off by orders of magnitude. Returns the new alpha."""
        one = torch.ones((), dtype=self.alpha.dtype, device=self.alpha.device)
        _, recon = tied_autoencode(x, self.filter.weight, one, self.geometry)
        mask = self.coverage.to(x.dtype)
        energy = (recon.square() * mask).sum()
        if energy > 0:
            self.alpha.fill_((recon * x * mask).sum() / energy)
        return self.alpha.item()

    def objective(self, x: Tensor) -> ObjectiveTerms:
        """Eq. 1 per example, through the fused tied autoencoder (memory-lean backward)."""
        codes, recon = tied_autoencode(x, self.filter.weight, self.alpha, self.geometry)
        return self._terms(x, codes, recon)

    def objective_and_features(self, x: Tensor) -> tuple[ObjectiveTerms, Tensor]:
        """Eq. 1 per example and the stack's output (`forward`) from one pass: the codes of
        the fused tied autoencoder feed both the sparsity term and the features, so W x is
        computed once. Both are differentiable: training all stacks at once (the paper's
        update of all layers) backpropagates through the features into the stacks below."""
        codes, recon = tied_autoencode(x, self.filter.weight, self.alpha, self.geometry)
        pooled = self.pool(codes)
        return self._terms(x, codes, recon, pooled), self.lcn(pooled)

    def objective_reference(self, x: Tensor) -> ObjectiveTerms:
        """Eq. 1 per example through the generic layers and autograd (for testing)."""
        weight = normalize_rows(self.filter.weight)
        codes = self.alpha * local_linear(x, weight, self.geometry)
        return self._terms(x, codes, local_linear_t(codes, weight, self.geometry))

    def _terms(
        self, x: Tensor, codes: Tensor, recon: Tensor, pooled: Tensor | None = None
    ) -> ObjectiveTerms:
        """The two terms from the codes and the reconstruction (`pooled`: pool(codes))."""
        n = x.shape[0]
        residual = (recon - x).square()
        if not bool(self.coverage.all()):
            residual = residual * self.coverage
        reconstruction = residual.sum() / n
        pooled = self.pool(codes) if pooled is None else pooled
        return ObjectiveTerms(reconstruction, self.sparsity_weight * pooled.sum() / n)

    def flops_per_example(self) -> dict[str, int]:
        """Forward FLOPs of the filter, pooling and normalisation layers, per example."""
        g = self.geometry
        return {
            "filter": g.matmul_flops(1),
            "pool": self.pool.flops_per_example(g.out_shape),
            "lcn": self.lcn.flops_per_example(self.out_shape),
        }

    def objective_flops_per_example(self) -> int:
        """GEMM FLOPs of one objective + gradient evaluation per example: W x, W^T h, W dL/dr,
        and the weight gradient's two products (the input gradient is not needed when the
        stack's input is data or frozen features)."""
        return 5 * self.geometry.matmul_flops(1)


def _per_stack(value: object, num_stacks: int, name: str, depth: int = 0) -> list:
    """One value for all stacks, or a list with one per stack (`depth` = nesting of a value)."""
    nested = value
    for _ in range(depth):
        nested = nested[0] if isinstance(nested, list | tuple) and nested else None
    if isinstance(nested, list | tuple):
        values = list(value)  # type: ignore[arg-type]
        if len(values) != num_stacks:
            raise ValueError(
                f"model.{name} has {len(values)} values for {num_stacks} stacks: give one value "
                f"or {num_stacks}"
            )
        return values
    return [value] * num_stacks


class StackPhases:
    """Greedy layer-wise training's interface (`scaleout.train.objective.LayerwiseModel`)
    for a network of stacks: phase k trains stack k + 1 on the output of the frozen stacks
    below. Needs `stacks`, `stack_objective`, `stack_parameter_groups`, `fit_alpha_` and
    `train_only`; a model-parallel worker's part of the network has them too."""

    stacks: nn.ModuleList

    @property
    def num_phases(self) -> int:
        return len(self.stacks)

    def phase_parameter_groups(self, phase: int, lr: float) -> list[dict]:
        return self.stack_parameter_groups(phase, lr)  # type: ignore[attr-defined]

    def begin_phase(self, x: Tensor, phase: int) -> None:
        """Fit the stack's alpha on its first minibatch (`fit_alpha_`)."""
        self.fit_alpha_(x, phase)  # type: ignore[attr-defined]

    def phase_objective(self, x: Tensor, phase: int) -> dict[str, Tensor]:
        terms: ObjectiveTerms = self.stack_objective(x, phase)  # type: ignore[attr-defined]
        return {"reconstruction": terms.reconstruction, "sparsity": terms.sparsity}

    def phase_metrics(self, phase: int) -> dict[str, float | int]:
        return {"stack": phase + 1, "alpha": self.stacks[phase].alpha.item()}


@register_model("sparse_autoencoder")
class SparseAutoencoderNetwork(StackPhases, nn.Module):
    """Stacks of `SparseAutoencoderStack`, each fed the previous one's output (COTS HPC
    section 3: three stacks make the 9-layer network). Every stack setting takes one value
    for all stacks or a list with one per stack; `alpha_lr_scale` is alpha's step size
    relative to the filters' in greedy training."""

    def __init__(
        self,
        in_channels: int = 3,
        in_size: int = 200,
        num_stacks: int = 3,
        field: int | Sequence[int] = 20,
        step: int | Sequence[int] = 4,
        block: Sequence[int] | Sequence[Sequence[int]] = (4, 4, 8),
        pool_size: int | Sequence[int] = 5,
        pool_stride: int | Sequence[int] = 1,
        pool_padding: int | Sequence[int] = 0,
        lcn_size: int | Sequence[int] = 5,
        lcn_sigma: float | Sequence[float] = 1.0,
        lcn_eps: float = 1e-2,
        sparsity_weight: float = 0.1,
        eps: float = 1e-2,
        alpha_lr_scale: float = 1e-4,
    ) -> None:
        super().__init__()
        self.alpha_lr_scale = alpha_lr_scale
        if num_stacks < 1:
            raise ValueError(f"model.num_stacks must be >= 1, got {num_stacks}")
        per = {
            "field": _per_stack(field, num_stacks, "field"),
            "step": _per_stack(step, num_stacks, "step"),
            "block": _per_stack(block, num_stacks, "block", depth=1),
            "pool_size": _per_stack(pool_size, num_stacks, "pool_size"),
            "pool_stride": _per_stack(pool_stride, num_stacks, "pool_stride"),
            "pool_padding": _per_stack(pool_padding, num_stacks, "pool_padding"),
            "lcn_size": _per_stack(lcn_size, num_stacks, "lcn_size"),
            "lcn_sigma": _per_stack(lcn_sigma, num_stacks, "lcn_sigma"),
        }
        self.input_shape: tuple[int, int, int] = (in_channels, in_size, in_size)
        stacks = []
        channels, size = in_channels, (in_size, in_size)
        for k in range(num_stacks):
            options = {name: values[k] for name, values in per.items()}
            if options["field"] > min(size):
                raise ValueError(
                    f"model.field = {options['field']} for stack {k + 1} does not fit its "
                    f"{size[0]}x{size[1]} input (the output of stack {k}); use a smaller field "
                    "or a larger model.in_size"
                )
            stack = SparseAutoencoderStack(
                channels, size, **options, lcn_eps=lcn_eps, sparsity_weight=sparsity_weight, eps=eps
            )
            stacks.append(stack)
            channels, size = stack.out_shape[0], stack.out_shape[1:]
        self.stacks = nn.ModuleList(stacks)

    @property
    def num_stacks(self) -> int:
        return len(self.stacks)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return self.stacks[-1].out_shape

    def features(self, x: Tensor, num_stacks: int | None = None) -> Tensor:
        """The output of the first `num_stacks` stacks (all by default); x itself for 0."""
        for stack in self.stacks[: self.num_stacks if num_stacks is None else num_stacks]:
            x = stack(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        return self.features(x)

    @torch.no_grad()
    def fit_alpha_(self, x: Tensor, index: int) -> float:
        """Start stack `index`'s alpha at the least-squares scale on the data minibatch x,
        as greedy training does at a stack's start (`SparseAutoencoderStack.fit_alpha_` on
        the features of the stacks below)."""
        return self.stacks[index].fit_alpha_(self.features(x, index))

    def stack_parameters(self, index: int) -> Iterator[nn.Parameter]:
        """The parameters greedy training optimises while training stack `index`."""
        return self.stacks[index].parameters()

    def stack_parameter_groups(self, index: int, lr: float) -> list[dict]:
        """torch.optim parameter groups for stack `index`: the filters at `lr`, alpha at
        `lr * alpha_lr_scale` (alpha scales every code, so its curvature is far higher)."""
        stack = self.stacks[index]
        return [
            {"params": [stack.filter.weight]},
            {"params": [stack.alpha], "lr": lr * self.alpha_lr_scale},
        ]

    def train_only(self, index: int) -> None:
        """Freeze every stack but `index` (greedy layer-wise training)."""
        for k, stack in enumerate(self.stacks):
            stack.requires_grad_(k == index)

    def layer_costs(self) -> list[dict]:
        """Parameters and forward FLOPs per example of every layer, exact from the layer
        definitions (for `scaleout info`; a multiply-add counts 2)."""
        rows = []
        for k, stack in enumerate(self.stacks):
            g, flops = stack.geometry, stack.flops_per_example()
            rows += [
                {
                    "name": f"stacks.{k}.filter",
                    "kind": "LocallyConnected2d",
                    "shapes": [g.weight_shape],
                    "params": g.num_weights,
                    "flops": flops["filter"],
                },
                {
                    "name": f"stacks.{k}.alpha",
                    "kind": "scale",
                    "shapes": [()],
                    "params": 1,
                    "flops": g.depth * g.out_height * g.out_width,
                },
                {
                    "name": f"stacks.{k}.pool",
                    "kind": "L2Pool2d",
                    "shapes": [],
                    "params": 0,
                    "flops": flops["pool"],
                },
                {
                    "name": f"stacks.{k}.lcn",
                    "kind": "LocalContrastNorm2d",
                    "shapes": [],
                    "params": 0,
                    "flops": flops["lcn"],
                },
            ]
        return rows

    def cost_notes(
        self, batch: int = 96, bytes_per_value: int = 4, optimizer_buffers: int = 1
    ) -> list[str]:
        """Greedy training's memory and FLOPs per stack: training stack k needs the weights of
        stacks 1..k and stack k's gradient and optimizer state (`optimizer_buffers` values per
        parameter), nothing of the stacks above."""
        per_stack = [sum(p.numel() for p in stack.parameters()) for stack in self.stacks]
        notes = [
            f"greedy training, minibatch of {batch} (a multiply-add is 2 FLOPs; "
            f"all weights: {_gib(sum(per_stack) * bytes_per_value)}):"
        ]
        below_flops, below_weights = 0, 0
        for k, (stack, count) in enumerate(zip(self.stacks, per_stack, strict=True)):
            weights = below_weights + count * bytes_per_value
            extra = count * bytes_per_value * (1 + optimizer_buffers)
            step_flops = below_flops + stack.objective_flops_per_example()
            notes.append(
                f"  stack {k + 1}: {count:,} parameters; needs {_gib(weights + extra)} (weights "
                f"of stacks 1-{k + 1} {_gib(weights)} + gradient and {optimizer_buffers} "
                f"optimizer buffer(s) {_gib(extra)}); {step_flops * batch / 1e12:.3f} TFLOP per "
                f"step ({below_flops * batch / 1e12:.3f} of them through stacks below)"
            )
            below_flops += sum(stack.flops_per_example().values())
            below_weights = weights
        notes.append(f"  forward pass through all stacks: {below_flops * batch / 1e12:.3f} TFLOP")
        return notes

    def stack_objective(self, x: Tensor, index: int) -> ObjectiveTerms:
        """Eq. 1 for stack `index` on data x: the frozen stacks below run without autograd."""
        with torch.no_grad():
            inputs = self.features(x, index)
        return self.stacks[index].objective(inputs)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def write_filter_image(
    weight: Tensor, geometry: LocalGeometry, path: Path, max_filters: int = 256
) -> Path:
    """The filters of the block position at the centre of the grid as a PNG grid, each scaled
    to its own range (grey for 0; RGB when the input has 3 channels, else the channel mean).
    Trained first-layer filters on whitened images look like localised, oriented edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    g = geometry
    filters = weight.detach()[g.positions_h // 2, g.positions_w // 2].float().cpu()  # (K, F)
    filters = filters[:max_filters].view(-1, g.field, g.field, g.in_channels)  # (K, f, f, C)
    if g.in_channels != 3:
        filters = filters.mean(dim=-1, keepdim=True)
    peak = filters.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(1e-12)
    tiles = (0.5 + 0.5 * filters / peak).numpy()  # in [0, 1], grey = 0
    count = tiles.shape[0]
    columns = min(16, count)
    rows = -(-count // columns)
    pad, side = 1, g.field
    canvas = np.ones((rows * (side + pad) + pad, columns * (side + pad) + pad, tiles.shape[-1]))
    for k in range(count):
        r, c = divmod(k, columns)
        top, left = pad + r * (side + pad), pad + c * (side + pad)
        canvas[top : top + side, left : left + side] = tiles[k]
    if canvas.shape[-1] == 1:
        canvas = np.repeat(canvas, 3, axis=-1)
    scale = max(1, 512 // canvas.shape[1])
    canvas = np.kron(canvas, np.ones((scale, scale, 1)))  # nearest-neighbour upscale
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.imsave(path, np.clip(canvas, 0.0, 1.0))
    return path
