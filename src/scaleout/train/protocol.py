"""The contract between the driver and a strategy.

The driver (`scaleout.train.driver`) owns everything a run does around training: the cadence
of logging, evaluation and checkpoints, `metrics.jsonl`, the progress bar, Ctrl-C, resume
checks and the summary. A strategy owns how training is spread over workers. They meet in
`Strategy`: the driver asks for a `Plan`, starts the strategy (from a checkpoint when
resuming), then alternates `train(num_steps)` with evaluations and checkpoints until the plan
is done, the target accuracy is reached, the strategy stops by itself, or the user presses
Ctrl-C; then `finish()` and `close()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Plan:
    """How long a run is. `phase_steps`: layer-wise (greedy) training trains phase k (stack
    k + 1) during steps k * phase_steps + 1 .. (k + 1) * phase_steps; a chunk never crosses a
    phase, and each phase ends with an evaluation and a checkpoint."""

    total_steps: int
    batches_per_epoch: int
    num_phases: int = 1
    phase_steps: int | None = None

    def boundaries(self) -> list[int]:
        """Steps at which a chunk must end besides the cadence (phase ends)."""
        if self.phase_steps is None or self.num_phases == 1:
            return []
        return [self.phase_steps * (k + 1) for k in range(self.num_phases)]

    def resume_meta(self) -> dict[str, Any]:
        """What a checkpoint records of the plan, and a resumed run must match."""
        meta: dict[str, Any] = {"batches_per_epoch": self.batches_per_epoch}
        if self.phase_steps is not None:
            meta["steps_per_stack"] = self.phase_steps
        return meta


@dataclass
class Chunk:
    """What `train` reports: steps done since the last report and sums over their examples.

    `loss_sum` (and every entry of `term_sums`, e.g. a layer-wise objective's terms) is a sum
    of per-example values, so the driver's windowed means weigh every example equally;
    `correct` is the accuracy x examples when the targets are class indices (right
    predictions for one target per example; token accuracy x sequences for a sequence
    model); `fields` are
    latest values copied into the next metrics line as they are (epoch, lr, a strategy's
    own statistics; `loss` there overrides the windowed mean, e.g. L-BFGS's objective).
    `seconds`: training time the steps took (None: the wall time of the call). `stopped`:
    the strategy ended the run by itself (a converged L-BFGS), and why."""

    steps: int = 0
    examples: int = 0
    loss_sum: float = 0.0
    correct: float | None = None
    term_sums: dict[str, float] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    stopped: str | None = None

    def add(self, other: Chunk) -> None:
        """Take `other`'s steps and sums into this one (its fields overwrite; the seconds
        add up when both have some)."""
        self.steps += other.steps
        self.examples += other.examples
        self.loss_sum += other.loss_sum
        if other.correct is not None:
            self.correct = (self.correct or 0) + other.correct
        for name, value in other.term_sums.items():
            self.term_sums[name] = self.term_sums.get(name, 0.0) + value
        self.fields.update(other.fields)
        if other.seconds is not None:
            self.seconds = (self.seconds or 0.0) + other.seconds


@dataclass(frozen=True)
class Resume:
    """A verified checkpoint to continue from."""

    path: Path
    tensors: Tensors
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


class Strategy(Protocol):
    """One way of training: single, sync, downpour, sandblaster, model_parallel."""

    name: str
    # True when `start` may be called again after `close`: the driver then restarts the
    # strategy from the last checkpoint when one of its workers dies (`WorkerDied`).
    restartable: bool

    def plan(self) -> Plan:
        """The run's length, from the config and the data (before anything starts)."""
        ...

    def start(self, resume: Resume | None) -> dict[str, Any]:
        """Start the workers, from `resume` when given. Returns counters that override the
        checkpoint's (`step`, `examples`, `time_s`) when the strategy restored from a newer
        state of its own (Sandblaster's shards), else {}."""
        ...

    def train(self, num_steps: int, stop: Callable[[], bool]) -> Chunk:
        """Train at least `num_steps` steps (an asynchronous strategy may report a few more,
        never past the plan or a phase end); return early when `stop()` turns true."""
        ...

    def metrics(self) -> dict[str, Any]:
        """The strategy's own fields for the metrics line being written: statistics since
        the previous line (Downpour's staleness and bytes moved), and `_bar`, fields for the
        progress bar only."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Test metrics of the current parameters: `test_loss`, and `test_accuracy` when the
        targets are class indices (plus a strategy's own, e.g. the objective's terms)."""
        ...

    def state(self) -> tuple[Tensors, dict[str, Any]]:
        """The checkpoint: tensors (`model.*`, `optim.*`, `rng.*`, ...) and metadata."""
        ...

    def finish(self) -> Chunk:
        """Wait for work still under way at the end (Downpour's last chunks and pushes);
        report the steps it did."""
        ...

    def summary(self) -> dict[str, Any]:
        """The strategy's own lines for the run's summary (failures, restarts, ...)."""
        ...

    def close(self) -> None:
        """Stop every process the strategy started; called in `finally`."""
        ...
