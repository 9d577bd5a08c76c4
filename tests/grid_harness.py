"""A harness for exactness checks of a partitioned model on real processes: every grid of
`GRIDS` on 4 gloo processes (subgroups for the smaller grids), mismatches collected rather
than raised so that every worker goes through all its collectives, and reported together
at the end (a raise on one worker would leave the others hanging)."""

from collections.abc import Callable

import torch
import torch.distributed as dist

from scaleout.comm import run_locally

WORLD = 4
GRIDS = [(1, 2), (2, 1), (2, 2), (3, 1)]
FAILURES: list[str] = []

Check = Callable[[tuple[int, int], dist.ProcessGroup | None], None]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 tolerance, relative to the expected tensor's largest value; collected."""
    scale = expected.abs().max().item() + 1e-12
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=what)
    except AssertionError as error:
        FAILURES.append(f"rank {dist.get_rank()}: {error}")


def report_failures() -> None:
    """Raise on every worker with the mismatches of all workers."""
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, FAILURES)
    failures = [f for part in gathered for f in part or []]
    assert not failures, "\n".join(failures)


def _on_grids(rank: int, world: int, check: Check) -> None:
    torch.set_num_threads(1)
    groups = {size: dist.new_group(list(range(size))) for size in (2, 3)}
    for grid in GRIDS:
        size = grid[0] * grid[1]
        if rank < size:
            check(grid, None if size == world else groups[size])
    report_failures()


def run_on_grids(check: Check) -> None:
    """`check(grid, group)` on each grid's workers (importable: it runs in new processes)."""
    run_locally(_on_grids, WORLD, check)
