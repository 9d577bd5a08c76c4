"""The `[run]` and `[train]` sections: what every strategy and the driver read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

from scaleout.config import Section
from scaleout.nn.optim import OptimizerName


class RunSection(Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] = "run"
    seed: NonNegativeInt = 0
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")] = "auto"
    out_dir: Path = Path("runs")
    # torch intra-op threads; None: torch's default (at most 1024: torch takes a C int, and
    # no machine we run on has more cores)
    num_threads: Annotated[int, Field(ge=1, le=1024)] | None = None
    address: str | None = None  # Ray cluster to join: "auto", "host:port"; None: embedded
    tensorboard: bool = False  # also write TensorBoard event files beside metrics.jsonl

    @property
    def run_dir(self) -> Path:
        return self.out_dir / self.name


class TrainSection(Section):
    strategy: str = "single"  # a name of the strategy registry (checked where it is known)
    epochs: PositiveInt = 1
    steps: PositiveInt | None = None  # when set, overrides epochs
    batch_size: PositiveInt = 128
    optimizer: OptimizerName = "sgd"
    lr: PositiveFloat = 0.01
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9  # "momentum"; rmsprop/adam ignore it
    weight_decay: NonNegativeFloat = 0.0
    # optimizer steps of linear learning-rate warm-up; None: 200 for adagrad, else 0
    warmup_steps: NonNegativeInt | None = None
    # (output, target) -> scalar loss, "package.module:function"; None: cross-entropy
    loss: str | None = None
    eval_every: PositiveInt = 500  # steps between test evaluations (and one at the end)
    target_accuracy: Annotated[float, Field(gt=0, le=1)] | None = None  # stop when reached
    eval_batch_size: PositiveInt = 1000
    log_every: PositiveInt = 50  # steps between metrics lines
    checkpoint_every: PositiveInt = 1000  # steps between checkpoints (and one at the end)
    keep_checkpoints: PositiveInt = 2
    # A worker of a lock-step strategy (sync, model_parallel) that dies stops its group; the
    # driver restarts the strategy from the last checkpoint up to this many times.
    max_restarts: NonNegativeInt = 3

    def total_steps(self, batches_per_epoch: int) -> int:
        """`steps`, or `epochs` passes of `batches_per_epoch` (per phase for layer-wise
        training)."""
        return self.steps or self.epochs * max(batches_per_epoch, 1)
