"""`parallelize` on an `nn.Sequential` of locally connected layers, on real processes (gloo):
for grids 1x2, 2x1, 2x2 and 3x1, with uneven partitions and fields wider than a worker's part,
each worker's output tile, the gradients of its weight and bias slices, and its part of the
input's gradient equal the single-process module's to fp32 tolerance."""

import pytest
import torch
import torch.distributed as dist
from grid_harness import FAILURES, close, run_on_grids
from torch import nn

from scaleout.comm.windows import Window
from scaleout.nn.local import L2Pool2d, LocalContrastNorm2d, LocallyConnected2d
from scaleout.parallel import (
    PARTITIONABLE,
    PartitionedLocallyConnected2d,
    can_parallelize,
    parallelize,
    parts,
)

BATCH = 3


def build() -> nn.Sequential:
    """13x13 -> 9x9 block positions (field 5: wider than a 3x1 grid's 3 rows) of 1x2x3 blocks,
    codes 9x18; pooled with zero padding; LCN; then 6x15 positions (9 rows split 5/4 on two
    workers) of a layer whose field of 4 reaches two workers' rows."""
    torch.manual_seed(11)
    first = LocallyConnected2d(2, 13, 5, 1, (1, 2, 3))
    second = LocallyConnected2d(3, (9, 18), 4, 1, (1, 1, 2))
    with torch.no_grad():
        for layer in (first, second):
            layer.bias.normal_()
    return nn.Sequential(
        first, nn.ReLU(), L2Pool2d(3, 1, 1), LocalContrastNorm2d(3), second, nn.Tanh()
    )


def data() -> torch.Tensor:
    return torch.randn(BATCH, 2, 13, 13, generator=torch.Generator().manual_seed(5))


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


def test_one_worker_grid_is_the_module_itself() -> None:
    x = data()
    reference = build()
    part = parallelize(build(), (1, 1), rank=0)
    torch.testing.assert_close(part(x), reference(x))
    assert isinstance(part[0], PartitionedLocallyConnected2d)
    assert isinstance(part[1], nn.ReLU) and isinstance(part[5], nn.Tanh)  # kept as they are


def test_each_worker_keeps_only_its_slices() -> None:
    reference = build()
    part = parallelize(build(), (2, 2), rank=3)
    for k in (0, 4):
        layer = part[k]
        assert torch.equal(layer.weight, reference[k].weight[layer.units.slices])
        assert torch.equal(layer.bias, reference[k].bias[layer.units.slices])
        assert layer.weight.numel() < reference[k].weight.numel()
    other = build()
    with torch.no_grad():
        other[4].weight.mul_(2)
    parts.load_global_state_dict(part, other.state_dict())
    assert torch.equal(part[4].weight, other[4].weight[part[4].units.slices])
    assert parts.scatter_parameter(part, part[4].weight, other[4].weight).shape == (
        part[4].weight.shape
    )


def test_what_cannot_be_partitioned_says_what_can() -> None:
    assert can_parallelize(build())
    for module, why in [
        (nn.Sequential(nn.Flatten(), nn.Linear(338, 4)), "neither spatial"),
        (nn.Sequential(L2Pool2d(3), LocallyConnected2d(2, 11, 3, 1, (1, 1, 1))), "first spatial"),
        (nn.Sequential(nn.ReLU()), "no spatial"),
        (nn.Sequential(LocallyConnected2d(2, 13, 5, 1, (1, 1, 2)), nn.Dropout()), "neither"),
    ]:
        assert not can_parallelize(module)
        with pytest.raises(ValueError, match=why) as error:
            parallelize(module, (1, 2), rank=0)
        assert PARTITIONABLE in str(error.value)
    with pytest.raises(ValueError, match="partitions a SparseAutoencoderNetwork"):
        parallelize(nn.Linear(3, 4), (1, 2), rank=0)
    mismatched = nn.Sequential(
        LocallyConnected2d(2, 13, 5, 1, (1, 2, 3)), LocallyConnected2d(3, 9, 3, 1, (1, 1, 1))
    )
    with pytest.raises(ValueError, match="9x18"):
        parallelize(mismatched, (1, 2), rank=0)
    assert isinstance(mismatched[0], LocallyConnected2d)  # an error swaps nothing
    assert not isinstance(mismatched[0], PartitionedLocallyConnected2d)
    part = parallelize(build(), (1, 2), rank=0)
    assert not can_parallelize(part)
    with pytest.raises(ValueError, match="already"):
        parallelize(part, (1, 2), rank=0)
    with pytest.raises(ValueError, match="parallelize"):
        parts.sync_grads(build())
