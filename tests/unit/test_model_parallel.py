"""Model parallelism of the sparse autoencoder on real processes (gloo): for grids 1x2, 2x1,
2x2 and 3x1, with uneven partitions and fields wider than a worker's part, each worker's
features, the summed objective and every parameter gradient equal the single-process
network's to fp32 tolerance."""

import pytest
import torch

from scaleout.comm.windows import Window
from scaleout.compress import get
from scaleout.nn.autoencoder import SparseAutoencoderNetwork
from scaleout.parallel import bytes_per_step, even_tiling, parallelize, parts

# stack 1: 14x14 -> 8x8 block positions (field 7 > a worker's 4-7 rows), codes 8x16, pooled
# with zero padding; stack 2: 8x16 -> 6x14 positions, pooled without padding to 4x12
NETWORK_OPTIONS = dict(
    in_channels=2,
    in_size=14,
    num_stacks=2,
    field=[7, 3],
    step=[1, 1],
    block=[[1, 2, 2], [1, 1, 2]],
    pool_size=[3, 3],
    pool_padding=[1, 0],
    lcn_size=[3, 3],
)


def build_network() -> SparseAutoencoderNetwork:
    torch.manual_seed(7)
    return SparseAutoencoderNetwork(**NETWORK_OPTIONS)


def data() -> torch.Tensor:
    return torch.randn(5, 2, 14, 14, generator=torch.Generator().manual_seed(3))


def test_one_worker_grid_is_the_network_itself() -> None:
    x = data()
    reference = build_network()
    part = parallelize(build_network(), (1, 1), rank=0)
    with torch.no_grad():
        torch.testing.assert_close(part.features(x), reference.features(x))
    terms = part.stack_objective(x, 1)
    expected = reference.stack_objective(x, 1)
    torch.testing.assert_close(terms.total, expected.total)


def test_weights_are_slices_of_the_global_network() -> None:
    network = build_network()
    part = parallelize(build_network(), (2, 2), rank=3)
    stack = part.stacks[0].filter
    assert torch.equal(stack.weight, network.stacks[0].filter.weight[stack.units.slices])
    assert stack.weight.numel() < network.stacks[0].filter.weight.numel()
    # loading another network's state takes its slices
    other = SparseAutoencoderNetwork(**NETWORK_OPTIONS)
    parts.load_global_state_dict(part, other.state_dict())
    assert torch.equal(stack.weight, other.stacks[0].filter.weight[stack.units.slices])
    assert torch.equal(part.stacks[1].alpha, other.stacks[1].alpha)
    with pytest.raises(ValueError, match="same model"):
        parts.load_global_state_dict(part, {"stacks.0.filter.weight": torch.zeros(1)})


def test_even_tiling_and_grid_errors() -> None:
    tiles = even_tiling((5, 4), (2, 2))
    assert tiles[0] == Window(range(0, 3), range(0, 2)) and tiles[3] == Window(
        range(3, 5), range(2, 4)
    )
    with pytest.raises(ValueError, match="grid"):
        parallelize(build_network(), (0, 2), rank=0)
    with pytest.raises(ValueError, match="at most"):
        parallelize(build_network(), (9, 1), rank=0)


def test_bytes_per_step_count_every_exchange() -> None:
    batch = 5
    assert bytes_per_step(parallelize(build_network(), (1, 1), rank=0), 1, batch) == 0
    workers = [parallelize(build_network(), (2, 2), rank=r) for r in range(4)]
    plain = [bytes_per_step(p, 1, batch) for p in workers]
    assert all(b > 0 for b in plain)
    # by hand for rank 0: stack 1 forward (pool, LCN; the data is not exchanged), stack 2's
    # filter input, then its reconstruction and pooling exchanges forward and backward
    first, second = workers[0].stacks
    assert first.filter.to_input is None
    by_hand = sum(
        a.bytes_sent(batch, c) + (a.bytes_sent(batch, c, backward=True) if back else 0)
        for a, c, back in [
            (first.pool.to_input, 2, False),
            (first.lcn.to_input, 2, False),
            (second.filter.to_input, 2, False),
            (second.filter.to_owners, 2, True),
            (second.pool.to_input, 2, True),
        ]
    )
    assert plain[0] == by_hand
    eight_bit = parallelize(build_network(), (2, 2), rank=0, codec=get("dynamic8"))
    assert bytes_per_step(eight_bit, 1, batch) < 0.3 * plain[0]
