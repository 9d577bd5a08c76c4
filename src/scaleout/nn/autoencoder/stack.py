"""One stack of the sparse autoencoder: filter -> L2 pool -> local contrast normalisation, and
the stack's training objective (COTS HPC eq. 1).

The maths is written once, against the filtering layer's communication hooks
(`LocallyConnected2d.gather`, `sum_to_owners`, `owned`, `reduce`) and the stack's own
`pool`, `lcn` and `coverage`. With the plain layers the hooks are identities and a stack is
the single-process network's; after `scaleout.parallel.parallelize` has swapped in a worker's
part of each layer, the same code gives that worker's part: its codes, its features, and its
terms of the objective, which sum over the workers to the single-process objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from scaleout.nn.autoencoder.tied import tied_autoencode
from scaleout.nn.local.functional import (
    inverse_row_norms,
    local_linear,
    local_linear_t,
    normalize_rows,
)
from scaleout.nn.local.geometry import LocalGeometry
from scaleout.nn.local.kernels import from_hwcn, local_forward, to_hwcn
from scaleout.nn.local.layers import L2Pool2d, LocalContrastNorm2d, LocallyConnected2d

__all__ = ["ObjectiveTerms", "SparseAutoencoderStack"]


class ObjectiveTerms(NamedTuple):
    """The two terms of eq. 1, per example (0-dim tensors)."""

    reconstruction: Tensor
    sparsity: Tensor

    @property
    def total(self) -> Tensor:
        return self.reconstruction + self.sparsity


class SparseAutoencoderStack(nn.Module):
    """One stack: untied block-local filter (unit-norm rows, scalar alpha) -> L2 pooling ->
    local contrast normalisation. `forward` gives the stack's features for the next stack;
    `objective` gives the two terms of eq. 1 for training this stack.

    Every method takes the stack's input x as the caller holds it: all of it on one process;
    on a grid, this worker's tile of it, or the whole data minibatch for the first stack.
    """

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
        # (H, W) bool: input pixels some field reads (a worker's part: of the pixels it owns)
        self.register_buffer("coverage", g.coverage(), persistent=False)

    @property
    def geometry(self) -> LocalGeometry:
        """The filtering layer's: of a worker's block positions on its input window, on a grid."""
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
        x = self.filter.gather(x)  # (N, C, H, W) the filter's positions read
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
        where `initial_alpha` can be off by orders of magnitude. On a grid both sums are
        summed over the workers, so every worker sets the same alpha. Returns the new alpha."""
        one = torch.ones((), dtype=self.alpha.dtype, device=self.alpha.device)
        _, recon = tied_autoencode(self.filter.gather(x), self.filter.weight, one, self.geometry)
        recon = self.filter.sum_to_owners(recon)  # (N, C, H, W) over the owned pixels
        mask = self.coverage.to(recon.dtype)
        sums = torch.stack(
            [(recon * self.filter.owned(x) * mask).sum(), (recon.square() * mask).sum()]
        )
        sums = self.filter.reduce(sums)
        if sums[1] > 0:
            self.alpha.fill_(sums[0] / sums[1])
        return self.alpha.item()

    def objective(self, x: Tensor) -> ObjectiveTerms:
        """Eq. 1 per example, through the fused tied autoencoder (memory-lean backward)."""
        return self._objective(x)[0]

    def objective_and_features(self, x: Tensor) -> tuple[ObjectiveTerms, Tensor]:
        """Eq. 1 per example and the stack's output (`forward`) from one pass: the codes of
        the fused tied autoencoder feed both the sparsity term and the features, so W x is
        computed (and on a grid, the input and the codes exchanged) once. Both are
        differentiable: training all stacks at once (the paper's update of all layers)
        backpropagates through the features into the stacks below."""
        terms, pooled = self._objective(x)
        return terms, self.lcn(pooled)

    def objective_reference(self, x: Tensor) -> ObjectiveTerms:
        """Eq. 1 per example through the generic layers and autograd (for testing)."""
        weight = normalize_rows(self.filter.weight)
        codes = self.alpha * local_linear(self.filter.gather(x), weight, self.geometry)
        recon = local_linear_t(codes, weight, self.geometry)
        return self._terms(x, codes, self.filter.sum_to_owners(recon))

    def _objective(self, x: Tensor) -> tuple[ObjectiveTerms, Tensor]:
        """Eq. 1 per example and the pooled codes, through the fused tied autoencoder."""
        codes, recon = tied_autoencode(
            self.filter.gather(x), self.filter.weight, self.alpha, self.geometry
        )
        # the fields of several workers reach a pixel: their parts of W^T h are summed there
        recon = self.filter.sum_to_owners(recon)
        pooled = self.pool(codes)
        return self._terms(x, codes, recon, pooled), pooled

    def _terms(
        self, x: Tensor, codes: Tensor, recon: Tensor, pooled: Tensor | None = None
    ) -> ObjectiveTerms:
        """The two terms from the codes and the reconstruction over the owned input pixels
        (`pooled`: pool(codes)); on a grid, this worker's part of them (the residuals of its
        pixels, its pools)."""
        n = x.shape[0]
        residual = (recon - self.filter.owned(x)).square()
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
