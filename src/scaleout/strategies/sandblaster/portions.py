"""How Sandblaster cuts a batch into portions and which portion a free replica gets next.

Without Ray, so that the simulator (`scaleout.sim.sandblaster`) hands out portions by the
same rule as the coordinator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable


def portion_bounds(num_examples: int, portion_size: int) -> list[tuple[int, int]]:
    """(start, stop) of each portion of `portion_size` examples (the last may be shorter)."""
    return [
        (start, min(start + portion_size, num_examples))
        for start in range(0, num_examples, portion_size)
    ]


def next_portion(
    todo: deque[int],
    running: Iterable[tuple[int, int, int]],
    batch: int,
    winners: Container[int],
    backup_tasks: bool,
) -> tuple[int, bool] | None:
    """The portion a free replica computes next, and whether it is a backup copy: the next
    one not handed out yet (taken from `todo`); when none is left and `backup_tasks`, a
    copy of a portion of `batch` still running (`running`: (replica, batch, portion)),
    without a result and without a copy yet; None when there is nothing to do."""
    if todo:
        return todo.popleft(), False
    if not backup_tasks:
        return None
    current = [p for _, b, p in running if b == batch and p not in winners]
    copies = {p: current.count(p) for p in current}
    portion = next((p for p in current if copies[p] == 1), None)
    return None if portion is None else (portion, True)
