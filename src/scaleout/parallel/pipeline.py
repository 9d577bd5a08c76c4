"""A pipeline stage's worker side: the step of `torch.distributed.pipelining`'s schedules
(GPipe, 1F1B) over micro-batches, and an evaluation that relays activations stage to stage.

    stages_group, replicas_group = pipeline_groups(world, stages=2, device=device)
    runner = PipelineRunner(stage, stages_group, microbatches=4, schedule="1f1b", loss=loss,
                            device=device)
    out = runner.train_step(x, y)           # forward + backward; the merged output (N, ...)
                                            # on the last stage, None on the others
    relayed = runner.relay(x)               # one forward for evaluation, no gradients

Every stage of a pipeline reads the same batch (the first uses x, the last y). The schedule
scales each micro-batch's loss by 1/microbatches, so the gradient is the whole batch's mean,
as one process computes it. Several pipelines train data-parallel: rank r is stage
r % stages of pipeline r // stages, and each stage averages its gradient with the same
stage of the other pipelines (`replicas_group`). Why torch's schedules and device mesh: they
are the ones torchtitan runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from scaleout.parallel.data_parallel import average_tensors

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
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


class PipelineRunner:
    """This rank's stage (its module `stage`) of the pipeline `group` (the stage's index is
    the rank in it) under schedule `schedule`."""

    def __init__(
        self,
        stage: nn.Module,
        group: dist.ProcessGroup,
        microbatches: int,
        schedule: ScheduleName,
        loss: Callable[[Tensor, Tensor], Tensor],
        device: torch.device,
    ) -> None:
        self.stage, self.group, self.device = stage, group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.first, self.last = self.rank == 0, self.rank == self.world - 1
        pipe = PipelineStage(stage, self.rank, self.world, device, group=group)
        self.schedule = SCHEDULES[schedule](pipe, microbatches, loss_fn=loss)
        self.microbatches = microbatches
        self._inferred = False  # the first step infers the stages' shapes with a forward

    def _counters(self) -> dict[str, Tensor]:
        """BatchNorm's `num_batches_tracked`: the shape inference's forward counts too."""
        return {n: b for n, b in self.stage.named_buffers() if n.endswith("num_batches_tracked")}

    def train_step(self, x: Tensor, y: Tensor) -> Tensor | None:
        """Forward and backward of one batch over every stage; the gradients add up in
        this stage's `.grad`. The last stage returns the merged output (detached)."""
        if self.first and self.last:
            raise AssertionError("a pipeline of one stage needs no runner")
        if not self._inferred:
            self._inferred = True
            counted = {n: b.clone() for n, b in self._counters().items()}
            out = self._step(x, y)
            for name, buffer in self._counters().items():  # one count per micro-batch
                buffer.copy_(counted[name] + self.microbatches)
            return out
        return self._step(x, y)

    def _step(self, x: Tensor, y: Tensor) -> Tensor | None:
        if self.first:
            self.schedule.step(x)
            return None
        if self.last:
            out = self.schedule.step(target=y, losses=[])
            return out.detach() if isinstance(out, Tensor) else out
        self.schedule.step()
        return None

    @torch.no_grad()
    def relay(self, x: Tensor) -> Tensor | None:
        """This stage's part of one forward pass (the first from `x`, the others from the
        previous stage's activation); the last stage returns the output, the others send
        theirs on and return None."""
        inputs = x if self.first else self._receive()
        out = self.stage(inputs)
        if self.last:
            return out
        self._send(out)
        return None

    def _send(self, tensor: Tensor) -> None:
        if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
            raise ValueError(
                f"a pipeline stage's output must be a float tensor of at most {_HEADER - 2} "
                f"dimensions, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        header = torch.zeros(_HEADER, dtype=torch.long)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.send(header.to(self.device), group=self.group, group_dst=self.rank + 1)
        dist.send(tensor.contiguous(), group=self.group, group_dst=self.rank + 1)

    def _receive(self) -> Tensor:
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, group=self.group, group_src=self.rank - 1)
        header = header.cpu()
        shape = header[2 : 2 + int(header[1])].tolist()
        tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=self.device)
        dist.recv(tensor, group=self.group, group_src=self.rank - 1)
        return tensor


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
