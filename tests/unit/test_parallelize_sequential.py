"""`parallelize` on an `nn.Sequential` of locally connected layers, on real processes (gloo):
for grids 1x2, 2x1, 2x2 and 3x1, with uneven partitions and fields wider than a worker's part,
each worker's output tile, the gradients of its weight and bias slices, and its part of the
input's gradient equal the single-process module's to fp32 tolerance."""

import pytest
import torch
from torch import nn

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
