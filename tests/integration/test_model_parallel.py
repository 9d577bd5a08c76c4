"""Model parallelism of the sparse autoencoder on real processes (gloo): for grids 1x2, 2x1,
2x2 and 3x1, with uneven partitions and fields wider than a worker's part, each worker's
features, the summed objective and every parameter gradient equal the single-process
network's to fp32 tolerance."""

import pytest
import torch
import torch.distributed as dist

from scaleout.comm.windows import Window
from scaleout.nn.autoencoder import ObjectiveTerms, SparseAutoencoderNetwork
from scaleout.parallel import parallelize, parts
from tests.grid_harness import FAILURES, close, run_on_grids
from tests.unit.test_model_parallel import build_network, data


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
