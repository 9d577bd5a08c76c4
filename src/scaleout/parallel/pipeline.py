"""A pipeline stage's worker side: the step of `torch.distributed.pipelining`'s schedules
(GPipe, 1F1B) over micro-batches, and an evaluation that relays activations stage to stage.

    stages_group, replicas_group = pipeline_groups(world, stages=2, device=device)
    runner = PipelineRunner(stage, stages_group, microbatches=4, schedule="1f1b", loss=loss,
                            device=device, codec=None)  # a codec: activations 8-bit
    out = runner.train_step(x, y)           # forward + backward; the merged output (N, ...)
                                            # on the last stage, None on the others
    relayed = runner.relay(x)               # one forward for evaluation, no gradients

Every stage of a pipeline reads the same batch (the first uses x, the last y). The schedule
scales each micro-batch's loss by 1/microbatches, so the gradient is the whole batch's mean,
as one process computes it. Several pipelines train data-parallel: rank r is stage
r % stages of pipeline r // stages, and each stage averages its gradient with the same
stage of the other pipelines (`replicas_group`). With a codec, the activations and their
gradients cross between stages as its payloads (`scaleout.compress.activations`). Why
torch's schedules and device mesh: they are the ones torchtitan runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from scaleout.compress import Codec
from scaleout.compress.activations import (
    ACTIVATION_DTYPES,
    CodedStage,
    activation_codec,
    payload_numel,
)
from scaleout.parallel.data_parallel import average_tensors

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_HEADER = 9  # dtype, ndim, then up to 7 sizes


def pipeline_groups(
    world: int, stages: int, device: torch.device
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's pipeline (its `stages` ranks in stage order) and the ranks that hold its
    stage in the other pipelines (None for one pipeline), of `world // stages` pipelines
    side by side: rank r is stage r % stages of pipeline r // stages. A collective: every
    rank calls it."""
    assert world % stages == 0, f"{world} ranks do not make pipelines of {stages} stages"
    if world == stages:
        return dist.group.WORLD, None  # type: ignore[return-value]
    mesh = init_device_mesh(device.type, (world // stages, stages), mesh_dim_names=("dp", "pp"))
    return mesh.get_group("pp"), mesh.get_group("dp")


def average_gradients(module: nn.Module, replicas: dist.ProcessGroup | None) -> None:
    """Average `module`'s gradients over the same stage of every pipeline (`replicas`), so
    that the pipelines step as one; nothing for one pipeline."""
    if replicas is not None:
        average_tensors([p.grad for p in module.parameters() if p.grad is not None], replicas)


def sum_tied_gradients(
    held: Sequence[tuple[nn.Parameter | None, tuple[int, ...]]],
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    """Sum the gradients of the parameters several stages hold (`stages.tied_parameters`,
    in its order: this stage's copy, or None, and the shape) over the pipeline `group`, so
    every copy steps alike; one all-reduce, nothing without tied parameters."""
    if not held:
        return
    pieces = [
        p.grad.reshape(-1).float()
        if p is not None and p.grad is not None
        else torch.zeros(math.prod(shape), device=device)
        for p, shape in held
    ]
    flat = torch.cat(pieces)  # (sum of numels,)
    dist.all_reduce(flat, group=group)
    sizes = [math.prod(shape) for _, shape in held]
    for (param, shape), total in zip(held, flat.split(sizes), strict=True):
        if param is not None:
            param.grad = total.view(shape).to(param.dtype)


class PipelineRunner:
    """This rank's stage (its module `stage`) of the pipeline `group` (the stage's index is
    the rank in it) under schedule `schedule`; with `codec`, activations and their
    gradients cross between stages as its payloads."""

    def __init__(
        self,
        stage: nn.Module,
        group: dist.ProcessGroup,
        microbatches: int,
        schedule: ScheduleName,
        loss: Callable[[Tensor, Tensor], Tensor],
        device: torch.device,
        codec: Codec | None = None,
    ) -> None:
        self.stage, self.group, self.device = stage, group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        self.codec = activation_codec(codec) if codec is not None else None
        # what runs: the stage, between codec payloads where it receives and sends
        self.module: nn.Module = stage
        if self.codec is not None:
            self.module = CodedStage(stage, self.codec, not self.first, not self.last)
        self.microbatches, self.loss = microbatches, loss
        self.schedule_class = SCHEDULES[schedule]
        self.schedule: PipelineScheduleSingle | None = None  # built at the first step (`_build`)

    def train_step(self, x: Tensor, y: Tensor) -> Tensor | None:
        """Forward and backward of one batch over every stage; the gradients add up in
        this stage's `.grad`. The last stage returns the merged output (detached)."""
        if self.first and self.last:
            raise AssertionError("a pipeline of one stage needs no runner")
        if self.schedule is None:
            self.schedule = self._build(x)
        if self.first:
            self.schedule.step(x)
            return None
        if self.last:
            out = self.schedule.step(target=y, losses=[])
            return out.detach() if isinstance(out, Tensor) else out
        self.schedule.step()
        return None

    def _build(self, x: Tensor) -> PipelineScheduleSingle:
        """The schedule, with every stage's input and output shapes given (torch's static
        mode, so no step runs to infer them): each stage runs one micro-batch in eval mode
        (no statistics or dropout draws; the first stage its real one, the others zeros of
        the shape they are told) and tells the next stage what it sends."""
        micro = x[: len(x) // self.microbatches]
        was_training = self.stage.training
        self.stage.eval()
        with torch.no_grad():
            if self.first:
                inputs = micro
            else:
                shape, dtype = self._receive_header()
                inputs = torch.zeros(shape, dtype=dtype, device=self.device)
            out = self.stage(inputs)
        self.stage.train(was_training)
        if not self.last:
            self._send_header(out)
        received = micro if self.first else self._crossing(inputs)
        sent = out if self.last else self._crossing(out)
        pipe = PipelineStage(
            self.module,
            self.rank,
            self.world,
            self.device,
            input_args=received,
            output_args=sent,
            group=self.group,
        )
        return self.schedule_class(pipe, self.microbatches, loss_fn=self.loss)

    def _crossing(self, activation: Tensor) -> Tensor:
        """A tensor shaped as what crosses between stages for `activation`: itself, or
        its payload under the codec; it carries a gradient back."""
        shape, dtype = tuple(activation.shape), activation.dtype
        if self.codec is not None:
            shape, dtype = (payload_numel(self.codec, shape, dtype),), torch.float32
        return torch.empty(shape, dtype=dtype, device=self.device, requires_grad=True)

    @torch.no_grad()
    def relay(self, x: Tensor) -> Tensor | None:
        """This stage's part of one forward pass (the first from `x`, the others from the
        previous stage's activation); the last stage returns the output, the others send
        theirs on and return None."""
        inputs = x if self.first else self._receive()
        out = self.module(inputs)
        if self.last:
            return out
        self._send(out)
        return None

    def _send(self, tensor: Tensor) -> None:
        self._send_header(tensor)
        dist.send(tensor.contiguous(), group=self.group, group_dst=self.rank + 1)

    def _receive(self) -> Tensor:
        shape, dtype = self._receive_header()
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, group=self.group, group_src=self.rank - 1)
        return tensor

    def _send_header(self, tensor: Tensor) -> None:
        """`tensor`'s shape and dtype, to the next stage."""
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in ACTIVATION_DTYPES:
            raise ValueError(
                f"a pipeline stage's output must be a float tensor of at most {_HEADER - 2} "
                f"dimensions, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        header = torch.zeros(_HEADER, dtype=torch.long)
        header[0], header[1] = ACTIVATION_DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header.to(self.device), group=self.group, group_dst=self.rank + 1)

    def _receive_header(self) -> tuple[list[int], torch.dtype]:
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, group=self.group, group_src=self.rank - 1)
        header = header.cpu()
        return header[2 : 2 + int(header[1])].tolist(), ACTIVATION_DTYPES[int(header[0])]


class Relayed(nn.Module):
    """The whole pipeline as the last stage's module for an evaluation loop: `forward(x)`
    ignores `x` and returns the output the stages relayed (`PipelineRunner.relay`). The
    other stages run `relay` on the same batches meanwhile."""

    def __init__(self, runner: PipelineRunner) -> None:
        super().__init__()
        self.runner = runner
        self.inner = runner.stage  # its parameters: the evaluation reads their dtype

    def forward(self, x: Tensor) -> Tensor:
        out = self.runner.relay(x)
        assert out is not None, "only the last stage evaluates"
        return out
