"""The `[run]` and `[train]` sections: what every strategy and the driver read."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
)

from scaleout.config import Section
from scaleout.nn.optim import OPTIMIZER_NAMES
from scaleout.nn.schedule import ScheduleName

Precision = Literal["fp32", "bf16", "fp16"]
Beta = Annotated[float, Field(ge=0, lt=1)]
FACTORY = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # "package.module:function"


class RunSection(Section):
    # the run directory's name (out_dir/name); one that already holds a run is an error
    # unless the run resumes it (--resume) or replaces it (--overwrite)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] = "run"
    # seeds the initial weights, generated data, data order, dropout and augmentation
    seed: NonNegativeInt = 0
    # where each worker trains: "cpu", "cuda", "cuda:N", "mps"; "auto": CUDA where the
    # worker's machine has it, else CPU (never MPS)
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")] = "auto"
    # the directory that holds the run directories (relative: to the working directory)
    out_dir: Path = Path("runs")
    # torch intra-op threads; None: torch's default (at most 1024: torch takes a C int, and
    # no machine we run on has more cores)
    num_threads: Annotated[int, Field(ge=1, le=1024)] | None = None
    address: str | None = None  # Ray cluster to join: "auto", "host:port"; None: embedded
    tensorboard: bool = False  # also write TensorBoard event files beside metrics.jsonl
    # "bf16": forward and loss under autocast (CPU and CUDA), fp32 weights and optimizer
    # state; "fp16": the same in float16 with a GradScaler (CUDA only)
    precision: Precision = "fp32"
    # on SIGTERM (a node taken by Kubernetes, Slurm, a spot reclaim) the run stops at its next
    # safe point and checkpoints (Downpour: its shards too) within this many seconds, then
    # exits with 143; past it, or on a second SIGTERM, it exits at once. None: no limit
    stop_grace_s: PositiveFloat | None = 25.0

    @property
    def run_dir(self) -> Path:
        return self.out_dir / self.name


class TrainSection(Section):
    strategy: str = "single"  # a name of the strategy registry (checked where it is known)
    # passes over the training set (training examples / batch_size steps each; per stack for
    # a layer-wise model); unused when steps is set, and by sandblaster
    epochs: PositiveInt = 1
    steps: PositiveInt | None = None  # when set, overrides epochs
    # examples per step: sync splits them among its workers, and a downpour step is one
    # replica's batch; sandblaster ignores it ([sandblaster] batch_size)
    batch_size: PositiveInt = 128
    # sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw, or "package.module:function"
    # building one from the parameters: fn(params) -> torch.optim.Optimizer
    optimizer: str = "sgd"
    # base learning rate of a named optimizer (a factory's optimizer keeps its own), scaled by
    # lr_schedule each step; sandblaster ignores it (its line search picks the step)
    lr: PositiveFloat = 0.01
    # "momentum" and "nesterov"; the others ignore it
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    weight_decay: NonNegativeFloat = 0.0  # adamw: decoupled from the gradient
    # adam, adamw: the moments' decay rates; None: torch's (0.9, 0.999)
    betas: tuple[Beta, Beta] | None = None
    eps: PositiveFloat | None = None  # adagrad, rmsprop, adam, adamw; None: torch's default
    # the learning rate of each global step (`scaleout.nn.schedule`)
    lr_schedule: ScheduleName = "constant"
    # steps of linear learning-rate warm-up; None: 200 for adagrad, else 0
    warmup_steps: NonNegativeInt | None = None
    decay_steps: PositiveInt | None = None  # wsd's final decay; None: the last fifth
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0  # where a schedule ends
    # clip the global L2 norm of each step's gradient to this (None: off); logs grad_norm
    grad_clip_norm: PositiveFloat | None = None
    # micro-batches per optimizer step: batch_size examples in that many equal parts
    accumulate_steps: PositiveInt = 1
    # (output, target) -> scalar loss, "package.module:function"; None: cross-entropy
    loss: str | None = None
    # (output, target) -> {name: batch mean}, "package.module:function"; logged as test_<name>
    metrics: Annotated[str, Field(pattern=FACTORY)] | None = None
    eval_every: PositiveInt = 500  # steps between test evaluations (and one at the end)
    target_accuracy: Annotated[float, Field(gt=0, le=1)] | None = None  # stop when reached
    eval_batch_size: PositiveInt = 1000  # examples per forward pass of a test evaluation
    log_every: PositiveInt = 50  # steps between metrics lines
    checkpoint_every: PositiveInt = 1000  # steps between checkpoints (and one at the end)
    keep_checkpoints: PositiveInt = 2  # newest checkpoints kept; each write deletes older ones
    # A worker of a lock-step strategy (sync, model_parallel) that dies stops its group; the
    # driver restarts the strategy from the last checkpoint up to this many times.
    max_restarts: NonNegativeInt = 3

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, value: str) -> str:
        if value in OPTIMIZER_NAMES or re.match(FACTORY, value):
            return value
        raise ValueError(
            f"{value!r} is not an optimizer: use one of {', '.join(OPTIMIZER_NAMES)} or a "
            "factory 'package.module:function'"
        )

    @field_validator("accumulate_steps")
    @classmethod
    def _micro_batches(cls, value: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_size")
        if batch is not None and batch % value:
            raise ValueError(
                f"does not divide train.batch_size = {batch}: each step's batch is split into "
                "that many equal micro-batches; choose a divisor of the batch"
            )
        return value

    def total_steps(self, batches_per_epoch: int) -> int:
        """`steps`, or `epochs` passes of `batches_per_epoch` (per phase for layer-wise
        training)."""
        return self.steps or self.epochs * max(batches_per_epoch, 1)
