"""What surrounds an optimizer step, the same under every strategy.

One step trains on `train.batch_size` examples:

1. the batch is cut into `train.accumulate_steps` equal micro-batches; each runs forward
   and backward on its own (under autocast with `run.precision = "bf16"` / `"fp16"`), its
   loss weighted by its share of the batch, so the gradients add up to the whole batch's
   and memory peaks at one micro-batch. Under DDP only the last micro-batch all-reduces
   (`no_sync` for the others);
2. with `"fp16"` the loss is scaled (torch's `GradScaler`) and the gradient unscaled
   before anything reads it;
3. with `train.grad_clip_norm`, the gradient is clipped to that global L2 norm over every
   parameter of the step (`torch.nn.utils.clip_grad_norm_`); its norm before clipping is
   logged as `grad_norm`;
4. every group's learning rate is set from the global step (`scaleout.nn.schedule`), and
   the optimizer steps.

A strategy decides where this happens: a worker with an optimizer runs all four
(`Stepper.step` after `forward_backward`); a Downpour replica runs 1, and 3 on the gradient
it pushes, and the shards run 4 (`scaleout.ps`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from scaleout.errors import ConfigError
from scaleout.nn.optim import build_optimizer, warmup_steps
from scaleout.nn.schedule import Schedule, apply_lr
from scaleout.parallel.pipeline import PipelineRunner
from scaleout.runtime import resolve_device
from scaleout.train.config import Precision, TrainSection
from scaleout.train.job import Job
from scaleout.train.objective import Objective

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def schedule_for(train: TrainSection, total_steps: int, steps_per_update: int = 1) -> Schedule:
    """The learning rate of each global step of a run of `total_steps` steps.
    `steps_per_update`: the global steps each optimizer update takes (Downpour's
    `n_push`), by which Adagrad's default warm-up of 200 updates is counted in steps."""
    warmup = train.warmup_steps
    if warmup is None:
        warmup = warmup_steps(train) * steps_per_update
    try:
        return Schedule(
            train.lr_schedule, warmup, total_steps, train.decay_steps, train.min_lr_ratio
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_step_options(job: Job, total_steps: int) -> None:
    """What every strategy's step needs, checked on the driver before anything starts (one
    line each): fp16 on a CUDA device, a schedule that fits the run's `total_steps`, and an
    optimizer factory that builds a `torch.optim.Optimizer`."""
    check_precision(job.run.precision, resolve_device(job.run.device))
    schedule_for(job.train, total_steps)
    build_optimizer([nn.Parameter(torch.zeros(4))], job.optimizer_options())


def autocast(precision: Precision, device: torch.device) -> AbstractContextManager[Any]:
    """Autocast for `precision` on `device` (nothing for fp32)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def check_precision(precision: Precision, device: torch.device) -> None:
    """fp16 needs CUDA (its loss scaling is CUDA's `GradScaler`): one line otherwise."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            f'run.precision = "fp16" needs a CUDA device, and this run trains on {device.type}: '
            'use run.precision = "bf16" (autocast on the CPU too) or "fp32"'
        )


def micro_batches(batch: Sequence[Tensor], parts: int) -> list[tuple[list[Tensor], float]]:
    """`batch` cut along its first dimension into `parts` near-equal micro-batches, each
    with its share of the examples (empty parts dropped)."""
    if parts == 1:
        return [(list(batch), 1.0)]
    total = len(batch[0])
    pieces = [torch.tensor_split(t, parts) for t in batch]
    out = []
    for i in range(parts):
        part = [p[i] for p in pieces]
        if len(part[0]):
            out.append((part, len(part[0]) / total))
    return out


@torch.no_grad()
def clip_gradients(
    params: Iterable[Tensor],
    max_norm: float,
    stages: dist.ProcessGroup | None = None,
    counted_elsewhere: Collection[Tensor] = (),
) -> Tensor:
    """Clip the gradients of `params` to global L2 norm `max_norm` in place, as
    `torch.nn.utils.clip_grad_norm_` does; return the norm before clipping. Split weights
    (DTensors) count whole; `stages`: a pipeline whose other stages' gradients count too
    (each rank holds its stage's, an all-reduce of the squares), except those of
    `counted_elsewhere` (copies of tied parameters that another stage counts)."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    split = [isinstance(g, DTensor) for g in grads]
    if stages is None and (all(split) or not any(split)):  # torch's own, one kind of tensor
        norm = nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    elsewhere = {id(p) for p in counted_elsewhere}
    counted = [p.grad for p in params if p.grad is not None and id(p) not in elsewhere]
    squares = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for grad in counted:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        squares += (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    if stages is not None:
        dist.all_reduce(squares, group=stages)
    total = squares.sqrt()
    scale = float((max_norm / (total + 1e-6)).clamp(max=1.0))
    for grad in grads:
        grad.mul_(scale)
    return total


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class Stepper:
    """The four parts of a step (module docstring) for one worker on `device`."""

    train: TrainSection
    precision: Precision
    device: torch.device
    schedule: Schedule = field(default_factory=Schedule)
    # a pipeline's stages: the gradient's norm is the whole model's, over this group
    stages: dist.ProcessGroup | None = None
    # this stage's copies of tied parameters whose norm another stage counts
    counted_elsewhere: list[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_precision(self.precision, self.device)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None

    def autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.precision, self.device)

    def forward_backward(
        self,
        objective: Objective,
        model: nn.Module,
        network: nn.Module,
        batch: Sequence[Tensor],
        phase: int,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward and backward over the step's micro-batches: the gradients add up in
        `.grad`; return the batch's loss (detached) and its per-example sums."""
        if isinstance(network, PipelineRunner):
            return self._pipelined(objective, model, network, batch, phase)
        parts = micro_batches(batch, self.train.accumulate_steps)
        loss_total: Tensor | None = None
        sums: dict[str, Tensor] = {}
        for i, (part, weight) in enumerate(parts):
            hold = i < len(parts) - 1  # no gradient exchange until the last micro-batch
            if isinstance(network, FSDPModule):
                network.set_requires_gradient_sync(not hold)
            hold = hold and isinstance(network, DistributedDataParallel)
            with network.no_sync() if hold else nullcontext():  # type: ignore[operator]
                with self.autocast():
                    loss, part_sums = objective.step(model, network, part, phase)
                if weight != 1.0:
                    loss = loss * weight
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
            for name, value in part_sums.items():
                sums[name] = sums[name] + value if name in sums else value
        assert loss_total is not None, "an empty batch"
        return loss_total, sums

    def _pipelined(
        self,
        objective: Objective,
        model: nn.Module,
        runner: PipelineRunner,
        batch: Sequence[Tensor],
        phase: int,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward and backward through the pipeline's stages (its schedule cuts the batch
        into micro-batches); the last stage measures the merged output with the objective,
        and every stage gets its sums."""
        x, y = batch[0], batch[1]
        with self.autocast():
            out = runner.train_step(x, y)
        sums: dict[str, Tensor] = {}
        if runner.last:
            assert out is not None
            with torch.no_grad(), self.autocast():
                _, sums = objective.step(model, lambda _: out, batch, phase)  # type: ignore[arg-type]
            sums = {k: v.cpu() for k, v in sums.items()}
        shared: list[Any] = [sums]
        dist.broadcast_object_list(shared, group=runner.group, group_src=runner.world - 1)
        sums = {k: v.to(self.device) for k, v in shared[0].items()}
        return sums["loss"] / len(y), sums

    def step(self, optimizer: torch.optim.Optimizer, global_step: int) -> Tensor | None:
        """Unscale, clip, set the learning rate of `global_step`, step; return the gradient
        norm before clipping (None when clipping is off)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = None
        if self.train.grad_clip_norm is not None:
            norm = clip_gradients(
                optimizer_params(optimizer),
                self.train.grad_clip_norm,
                self.stages,
                self.counted_elsewhere,
            )
        apply_lr(optimizer, self.schedule, global_step)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return norm
