"""Model parallelism of the sparse autoencoder on real processes (gloo): for grids 1x2, 2x1,
2x2 and 3x1, with uneven partitions and fields wider than a worker's part, each worker's
features, the summed objective and every parameter gradient equal the single-process
network's to fp32 tolerance."""

import pytest
import torch
import torch.distributed as dist
from grid_harness import FAILURES, close, run_on_grids

from scaleout.comm.windows import Window
from scaleout.compress import get
from scaleout.nn.autoencoder import ObjectiveTerms, SparseAutoencoderNetwork
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


def crop(t: torch.Tensor, w: Window) -> torch.Tensor:
    return t[(..., *w.slices)]


def total_terms(part: SparseAutoencoderNetwork, terms: ObjectiveTerms) -> ObjectiveTerms:
    """The objective of the whole replica: the workers' parts summed (an all-reduce)."""
    values = torch.stack([terms.reconstruction.detach(), terms.sparsity.detach()])
    values = parts.reduce_parts(part, values)
    return ObjectiveTerms(values[0], values[1])


def check_grid(grid: tuple[int, int], group: dist.ProcessGroup | None) -> None:
    x = data()
    reference = build_network()
    part = parallelize(build_network(), grid, group=group)
    rank = dist.get_rank(group)
    for count in (1, 2):
        with torch.no_grad():
            expected = reference.features(x, count)
            actual = part.features(x, count)
        close(
            actual,
            crop(expected, part.stacks[count - 1].lcn.output_windows[rank]),
            f"{grid} f{count}",
        )
    for index in range(2):
        reference.zero_grad()
        part.zero_grad()
        reference.train_only(index)
        part.train_only(index)
        terms = reference.stack_objective(x, index)
        terms.total.backward()
        mine = part.stack_objective(x, index)
        mine.total.backward()
        parts.sync_grads(part)
        total = total_terms(part, mine)
        close(total.reconstruction, terms.reconstruction.detach(), f"{grid} stack {index} recon")
        close(total.sparsity, terms.sparsity.detach(), f"{grid} stack {index} sparsity")
        stack, mine_stack = reference.stacks[index], part.stacks[index]
        expected_grad = stack.filter.weight.grad[mine_stack.filter.units.slices]
        close(mine_stack.filter.weight.grad, expected_grad, f"{grid} stack {index} dW")
        close(mine_stack.alpha.grad, stack.alpha.grad, f"{grid} stack {index} dalpha")
    train_steps(grid, reference, part, x)


def train_steps(
    grid: tuple[int, int],
    reference: SparseAutoencoderNetwork,
    part: SparseAutoencoderNetwork,
    x: torch.Tensor,
    num_steps: int = 3,
) -> None:
    """Greedy training of stack 2 (alpha fitted, SGD with momentum, plain backward) keeps the
    partitioned weights equal to the slices of the single-process ones."""
    index = 1
    close(
        torch.tensor(part.fit_alpha_(x, index)),
        torch.tensor(reference.stacks[index].fit_alpha_(reference.features(x, index))),
        f"{grid} fitted alpha",
    )
    reference.train_only(index)
    part.train_only(index)
    lr = 0.05
    initial = part.stacks[index].filter.weight.detach().clone()
    optimizers = [
        torch.optim.SGD(net.stack_parameter_groups(index, lr, *extra), lr=lr, momentum=0.9)
        for net, extra in ((reference, ()), (part, (reference.alpha_lr_scale,)))
    ]
    for step in range(num_steps):
        batch = x.roll(step, dims=0)
        for optimizer in optimizers:
            optimizer.zero_grad()
        reference.stack_objective(batch, index).total.backward()
        part.stack_objective(batch, index).total.backward()
        parts.sync_grads(part)
        for optimizer in optimizers:
            optimizer.step()
    mine, stack = part.stacks[index], reference.stacks[index]
    close(
        mine.filter.weight.detach(),
        stack.filter.weight.detach()[mine.filter.units.slices],
        f"{grid} trained W",
    )
    close(mine.alpha.detach(), stack.alpha.detach(), f"{grid} trained alpha")
    if not (mine.filter.weight.detach() - initial).abs().max() > 1e-3:  # the steps did train
        FAILURES.append(f"rank {dist.get_rank()}: {grid} weights did not move")
    # the whole replica's weights, assembled on every worker, are the single network's
    state = parts.global_state_dict(part)
    expected = {k: v for k, v in reference.state_dict().items() if k in state}
    if set(state) != set(expected) or len(state) != 4:
        FAILURES.append(f"rank {dist.get_rank()}: {grid} state names {sorted(state)}")
    for name, value in expected.items():
        close(state[name], value, f"{grid} global {name}")


def test_partitioned_network_equals_single_process_on_processes() -> None:
    run_on_grids(check_grid)


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


def test_partitioned_network_on_ray_actors(ray_session) -> None:
    """The replica's workers as Ray actors in one placement group (`ProcessGroup`): the
    summed objective and the gradient slices equal the single-process network's."""
    import ray
    from ray import cloudpickle

    from scaleout.comm import GroupMember, ProcessGroup

    class Member(GroupMember):
        def __init__(self, rank: int, world: int) -> None:
            torch.set_num_threads(1)

        def objective(self, index: int) -> tuple[list[float], torch.Tensor, torch.Tensor, Window]:
            part = parallelize(build_network(), (1, 2))
            part.train_only(index)
            terms = part.stack_objective(data(), index)
            terms.total.backward()
            parts.sync_grads(part)
            total = total_terms(part, terms)
            stack = part.stacks[index]
            return (
                [total.total.item()],
                stack.filter.weight.grad,
                stack.alpha.grad,
                stack.filter.units,
            )

    cloudpickle.register_pickle_by_value(__import__(__name__))
    group = ProcessGroup.create(Member, 2, num_cpus=0.5)
    try:
        answers = ray.get([a.objective.remote(1) for a in group.actors])
    finally:
        group.close()
    reference = build_network()
    reference.train_only(1)
    terms = reference.stack_objective(data(), 1)
    terms.total.backward()
    stack = reference.stacks[1]
    for total, weight_grad, alpha_grad, units in answers:
        assert total[0] == pytest.approx(terms.total.item(), rel=1e-5)
        torch.testing.assert_close(weight_grad, stack.filter.weight.grad[units.slices])
        torch.testing.assert_close(alpha_grad, stack.alpha.grad)
    assert answers[0][3] != answers[1][3]  # the two workers hold different filters
