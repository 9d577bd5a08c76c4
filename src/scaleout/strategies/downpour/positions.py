"""Where each Downpour replica reads when a run resumes with another replica count.

Replica r of R reads every R-th example from r on (`data.parts.data_part`), in an order of
its own per epoch. With the same count, each replica goes on from its saved position. With
another count the parts are new, so no saved position applies: the run's place in the data
is the mean of the saved replicas' places (epochs and the fraction of the epoch's batches of
their parts read), and each new replica starts its own part at that epoch and fraction. The
epoch's remaining share of the examples is then read once, though not exactly the examples
the old parts left; from the next epoch on, every example is read once an epoch again.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from scaleout.data import num_batches


def part_batches(train_size: int, part: int, num_parts: int, batch_size: int) -> int:
    """Batches an epoch of part `part` of `num_parts` has (as `strategies.batches` reads it)."""
    size = len(range(part, train_size, num_parts))
    return max(num_batches(size, batch_size, drop_last=size >= batch_size), 1)


def data_progress(
    positions: list[dict[str, Any] | None], train_size: int, batch_size: int
) -> float:
    """The mean place of the replicas at `positions` in their parts, in epochs (2.5: halfway
    through the third epoch); replicas without a position count as at the start."""
    count = len(positions)
    places = [
        (p or {}).get("epoch", 0)
        + (p or {}).get("batch", 0) / part_batches(train_size, r, count, batch_size)
        for r, p in enumerate(positions)
    ]
    return statistics.mean(places) if places else 0.0


def rescaled(
    positions: list[dict[str, Any] | None],
    count: int,
    train_size: int,
    batch_size: int,
    step: int,
    phase: int = 0,
) -> list[dict[str, int]]:
    """Positions for `count` replicas resuming a run whose replicas stood at `positions` at
    global step `step`: each at the saved replicas' mean place in the data, having trained
    its share of the steps so far (a DiLoCo replica's schedule counts them)."""
    progress = data_progress(positions, train_size, batch_size)
    epoch = math.floor(progress)
    out = []
    for r in range(count):
        batches = part_batches(train_size, r, count, batch_size)
        batch = round((progress - epoch) * batches)
        at_epoch, at_batch = (epoch + 1, 0) if batch >= batches else (epoch, batch)
        out.append({"step": step // count, "phase": phase, "epoch": at_epoch, "batch": at_batch})
    return out
