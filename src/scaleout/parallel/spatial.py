"""A worker's part of each layer of a locally connected network partitioned over a px x py grid
of workers along H and W (COTS HPC section 4.2, DistBelief section 3).

Each partitioned layer is built from the single-process layer, the grid, this worker's rank
and `owners`: the window of the layer's input that each worker holds (a tiling of the map),
or None when every worker holds the whole input (the data). It computes its own part of the
layer's output, `output_windows[rank]`, and `output_windows` is what the next layer's
`owners` is. Where a part reads pixels that other workers own, a `DistributedArray` brings
them; that is the only communication, and it is differentiable, so the parts train with an
ordinary `loss.backward()`:

- `PartitionedLocallyConnected2d`: the block positions `partition_local` gives this worker,
  their filters only (a slice of the global weight) on their input window; it overrides the
  hooks of `LocallyConnected2d` (`gather`, `sum_to_owners`, `owned`, `reduce`), so code
  written against them (the sparse autoencoder's objective) runs unchanged on its part;
- `PartitionedL2Pool2d`: the pool's output pixels split evenly (`partition_pixels`), with
  the global layer's zero padding added locally where a window meets the map's border;
- `PartitionedLocalContrastNorm2d`: LCN on a window wide enough for its outputs, cropped.

Element-wise layers need no partitioned form: a worker applies them to its tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from scaleout.comm.darray import DistributedArray, Transport
from scaleout.comm.windows import (
    Window,
    grid_coords,
    partition_local,
    partition_pixels,
    split_even,
)
from scaleout.compress import Codec
from scaleout.nn.local import L2Pool2d, LocalContrastNorm2d, LocallyConnected2d

__all__ = [
    "PartitionedL2Pool2d",
    "PartitionedLocalContrastNorm2d",
    "PartitionedLocallyConnected2d",
    "Placement",
    "even_tiling",
]


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a worker's part of a layer runs and how it talks to the others: the grid
    `(px, py)`, this worker's `rank` in `group` (the default group when None), and the
    exchanges' transport and codec (compressing activations and gradients on the wire)."""

    grid: tuple[int, int]
    rank: int
    group: dist.ProcessGroup | None = None
    transport: Transport = "all_to_all"
    codec: Codec | None = None

    def __post_init__(self) -> None:
        grid_coords(self.rank, self.grid)  # a valid grid, and the rank lies in it

    @property
    def world(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def collective(self) -> bool:
        """Whether sums over the grid need a collective (more than one worker, and
        torch.distributed up: a 1x1 grid runs without a process group)."""
        return self.world > 1 and dist.is_initialized()

    def array(self, outputs: Sequence[Window], inputs: Sequence[Window]) -> DistributedArray:
        """The exchange from windows `outputs` (what each worker holds) to `inputs`."""
        return DistributedArray(outputs, inputs, self.rank, self.group, self.transport, self.codec)

    def reduce(self, values: Tensor) -> Tensor:
        """Sum every worker's `values` over the grid, in place (no autograd); returns them."""
        if self.collective:
            dist.all_reduce(values, group=self.group)
        return values


def even_tiling(size: tuple[int, int], grid: Sequence[int]) -> list[Window]:
    """Pixels of an H x W map split as evenly as possible over the grid (index = rank)."""
    rows = split_even(size[0], grid[0], "rows")
    cols = split_even(size[1], grid[1], "columns")
    return [Window(r, c) for r in rows for c in cols]


def _owners(
    owners: Sequence[Window] | None, size: tuple[int, int], placement: Placement
) -> list[Window] | None:
    """`owners` checked to tile the H x W input map once, one window per worker."""
    if owners is None:
        return None
    owners = list(owners)
    if len(owners) != placement.world:
        raise ValueError(f"need {placement.world} input owner windows, got {len(owners)}")
    whole = Window(range(size[0]), range(size[1]))
    disjoint = all(a.intersect(b).is_empty for k, a in enumerate(owners) for b in owners[k + 1 :])
    if (
        not all(whole.contains(w) for w in owners)
        or not disjoint
        or sum(w.num_pixels for w in owners) != whole.num_pixels
    ):
        raise ValueError(f"the input owner windows {owners} do not tile the {size} input map")
    return owners


def _input(x: Tensor, window: Window, exchange: DistributedArray | None) -> Tensor:
    """The layer's input over `window`: exchanged from the owners, or sliced out of the whole
    input that every worker holds (`exchange` None)."""
    return x[(..., *window.slices)] if exchange is None else exchange(x)


class PartitionedLocallyConnected2d(LocallyConnected2d):
    """Worker `rank`'s part of a `LocallyConnected2d`: its block positions' filters (and bias)
    on its input window, `geometry` being that sub-layer's. `owners`: see the module
    docstring; for a replicated input, an even tiling stands in as the owners of the input
    pixels (`owned`, `sum_to_owners`).

    Exchanges: `to_input` brings the input window from the owners (None: sliced out of the
    replicated input); `to_owners` sums a result over the input window (W^T y, where the
    fields of several workers overlap) onto the owners of its pixels.
    """

    def __init__(
        self,
        layer: LocallyConnected2d,
        grid: Sequence[int],
        rank: int,
        owners: Sequence[Window] | None,
        group: dist.ProcessGroup | None = None,
        transport: Transport = "all_to_all",
        codec: Codec | None = None,
    ) -> None:
        # The single-process layer's __init__ would allocate the global weight: this part is
        # built from its slices instead.
        nn.Module.__init__(self)
        self.placement = Placement((grid[0], grid[1]), rank, group, transport, codec)
        g = layer.geometry
        in_size = (g.in_height, g.in_width)
        given = _owners(owners, in_size, self.placement)
        self.replicated_input = given is None
        self.owners = even_tiling(in_size, grid) if given is None else given
        filters = partition_local(g, grid)
        mine = filters[rank]
        self.global_geometry = g
        self.units, self.output, self.input = mine.units, mine.output, mine.input
        self.geometry = g.sub(mine.units.rows, mine.units.cols)
        self.output_windows = [w.output for w in filters]
        # only this worker's filters: (rows of positions, columns of positions, K, F)
        self.weight = self._own_part(layer.weight)
        if layer.bias is not None:
            self.bias = self._own_part(layer.bias)  # (rows, columns of positions, K)
        else:
            self.register_parameter("bias", None)
        inputs = [w.input for w in filters]
        self.to_input = None if self.replicated_input else self.placement.array(self.owners, inputs)
        self.to_owners = self.placement.array(inputs, self.owners)

    def _own_part(self, param: nn.Parameter) -> nn.Parameter:
        part = param.detach()[self.units.slices].clone()
        return nn.Parameter(part, requires_grad=param.requires_grad)

    # --- the hooks of LocallyConnected2d, with their exchanges ------------------------------

    def gather(self, x: Tensor) -> Tensor:
        """The input window of this worker's positions, from its tile of the input (or from
        the whole input, when every worker holds it)."""
        return _input(x, self.input, self.to_input)

    def sum_to_owners(self, r: Tensor) -> Tensor:
        """r over the input window, summed with the other workers' onto the owned pixels."""
        return self.to_owners(r)

    def owned(self, x: Tensor) -> Tensor:
        """This worker's tile of the input: x itself, or its window of the whole input."""
        if self.replicated_input:
            return x[(..., *self.owners[self.placement.rank].slices)]
        return x

    def reduce(self, t: Tensor) -> Tensor:
        return self.placement.reduce(t)

    # --- the whole layer's parameters from the parts (checkpoints, optimizer state) ---------

    def global_shape(self, name: str) -> tuple[int, ...]:
        """The single-process layer's shape of parameter `name` ("weight" or "bias")."""
        shape = self.global_geometry.weight_shape
        return shape if name == "weight" else shape[:3]

    @torch.no_grad()
    def assemble(self, name: str, part: Tensor) -> Tensor:
        """A tensor shaped like this worker's slice of parameter `name` (the parameter, or
        its optimizer state) assembled over the grid into the global shape, on every worker
        (a collective): each worker writes its part into zeros and one all-reduce sums them
        (one non-zero term per value, so the sum is exact)."""
        whole = part.new_zeros(self.global_shape(name))
        whole[self.units.slices] = part
        return self.placement.reduce(whole)

    def slice_of(self, name: str, whole: Tensor) -> Tensor:
        """This worker's part of a tensor of parameter `name`'s global shape."""
        return whole[self.units.slices].clone()

    def extra_repr(self) -> str:
        units = self.units
        return (
            f"{super().extra_repr()}, rank={self.placement.rank} of {self.placement.grid}, "
            f"block rows {units.rows.start}:{units.rows.stop}, "
            f"block columns {units.cols.start}:{units.cols.stop}"
        )


def _padding(pool: L2Pool2d, output: Window, clipped: Window) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) zeros that extend `clipped` to the full pooling windows of
    `output` (the global layer's zero padding, where the window meets the map's border)."""
    amounts = []
    for out, have in ((output.cols, clipped.cols), (output.rows, clipped.rows)):
        start = out.start * pool.stride - pool.padding
        stop = (out.stop - 1) * pool.stride - pool.padding + pool.size
        amounts += [have.start - start, stop - have.stop]
    return tuple(amounts)  # type: ignore[return-value]


class PartitionedL2Pool2d(L2Pool2d):
    """Worker `rank`'s part of an `L2Pool2d` on an `in_size` (H, W) map: the pooled pixels of
    `output_windows[rank]`, from its input window exchanged from `owners` (or sliced out of
    the replicated input when `owners` is None)."""

    def __init__(
        self,
        pool: L2Pool2d,
        in_size: tuple[int, int],
        grid: Sequence[int],
        rank: int,
        owners: Sequence[Window] | None,
        group: dist.ProcessGroup | None = None,
        transport: Transport = "all_to_all",
        codec: Codec | None = None,
    ) -> None:
        super().__init__(pool.size, pool.stride, pool.padding, pool.eps)
        self.placement = Placement((grid[0], grid[1]), rank, group, transport, codec)
        given = _owners(owners, in_size, self.placement)
        self.in_size = (in_size[0], in_size[1])
        out_size = (self.out_size(in_size[0]), self.out_size(in_size[1]))
        pools = partition_pixels(out_size, self.in_size, self.input_window, grid)
        self.output, self.input = pools[rank].output, pools[rank].input
        self.output_windows = [w.output for w in pools]
        inputs = [w.input for w in pools]
        self.to_input = None if given is None else self.placement.array(given, inputs)
        self.border = _padding(self, self.output, self.input)

    def forward(self, x: Tensor) -> Tensor:
        """This worker's tile of the input (or the whole input) -> its tile of the output."""
        window = _input(x, self.input, self.to_input)  # (N, C, *input window)
        if any(self.border):
            window = F.pad(window, self.border)
        return self.pooled(window, 0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.placement.rank}, output={self.output}"


class PartitionedLocalContrastNorm2d(LocalContrastNorm2d):
    """Worker `rank`'s part of a `LocalContrastNorm2d` on an `in_size` (H, W) map: LCN of the
    input window that its outputs `output_windows[rank]` read, cropped to them. Exact: an
    output at p reads inputs within 2 * (size // 2), and the border rule looks only at the
    map's own borders, which the window shares where it meets them."""

    def __init__(
        self,
        lcn: LocalContrastNorm2d,
        in_size: tuple[int, int],
        grid: Sequence[int],
        rank: int,
        owners: Sequence[Window] | None,
        group: dist.ProcessGroup | None = None,
        transport: Transport = "all_to_all",
        codec: Codec | None = None,
    ) -> None:
        super().__init__(lcn.size, lcn.sigma, lcn.eps)
        self.placement = Placement((grid[0], grid[1]), rank, group, transport, codec)
        given = _owners(owners, in_size, self.placement)
        self.in_size = (in_size[0], in_size[1])
        lcns = partition_pixels(self.in_size, self.in_size, self.input_window, grid)
        self.output, self.input = lcns[rank].output, lcns[rank].input
        self.output_windows = [w.output for w in lcns]
        inputs = [w.input for w in lcns]
        self.to_input = None if given is None else self.placement.array(given, inputs)

    def forward(self, x: Tensor) -> Tensor:
        """This worker's tile of the input (or the whole input) -> its tile of the output."""
        normalised = super().forward(_input(x, self.input, self.to_input))
        return normalised[(..., *self.output.relative_to(self.input))]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.placement.rank}, output={self.output}"


PARTITIONED_LAYERS = (
    PartitionedLocallyConnected2d,
    PartitionedL2Pool2d,
    PartitionedLocalContrastNorm2d,
)
