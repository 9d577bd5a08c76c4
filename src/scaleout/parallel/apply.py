"""`parallelize`: spatial model parallelism applied to a model from outside, by swapping each
layer for this worker's part of it (`scaleout.parallel.spatial`), in the manner of
torchtitan's `parallelize_module`. The model code in `scaleout.nn` has no communication;
after the swap the same model code runs this worker's part, with the distributed-array
exchanges inside the swapped layers.

Two kinds of model can be partitioned:

- a `SparseAutoencoderNetwork`: every stack's filter, pool and LCN, and its coverage mask
  (the owned window of it). Stack k's filter reads what stack k - 1's LCN outputs, tiled
  over the grid; stack 1 reads the data, which every worker holds whole. The stacks' maths
  (`nn.autoencoder.stack`) is unchanged and gives this worker's part of every term;
- an `nn.Sequential` of `LocallyConnected2d`, `L2Pool2d`, `LocalContrastNorm2d` and
  element-wise layers (`ELEMENTWISE`), whose first spatial layer is a `LocallyConnected2d`
  (its geometry fixes the map's size): the first spatial layer reads the whole input that
  every worker holds, each next one the previous one's output tiling, and the module returns
  this worker's tile of the output.

`greedy_exchanges` lists the exchanges of one greedy step of a partitioned autoencoder in the
order they run (the simulator prices them), and `bytes_per_step` counts what a worker sends
in them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch.distributed as dist
from torch import nn

from scaleout.comm.darray import DistributedArray, Transport
from scaleout.comm.windows import Window
from scaleout.compress import Codec
from scaleout.nn.autoencoder import SparseAutoencoderNetwork
from scaleout.nn.local import L2Pool2d, LocalContrastNorm2d, LocallyConnected2d
from scaleout.parallel.spatial import (
    PARTITIONED_LAYERS,
    PartitionedL2Pool2d,
    PartitionedLocalContrastNorm2d,
    PartitionedLocallyConnected2d,
    Placement,
)

__all__ = [
    "ELEMENTWISE",
    "PARTITIONABLE",
    "Exchange",
    "bytes_per_step",
    "can_parallelize",
    "greedy_exchanges",
    "is_partitioned",
    "parallelize",
]

# Layers a worker applies to its tile as they are: each output value depends on its own input
# value alone (and on no random state, which would differ between a tile and the whole).
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.LogSigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Softsign,
    nn.Hardtanh,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.Hardshrink,
    nn.Softshrink,
    nn.Tanhshrink,
)
SPATIAL = (LocallyConnected2d, L2Pool2d, LocalContrastNorm2d)

PARTITIONABLE = (
    "a SparseAutoencoderNetwork, or an nn.Sequential of LocallyConnected2d, L2Pool2d, "
    "LocalContrastNorm2d and element-wise layers (ReLU, Sigmoid, Tanh, ...) that starts its "
    "spatial layers with a LocallyConnected2d"
)


def is_partitioned(module: nn.Module) -> bool:
    """Whether `module` is (or holds) a worker's part of a partitioned model."""
    return any(isinstance(m, PARTITIONED_LAYERS) for m in module.modules())


def _sequential_problem(module: nn.Sequential) -> str | None:
    """Why `parallelize` cannot partition the Sequential `module`, or None."""
    spatial = [m for m in module if isinstance(m, SPATIAL)]
    for layer in module:
        if not isinstance(layer, SPATIAL + ELEMENTWISE):
            return f"its layer {type(layer).__name__} is neither spatial nor element-wise"
    if not spatial:
        return "it has no spatial layer to partition"
    if not isinstance(spatial[0], LocallyConnected2d):
        return f"its first spatial layer is a {type(spatial[0]).__name__}"
    return None


def can_parallelize(module: nn.Module) -> bool:
    """Whether `parallelize` can partition `module` over a grid (it has not been already)."""
    if is_partitioned(module):
        return False
    if isinstance(module, SparseAutoencoderNetwork):
        return True
    return isinstance(module, nn.Sequential) and _sequential_problem(module) is None


def parallelize(
    module: nn.Module,
    grid: Sequence[int],
    rank: int | None = None,
    group: dist.ProcessGroup | None = None,
    transport: Transport = "all_to_all",
    codec: Codec | None = None,
) -> nn.Module:
    """Make `module` worker `rank`'s part of it on a `grid = [px, py]` of workers (rank: this
    process's rank in `group` by default), partitioned over the rows and columns of its
    feature maps; returns `module`, changed in place (its layers swapped; the global weights
    are let go, each worker keeps only its slices). Build `module` the same way on every
    worker (same seed), so the grid starts from exactly the single-process network.
    `codec` compresses the exchanged activations and gradients. See the module docstring."""
    if len(grid) != 2 or not all(isinstance(v, int) and v >= 1 for v in grid):
        raise ValueError(f"grid must be two positive ints [px, py], got {list(grid)!r}")
    world = grid[0] * grid[1]
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    if dist.is_initialized() and dist.get_world_size(group) != world:
        raise ValueError(
            f"grid {list(grid)} needs {world} workers, the process group has "
            f"{dist.get_world_size(group)}"
        )
    if is_partitioned(module):
        raise ValueError(f"this {type(module).__name__} has been partitioned already")
    place = Placement((grid[0], grid[1]), rank, group, transport, codec)
    if isinstance(module, SparseAutoencoderNetwork):
        _parallelize_autoencoder(module, place)
    elif isinstance(module, nn.Sequential) and (why := _sequential_problem(module)) is None:
        _parallelize_sequential(module, place)
    elif isinstance(module, nn.Sequential):
        raise ValueError(f"parallelize partitions {PARTITIONABLE}; this nn.Sequential not: {why}")
    else:
        raise ValueError(f"parallelize partitions {PARTITIONABLE}; got {type(module).__name__}")
    return module


def _options(place: Placement) -> dict:
    return {"group": place.group, "transport": place.transport, "codec": place.codec}


def _parallelize_autoencoder(network: SparseAutoencoderNetwork, place: Placement) -> None:
    """Swap every stack's layers and coverage for this worker's parts (all built before any
    is swapped, so an error leaves the network as it was)."""
    grid, rank, options = place.grid, place.rank, _options(place)
    swaps = []
    owners: list[Window] | None = None  # stack 1 reads the data, whole on every worker
    for stack in network.stacks:
        g = stack.filter.geometry
        part = PartitionedLocallyConnected2d(stack.filter, grid, rank, owners, **options)
        codes = (g.out_height, g.out_width)
        pool = PartitionedL2Pool2d(stack.pool, codes, grid, rank, part.output_windows, **options)
        pooled = stack.out_shape[1:]
        lcn = PartitionedLocalContrastNorm2d(
            stack.lcn, pooled, grid, rank, pool.output_windows, **options
        )
        coverage = stack.coverage[part.owners[rank].slices].clone()  # (H, W) owned pixels
        swaps.append((stack, part, pool, lcn, coverage))
        owners = lcn.output_windows
    for stack, part, pool, lcn, coverage in swaps:
        stack.filter, stack.pool, stack.lcn = part, pool, lcn
        stack.coverage = coverage


def _parallelize_sequential(module: nn.Sequential, place: Placement) -> None:
    """Swap each spatial layer of `module` (checked by `_sequential_problem`) for this
    worker's part; the element-wise layers stay."""
    grid, rank, options = place.grid, place.rank, _options(place)
    swaps: list[tuple[str, nn.Module]] = []
    owners: list[Window] | None = None  # the first spatial layer reads the whole input
    size: tuple[int, int] | None = None  # (H, W) of the map between the layers
    for name, layer in module.named_children():
        part: nn.Module
        if isinstance(layer, LocallyConnected2d):
            g = layer.geometry
            if size is not None and size != (g.in_height, g.in_width):
                raise ValueError(
                    f"layer {name} ({type(layer).__name__}) takes a {g.in_height}x{g.in_width} "
                    f"map, the layers before it give {size[0]}x{size[1]}"
                )
            part = PartitionedLocallyConnected2d(layer, grid, rank, owners, **options)
            size = (g.out_height, g.out_width)
        elif isinstance(layer, L2Pool2d):
            assert size is not None  # a LocallyConnected2d comes first
            part = PartitionedL2Pool2d(layer, size, grid, rank, owners, **options)
            size = (layer.out_size(size[0]), layer.out_size(size[1]))
        elif isinstance(layer, LocalContrastNorm2d):
            assert size is not None
            part = PartitionedLocalContrastNorm2d(layer, size, grid, rank, owners, **options)
        else:
            continue  # element-wise: applied to the tile as it is
        owners = part.output_windows  # type: ignore[assignment]
        swaps.append((name, part))
    for name, part in swaps:
        setattr(module, name, part)


class Exchange(NamedTuple):
    """One exchange of a greedy step: `array` moves a (batch, `channels`, H, W) array, at
    `stack`; `backward`: its gradient is exchanged back too (the transposed exchange)."""

    stack: int
    name: str  # "filter.to_input", "filter.to_owners", "pool.to_input", "lcn.to_input"
    array: DistributedArray
    channels: int
    backward: bool


def greedy_exchanges(module: nn.Module, index: int) -> list[Exchange]:
    """The exchanges of one greedy training step of stack `index` of a partitioned
    `SparseAutoencoderNetwork`, in the order they run: the forward pass through the stacks
    below, then the stack's objective and its backward (the stack's input comes from frozen
    stacks and needs no gradient, so the input exchange has no backward). Exchanges that
    move nothing (the data, which every worker holds) are left out."""
    if not isinstance(module, SparseAutoencoderNetwork) or not is_partitioned(module):
        raise ValueError("greedy_exchanges reads a SparseAutoencoderNetwork that parallelize split")
    out = []
    for k, stack in enumerate(module.stacks[: index + 1]):
        channels, depth = stack.geometry.in_channels, stack.geometry.depth
        steps: list[tuple[str, DistributedArray | None, int, bool]] = [
            ("filter.to_input", stack.filter.to_input, channels, False)
        ]
        if k == index:  # the objective: W^T h summed onto the owners, the codes pooled
            steps += [
                ("filter.to_owners", stack.filter.to_owners, channels, True),
                ("pool.to_input", stack.pool.to_input, depth, True),
            ]
        else:  # the features for the next stack
            steps += [
                ("pool.to_input", stack.pool.to_input, depth, False),
                ("lcn.to_input", stack.lcn.to_input, depth, False),
            ]
        out += [Exchange(k, *step) for step in steps if step[1] is not None]
    return out


def bytes_per_step(module: nn.Module, index: int, batch: int) -> int:
    """Bytes this worker of a partitioned `SparseAutoencoderNetwork` sends in one greedy
    training step of stack `index` on a minibatch of `batch` (`greedy_exchanges`)."""
    total = 0
    for exchange in greedy_exchanges(module, index):
        total += exchange.array.bytes_sent(batch, exchange.channels)
        if exchange.backward:
            total += exchange.array.bytes_sent(batch, exchange.channels, backward=True)
    return total
