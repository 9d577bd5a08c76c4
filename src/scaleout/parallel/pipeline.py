"""A pipeline stage's worker side: the step of `torch.distributed.pipelining`'s schedules
(GPipe, 1F1B) over micro-batches, and an evaluation that relays activations stage to stage.

    runner = PipelineRunner(stage, rank, world, microbatches=4, schedule="1f1b", loss=loss)
    out = runner.train_step(x, y)           # forward + backward; the merged output (N, ...)
                                            # on the last stage, None on the others
    relayed = runner.relay(x)               # one forward for evaluation, no gradients

Every stage reads the same batch (the first uses x, the last y). The schedule scales each
micro-batch's loss by 1/microbatches, so the gradient is the whole batch's mean, as one
process computes it. Why torch's schedules: they are the ones torchtitan runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 9  # dtype, ndim, then up to 7 sizes


class PipelineRunner:
    """Stage `rank` of `world` (its module `stage`) under schedule `schedule`."""

    def __init__(
        self,
        stage: nn.Module,
        rank: int,
        world: int,
        microbatches: int,
        schedule: ScheduleName,
        loss: Callable[[Tensor, Tensor], Tensor],
        device: torch.device,
    ) -> None:
        self.stage, self.rank, self.world, self.device = stage, rank, world, device
        self.first, self.last = rank == 0, rank == world - 1
        pipe = PipelineStage(stage, rank, world, device)
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
        dist.send(header.to(self.device), self.rank + 1)
        dist.send(tensor.contiguous(), self.rank + 1)

    def _receive(self) -> Tensor:
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, self.rank - 1)
        header = header.cpu()
        shape = header[2 : 2 + int(header[1])].tolist()
        tensor = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=self.device)
        dist.recv(tensor, self.rank - 1)
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
