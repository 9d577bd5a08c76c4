"""Learning-rate schedules as closed forms of the global step.

The rate of optimizer step k (k = 0, 1, ...: the steps done before it) is the group's base
rate times `Schedule.factor(k)`; nothing is counted inside the optimizer, so a run resumed at
step k, a shard that knows how many steps its pushes carried, and a worker of any strategy
all agree on the rate without saving a scheduler's state.

With W = `warmup_steps`, T = `total_steps`, m = `min_lr_ratio`:

- warm-up, k < W: (k + 1) / W (as torch's `LinearLR` from 1/W to 1 over W - 1 steps);
- then, with progress p = (k - W) / (T - W), clipped to [0, 1]:
  - `constant`: 1;
  - `cosine`: m + (1 - m) (1 + cos(pi p)) / 2 (torch's `CosineAnnealingLR`, T_max = T - W);
  - `linear`: m + (1 - m) (1 - p) (torch's `LinearLR` to m over T - W steps);
  - `wsd` (warmup-stable-decay): 1 until T - D, then linear to m over the last D =
    `decay_steps` steps (default a fifth of T): q = (k - (T - D)) / D, m + (1 - m) (1 - q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ScheduleName = Literal["constant", "cosine", "linear", "wsd"]
WSD_DECAY_FRACTION = 0.2  # wsd's decay, where decay_steps is not given: the last fifth


@dataclass(frozen=True)
class Schedule:
    """The learning-rate factor of each global step (see the module docstring)."""

    kind: ScheduleName = "constant"
    warmup_steps: int = 0
    total_steps: int = 0  # the run's optimizer steps; unused by "constant"
    decay_steps: int | None = None  # wsd only; None: a fifth of total_steps
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine", "linear", "wsd"):
            raise ValueError(
                f"train.lr_schedule = {self.kind!r} is not a schedule: use constant, cosine, "
                "linear or wsd"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio = {self.min_lr_ratio} must lie in [0, 1]")
        if self.kind == "constant":
            return
        if self.warmup_steps >= self.total_steps:
            raise ValueError(
                f"train.warmup_steps = {self.warmup_steps} leaves no step of the run's "
                f"{self.total_steps} to the {self.kind} schedule: use fewer warm-up steps"
            )
        if self.kind == "wsd" and not 0 < self.decay() <= self.total_steps - self.warmup_steps:
            room = self.total_steps - self.warmup_steps
            raise ValueError(
                f"train.decay_steps = {self.decay_steps} must lie in 1..{room} (the run's "
                f"{self.total_steps} steps less train.warmup_steps = {self.warmup_steps})"
            )

    def decay(self) -> int:
        """wsd's decay steps (D)."""
        if self.decay_steps is not None:
            return self.decay_steps
        return max(1, round(WSD_DECAY_FRACTION * self.total_steps))

    def factor(self, step: int) -> float:
        """The factor of the base rate at global step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        m = self.min_lr_ratio
        if self.kind == "wsd":
            decay = self.decay()
            start = self.total_steps - decay
            if step < start:
                return 1.0
            return m + (1.0 - m) * (1.0 - min((step - start) / decay, 1.0))
        p = min((step - self.warmup_steps) / (self.total_steps - self.warmup_steps), 1.0)
        if self.kind == "cosine":
            return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))
        return m + (1.0 - m) * (1.0 - p)


def apply_lr(optimizer: torch.optim.Optimizer, schedule: Schedule, step: int) -> float:
    """Set every group's rate for global step `step`; return the first group's. Each
    group's rate when first set is kept as its base (`initial_lr`, torch's own key for it,
    saved with the optimizer's state)."""
    factor = schedule.factor(step)
    for group in optimizer.param_groups:
        base = group.setdefault("initial_lr", group["lr"])
        group["lr"] = base * factor
    return optimizer.param_groups[0]["lr"]
