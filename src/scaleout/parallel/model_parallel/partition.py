"""Model parallelism of the sparse autoencoder (COTS HPC section 4.2, DistBelief section 3):
one replica of a `SparseAutoencoderNetwork` partitioned over a px x py grid of workers along
H and W, applied from outside: the model code in `scaleout.nn` has no communication, and
every exchange goes through a `DistributedArray`.

Per stack, worker i owns the block positions `partition_local(filter geometry)[i].units` and
holds only their filters (a slice of the global weight, so with the same seed the partitioned
network starts from exactly the single-process weights); alpha is replicated and its gradient
is summed over the workers (`sync_grads`). Every activation is partitioned over the grid:

    stack input  (owned: previous LCN output windows, or an even split of the data)
      --exchange--> filter input window in_i --filter--> codes over out_i (a tiling)
      --exchange--> pool input windows --L2 pool--> pooled over a tiling
      --exchange--> LCN input windows --LCN--> features over a tiling (next stack's input)

The objective (COTS HPC eq. 1) of stack k on worker i: the codes and the partial
reconstruction W_i^T h_i over in_i come from the fused `tied_autoencode` on the worker's
sub-geometry; the partial reconstructions overlap and are summed onto the owners of the input
pixels by one more exchange (the overlapping output windows of the paper); the residual and
the sparsity are then summed over pixels each worker owns, so the objectives of all workers
add up to the single-process objective. Each worker's terms are its part: all-reduce them
(`total_terms`) for the value; `loss.backward()` on the worker's own part, followed by
`sync_grads()`, gives every worker the exact gradient of the total for its filters and alpha.

The first stack reads the data, which every worker has whole (the same minibatch): it slices
its input window instead of exchanging it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from scaleout.comm.darray import DistributedArray, Transport
from scaleout.comm.windows import Window, partition_local, partition_pixels, split_even
from scaleout.compress import Codec
from scaleout.nn.autoencoder import (
    ObjectiveTerms,
    SparseAutoencoderNetwork,
    SparseAutoencoderStack,
    StackPhases,
    tied_autoencode,
)
from scaleout.nn.local import (
    L2Pool2d,
    from_hwcn,
    inverse_row_norms,
    local_forward,
    local_linear,
    normalize_rows,
    to_hwcn,
)

__all__ = ["PartitionedAutoencoder", "PartitionedStack", "even_tiling"]


def even_tiling(size: tuple[int, int], grid: Sequence[int]) -> list[Window]:
    """Pixels of an H x W map split as evenly as possible over the grid (index = rank)."""
    rows = split_even(size[0], grid[0], "rows")
    cols = split_even(size[1], grid[1], "columns")
    return [Window(r, c) for r in rows for c in cols]


def _crop(t: Tensor, inner: Window, outer: Window) -> Tensor:
    """The part of `t` (N, C, *outer shape) over `inner`."""
    return t[(..., *inner.relative_to(outer))]


class PartitionedStack(nn.Module):
    """Worker `rank`'s part of one `SparseAutoencoderStack`.

    `owners[j]` is the window of the stack's input that worker j holds (a tiling), or None
    when every worker holds the whole input (the data); `owners` then defaults to an even
    tiling for the reconstruction's residual.
    """

    def __init__(
        self,
        stack: SparseAutoencoderStack,
        grid: Sequence[int],
        rank: int,
        owners: Sequence[Window] | None,
        group: dist.ProcessGroup | None = None,
        transport: Transport = "all_to_all",
        codec: Codec | None = None,
    ) -> None:
        super().__init__()
        g = stack.geometry
        world = grid[0] * grid[1]
        self.rank, self.group = rank, group
        self.replicated_input = owners is None
        self.owners = (
            even_tiling((g.in_height, g.in_width), grid) if owners is None else list(owners)
        )
        if len(self.owners) != world:
            raise ValueError(f"need {world} input owner windows, got {len(self.owners)}")
        filters = partition_local(g, grid)
        mine = filters[rank]
        self.units, self.output, self.input = mine.units, mine.output, mine.input
        self.geometry = g.sub(mine.units.rows, mine.units.cols)
        # only this worker's filters: (rows of positions, columns of positions, K, F)
        self.weight = nn.Parameter(stack.filter.weight.detach()[mine.units.slices].clone())
        self.global_weight_shape = g.weight_shape
        self.alpha = nn.Parameter(stack.alpha.detach().clone())
        self.sparsity_weight = stack.sparsity_weight
        own = self.owners[rank]
        self.register_buffer("coverage", stack.coverage[own.slices].clone(), persistent=False)

        def array(outputs: Sequence[Window], inputs: Sequence[Window]) -> DistributedArray:
            return DistributedArray(outputs, inputs, rank, group, transport, codec)

        outputs = [w.output for w in filters]
        self.to_filter = array(self.owners, [w.input for w in filters])
        # partial reconstructions over the filter input windows, summed onto the owners
        self.to_owners = array([w.input for w in filters], self.owners)
        # L2 pooling over output pixels; zero padding added locally where a window is clipped
        pool = stack.pool
        codes_size = (g.out_height, g.out_width)
        pools = partition_pixels(
            (pool.out_size(g.out_height), pool.out_size(g.out_width)),
            codes_size,
            pool.input_window,
            grid,
        )
        self.to_pool = array(outputs, [w.input for w in pools])
        self.pool_output = pools[rank].output
        self.local_pool = L2Pool2d(pool.size, pool.stride, 0, pool.eps)
        self.pool_padding = _padding(pool, self.pool_output, pools[rank].input)
        # contrast normalisation: its output at p reads inputs within 2 * (size // 2), and its
        # border rule only looks at the map's own borders, so running it on the window and
        # keeping the middle is exact
        self.lcn = stack.lcn
        pooled_size = stack.out_shape[1:]
        lcns = partition_pixels(pooled_size, pooled_size, stack.lcn.input_window, grid)
        self.to_lcn = array([w.output for w in pools], [w.input for w in lcns])
        self.lcn_output, self.lcn_input = lcns[rank].output, lcns[rank].input
        self.feature_windows = [w.output for w in lcns]  # owners of the next stack's input

    def exchanges(self, training: bool) -> list[tuple[DistributedArray, int, bool]]:
        """(array, channels, whether its gradient is exchanged back) for each exchange of one
        pass: the forward to the next stack (`training` False), or this stack's objective
        and backward (True; the stack's input comes from frozen stacks and needs no
        gradient)."""
        channels, depth = self.geometry.in_channels, self.geometry.depth
        first = [] if self.replicated_input else [(self.to_filter, channels, False)]
        if training:
            return [*first, (self.to_owners, channels, True), (self.to_pool, depth, True)]
        return [*first, (self.to_pool, depth, False), (self.to_lcn, depth, False)]

    def _filter_input(self, x: Tensor) -> Tensor:
        if self.replicated_input:
            return x[(..., *self.input.slices)]
        return self.to_filter(x)

    def _owned_input(self, x: Tensor) -> Tensor:
        if self.replicated_input:
            return x[(..., *self.owners[self.rank].slices)]
        return x

    def encode(self, x: Tensor) -> Tensor:
        """Codes alpha W x over this worker's output window; x as `features` takes it."""
        xi = self._filter_input(x)
        if torch.is_grad_enabled() and (self.weight.requires_grad or xi.requires_grad):
            return self.alpha * local_linear(xi, normalize_rows(self.weight), self.geometry)
        scale = inverse_row_norms(self.weight) * self.alpha.detach()
        return from_hwcn(local_forward(to_hwcn(xi), self.weight.detach(), self.geometry, scale))

    def _pool(self, codes: Tensor) -> Tensor:
        """Pooled codes over this worker's pool output window."""
        window = self.to_pool(codes)
        if any(self.pool_padding):
            window = F.pad(window, self.pool_padding)
        return self.local_pool(window)

    def forward(self, x: Tensor) -> Tensor:
        """Features (LCN output) over `feature_windows[rank]`; x is the whole input when it is
        replicated, else this worker's owned window of it."""
        return self._features(self._pool(self.encode(x)))

    def _features(self, pooled: Tensor) -> Tensor:
        """LCN of the pooled codes, over `feature_windows[rank]`."""
        normalised = self.lcn(self.to_lcn(pooled))
        return _crop(normalised, self.lcn_output, self.lcn_input)

    @torch.no_grad()
    def fit_alpha_(self, x: Tensor) -> float:
        """`SparseAutoencoderStack.fit_alpha_` over the whole replica: alpha = <W^T W x, x> /
        ||W^T W x||^2 over covered pixels, both sums all-reduced, the same alpha everywhere."""
        one = torch.ones((), dtype=self.alpha.dtype, device=self.alpha.device)
        _, recon = tied_autoencode(self._filter_input(x), self.weight, one, self.geometry)
        recon = self.to_owners(recon)
        mask = self.coverage.to(recon.dtype)
        sums = torch.stack(
            [(recon * self._owned_input(x) * mask).sum(), (recon.square() * mask).sum()]
        )
        if dist.is_initialized():
            dist.all_reduce(sums, group=self.group)
        if sums[1] > 0:
            self.alpha.fill_(sums[0] / sums[1])
        return self.alpha.item()

    def objective(self, x: Tensor) -> ObjectiveTerms:
        """This worker's part of eq. 1 (per example); the parts of all workers sum to it."""
        return self._objective(x)[0]

    def objective_and_features(self, x: Tensor) -> tuple[ObjectiveTerms, Tensor]:
        """`SparseAutoencoderStack.objective_and_features` on this worker's part: its part
        of eq. 1 and the features over `feature_windows[rank]`, with W x, the exchange of the
        input and that of the codes done once for both."""
        terms, pooled = self._objective(x)
        return terms, self._features(pooled)

    def _objective(self, x: Tensor) -> tuple[ObjectiveTerms, Tensor]:
        """This worker's part of eq. 1, and its pooled codes."""
        xi = self._filter_input(x)
        codes, recon = tied_autoencode(xi, self.weight, self.alpha, self.geometry)
        recon = self.to_owners(recon)  # summed over every worker whose fields reach here
        n = xi.shape[0]
        residual = (recon - self._owned_input(x)).square() * self.coverage
        pooled = self._pool(codes)
        terms = ObjectiveTerms(residual.sum() / n, self.sparsity_weight * pooled.sum() / n)
        return terms, pooled


def _padding(pool: L2Pool2d, output: Window, clipped: Window) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) zeros that extend `clipped` to the full pooling windows of
    `output` (the global layer's zero padding, where the window meets the map's border)."""
    amounts = []
    for out, have in ((output.cols, clipped.cols), (output.rows, clipped.rows)):
        start = out.start * pool.stride - pool.padding
        stop = (out.stop - 1) * pool.stride - pool.padding + pool.size
        amounts += [have.start - start, stop - have.stop]
    return tuple(amounts)  # type: ignore[return-value]


class PartitionedAutoencoder(StackPhases, nn.Module):
    """Worker `rank`'s part of a `SparseAutoencoderNetwork` on a px x py grid (see the module
    docstring). Build it on every worker from the same global network (same seed)."""

    def __init__(
        self,
        network: SparseAutoencoderNetwork,
        grid: Sequence[int],
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        transport: Transport = "all_to_all",
        codec: Codec | None = None,
    ) -> None:
        super().__init__()
        if len(grid) != 2 or not all(isinstance(v, int) and v >= 1 for v in grid):
            raise ValueError(f"model_parallel.grid must be two positive ints, got {list(grid)!r}")
        world = grid[0] * grid[1]
        if rank is None:
            rank = dist.get_rank(group) if dist.is_initialized() else 0
        if dist.is_initialized() and dist.get_world_size(group) != world:
            raise ValueError(
                f"model_parallel.grid {list(grid)} needs {world} workers, the process group has "
                f"{dist.get_world_size(group)}"
            )
        self.grid, self.rank, self.group = tuple(grid), rank, group
        self.alpha_lr_scale = network.alpha_lr_scale
        stacks: list[PartitionedStack] = []
        owners: list[Window] | None = None
        for stack in network.stacks:
            part = PartitionedStack(stack, grid, rank, owners, group, transport, codec)
            stacks.append(part)
            owners = part.feature_windows
        self.stacks = nn.ModuleList(stacks)

    @property
    def num_stacks(self) -> int:
        return len(self.stacks)

    def features(self, x: Tensor, num_stacks: int | None = None) -> Tensor:
        """This worker's part of the output of the first `num_stacks` stacks; x is the whole
        minibatch (N, C, H, W), the same on every worker. For 0 stacks, x itself."""
        count = self.num_stacks if num_stacks is None else num_stacks
        for stack in self.stacks[:count]:
            x = stack(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        return self.features(x)

    def stack_objective(self, x: Tensor, index: int) -> ObjectiveTerms:
        """This worker's part of eq. 1 for stack `index`; the stacks below run without
        autograd (greedy training)."""
        with torch.no_grad():
            inputs = self.features(x, index)
        return self.stacks[index].objective(inputs)

    @torch.no_grad()
    def fit_alpha_(self, x: Tensor, index: int) -> float:
        """Start stack `index`'s alpha at the least-squares scale on minibatch x (the whole
        minibatch, as `features` takes it), as greedy training does at a stack's start."""
        return self.stacks[index].fit_alpha_(self.features(x, index))

    def bytes_per_step(self, index: int, batch: int) -> int:
        """Bytes this worker sends in one training step of stack `index`: forward through the
        stacks below, the objective's exchanges and their backward."""
        total = 0
        for k, stack in enumerate(self.stacks[: index + 1]):
            for array, channels, backward in stack.exchanges(k == index):
                total += array.bytes_sent(batch, channels)
                if backward:
                    total += array.bytes_sent(batch, channels, backward=True)
        return total

    @torch.no_grad()
    def global_state_dict(self) -> dict[str, Tensor]:
        """The whole replica's parameters under `SparseAutoencoderNetwork`'s names (for
        checkpoints in strategy "single"'s format, filter images, a Downpour push): every
        worker writes its filters into zeros of the global shape and one all-reduce sums
        them; each value has one non-zero term, so the result is exact. Alpha is replicated."""
        state = {}
        for k, stack in enumerate(self.stacks):
            state[f"stacks.{k}.filter.weight"] = self.gather_filters(k, stack.weight)
            state[f"stacks.{k}.alpha"] = stack.alpha.detach().clone()
        return state

    @torch.no_grad()
    def gather_filters(self, index: int, local: Tensor) -> Tensor:
        """A tensor shaped like stack `index`'s local filters (the weight, or its optimizer
        state) assembled over the replica into the global weight's shape, on every worker:
        each worker writes its part into zeros and one all-reduce sums them (one non-zero
        term per value, so the sum is exact)."""
        stack = self.stacks[index]
        full = local.new_zeros(stack.global_weight_shape)
        full[stack.units.slices] = local
        if dist.is_initialized():
            dist.all_reduce(full, group=self.group)
        return full

    def local_filters(self, index: int, full: Tensor) -> Tensor:
        """This worker's part of a tensor of stack `index`'s global weight shape."""
        return full[self.stacks[index].units.slices].clone()

    @torch.no_grad()
    def load_global_state_dict(self, state: dict[str, Tensor]) -> None:
        """Take this worker's slices of a `SparseAutoencoderNetwork` state dict (resume)."""
        for k, stack in enumerate(self.stacks):
            full = state[f"stacks.{k}.filter.weight"]
            if tuple(full.shape) != stack.global_weight_shape:
                raise ValueError(
                    f"stacks.{k}.filter.weight has shape {tuple(full.shape)}, this network "
                    f"needs {stack.global_weight_shape}: load a checkpoint of the same model"
                )
            stack.weight.copy_(full[stack.units.slices])
            stack.alpha.copy_(state[f"stacks.{k}.alpha"])

    def total_terms(self, terms: ObjectiveTerms) -> ObjectiveTerms:
        """The objective of the whole replica: the workers' parts summed (an all-reduce)."""
        values = torch.stack([terms.reconstruction.detach(), terms.sparsity.detach()])
        if dist.is_initialized():
            dist.all_reduce(values, group=self.group)
        return ObjectiveTerms(values[0], values[1])

    def sync_grads(self) -> None:
        """Sum the gradients of the replicated parameters (alpha) over the workers; each
        worker's filters get their whole gradient from its own backward already."""
        alphas = [s.alpha for s in self.stacks if s.alpha.grad is not None]
        if not alphas or not dist.is_initialized():
            return
        grads = torch.stack([a.grad for a in alphas])  # type: ignore[misc]
        dist.all_reduce(grads, group=self.group)
        for alpha, grad in zip(alphas, grads, strict=True):
            alpha.grad.copy_(grad)  # type: ignore[union-attr]

    def stack_parameter_groups(
        self, index: int, lr: float, alpha_lr_scale: float | None = None
    ) -> list[dict]:
        """torch.optim groups for stack `index`, as `SparseAutoencoderNetwork` builds them
        (alpha's step is `lr * alpha_lr_scale`, the network's own scale by default)."""
        stack = self.stacks[index]
        scale = self.alpha_lr_scale if alpha_lr_scale is None else alpha_lr_scale
        return [
            {"params": [stack.weight]},
            {"params": [stack.alpha], "lr": lr * scale},
        ]

    def train_only(self, index: int) -> None:
        for k, stack in enumerate(self.stacks):
            stack.requires_grad_(k == index)

    # --- what a worker of the grid needs besides the layer-wise interface --------------------

    def reduce(self, values: Tensor) -> Tensor:
        """Sum a worker's parts (of the objective, its terms) over the grid, in place."""
        if dist.is_initialized():
            dist.all_reduce(values, group=self.group)
        return values

    def replicated(self, param: nn.Parameter) -> bool:
        """Whether every worker holds all of `param` (alpha) rather than its part."""
        return any(param is stack.alpha for stack in self.stacks)

    def _stack_of_weight(self, param: Tensor) -> int | None:
        return next((k for k, s in enumerate(self.stacks) if param is s.weight), None)

    def gather_parameter(self, param: nn.Parameter, value: Tensor) -> Tensor:
        """`value` shaped like this worker's part of `param` (the parameter itself, or its
        optimizer state) as the whole replica's tensor (on every worker)."""
        stack = self._stack_of_weight(param)
        if stack is None or tuple(value.shape) != tuple(param.shape):
            return value
        return self.gather_filters(stack, value)

    def scatter_parameter(self, param: nn.Parameter, value: Tensor) -> Tensor:
        """This worker's part of the whole replica's `value` for `param`."""
        stack = self._stack_of_weight(param)
        if stack is None or tuple(value.shape) != self.stacks[stack].global_weight_shape:
            return value
        return self.local_filters(stack, value)
