"""`parallelize` on an `nn.Sequential` of locally connected layers, on real processes (gloo):
for grids 1x2, 2x1, 2x2 and 3x1, with uneven partitions and fields wider than a worker's part,
each worker's output tile, the gradients of its weight and bias slices, and its part of the
input's gradient equal the single-process module's to fp32 tolerance."""

import torch
import torch.distributed as dist
from torch import nn

from scaleout.comm.windows import Window
from scaleout.parallel import (
    PartitionedLocallyConnected2d,
    parallelize,
    parts,
)
from tests.grid_harness import FAILURES, close, run_on_grids
from tests.unit.test_parallelize_sequential import BATCH, build, data


def probe() -> torch.Tensor:
    """Weights of the outputs in the loss, (N, 2, 6, 15): every output value matters."""
    return torch.randn(BATCH, 2, 6, 15, generator=torch.Generator().manual_seed(6))


def last_tile(part: nn.Sequential, rank: int) -> Window:
    """This worker's window of the module's output: the last spatial layer's tile."""
    return [m for m in part if hasattr(m, "output_windows")][-1].output_windows[rank]


def check_grid(grid: tuple[int, int], group: dist.ProcessGroup | None) -> None:
    reference = build()
    x_ref = data().requires_grad_(True)
    expected = reference(x_ref)
    (expected * probe()).sum().backward()

    part = parallelize(build(), grid, group=group)
    rank = dist.get_rank(group)
    x = data().requires_grad_(True)  # the whole input, on every worker
    out = part(x)
    tile = last_tile(part, rank)
    close(out, expected.detach()[(..., *tile.slices)], f"{grid} output tile")
    mine = (out * probe()[(..., *tile.slices)]).sum()
    mine.backward()
    parts.sync_grads(part)  # nothing replicated here: a no-op that must not disturb
    total = parts.reduce_parts(part, mine.detach().clone())
    close(total, (expected * probe()).sum().detach(), f"{grid} summed loss")
    layers = [(k, m) for k, m in enumerate(part) if isinstance(m, PartitionedLocallyConnected2d)]
    if len(layers) != 2:
        FAILURES.append(f"rank {rank}: {grid} swapped {len(layers)} LocallyConnected2d")
    for k, layer in layers:
        ref = reference[k]
        for name in ("weight", "bias"):
            want = getattr(ref, name).grad[layer.units.slices]
            close(getattr(layer, name).grad, want, f"{grid} layer {k} d{name}")
            if parts.is_replicated(part, getattr(layer, name)):
                FAILURES.append(f"rank {rank}: {grid} layer {k} {name} counted as replicated")
    # each worker's input gradient is its part: they sum to the whole
    close(parts.reduce_parts(part, x.grad.clone()), x_ref.grad, f"{grid} dx")
    state = parts.global_state_dict(part)
    expected_state = reference.state_dict()
    if set(state) != set(expected_state):
        FAILURES.append(f"rank {rank}: {grid} state names {sorted(state)}")
    for name, value in expected_state.items():
        close(state[name], value, f"{grid} global {name}")


def test_partitioned_sequential_equals_single_process_on_processes() -> None:
    run_on_grids(check_grid)
