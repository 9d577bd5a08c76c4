"""How a worker's gradient becomes new parameters: one `Updater` per worker.

The training loop (`Worker.train`) is the same under every strategy:

    updater.begin_step()                          # Downpour: a fetch when one is due
    loss = forward_backward(batch)                # DDP all-reduces inside backward
    updater.end_step(loss, compute_s, step, lr_step)

- `LocalUpdate`: the worker's own optimizer: strategy "single", "sync" (DDP's gradients,
  or weights and optimizer state averaged every `average_every` steps), a model-parallel
  grid (its replicated parameters' gradients summed first) and pipelines (tied copies'
  gradients summed over the stages, then averaged over the pipelines).
- `ShardUpdate`: the parameter server (Downpour): a `ReplicaClient` pushes the gradient
  every `n_push` steps and fetches every `n_fetch`; in DiLoCo mode the replica steps its
  own `LocalUpdate` and pushes the change of its parameters instead.

`values()` is what checkpoints read: the shards' parameters under Downpour, else the
worker's own; `evaluated()` is what evaluation reads: the same, except the workers' average
in sync "average" mode (a collective every worker joins).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from scaleout.checkpoint import OptimizerState, optimizer_state
from scaleout.parallel import average_tensors, synced_state
from scaleout.train.state import restored

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from scaleout.ps import ReplicaClient
    from scaleout.train.step import Stepper


class Updater(Protocol):
    """One step's update of a worker's parameters (see the module's docstring)."""

    optimizer: torch.optim.Optimizer | None  # what a checkpoint saves, if anything

    def begin_step(self) -> None: ...

    def end_step(self, loss: Tensor, started: float, step: int, lr_step: int) -> StepReport: ...

    def values(self) -> AbstractContextManager[None]: ...

    def evaluated(self) -> AbstractContextManager[None]: ...


@dataclass(slots=True)
class StepReport:
    """What an update reports of its step: the gradient norm before clipping (None: not
    measured) and the seconds spent averaging."""

    grad_norm: Tensor | None = None
    average_s: float = 0.0


class LocalUpdate:
    """The worker's own optimizer (None: forward and backward only, nothing stepped).

    `sync_grads` runs between backward and the step (a grid's replicated gradients summed; a
    pipeline's tied copies summed and its stages averaged over the pipelines); with
    `average_every`, the workers average weights and optimizer state every that many steps
    (`average_now`, a collective over all of them)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        stepper: Stepper,
        model: nn.Module,
        sync_grads: Callable[[], None] = lambda: None,
        average_every: int = 0,
        world: int = 1,
    ) -> None:
        self.optimizer, self.stepper, self.model = optimizer, stepper, model
        self.sync_grads, self.average_every, self.world = sync_grads, average_every, world

    def begin_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def end_step(self, loss: Tensor, started: float, step: int, lr_step: int) -> StepReport:
        """Step the optimizer at the schedule's `lr_step`; `step` is the worker's count of
        steps done, this one included; `started`: when its compute began (perf_counter)."""
        if self.optimizer is None:
            return StepReport()
        self.sync_grads()
        report = StepReport(self.stepper.step(self.optimizer, lr_step))
        if self.average_every and step % self.average_every == 0:
            started = time.perf_counter()
            self.average_now()
            report.average_s = time.perf_counter() - started
        return report

    def average_now(self) -> None:
        """Average weights and optimizer state over the workers (sync "average" mode)."""
        if self.optimizer is not None:
            average_tensors(synced_state(self.model, self.optimizer))

    def values(self) -> AbstractContextManager[None]:
        return nullcontext()

    @contextmanager
    def evaluated(self) -> Iterator[None]:
        """The workers' average in "average" mode, without changing the workers."""
        if not (self.average_every and self.world > 1):
            yield
            return
        params = [p.data for p in self.model.parameters()]
        with restored(params):
            average_tensors(params)
            yield


class ShardUpdate:
    """The parameter server's client as a worker's update (strategy "downpour").

    Gradient mode: backward adds each step's gradient into the client's buffer, pushed every
    `n_push` steps. DiLoCo: `inner` steps the replica's own optimizer after each backward and
    the client pushes the change of the parameters. A diverged loss stops the run before
    its gradient reaches the shards. Each push's record says which replica (and worker of
    a grid or pipeline) pushed, its step, and the mean loss and compute seconds since the
    previous push."""

    def __init__(
        self,
        client: ReplicaClient,
        params: list[nn.Parameter],
        inner: LocalUpdate | None,
        diverged: Callable[[float], None],
        replica: int,
        worker: int | None = None,
    ) -> None:
        self.client, self.params, self.inner = client, params, inner
        self.diverged, self.replica, self.worker = diverged, replica, worker
        self._window = [0.0, 0, 0.0]  # loss sum, steps, compute seconds since a push

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.inner.optimizer if self.inner is not None else None

    def begin_step(self) -> None:
        self.client.before_step()  # a fetch when one is due; the client zeroes its buffer

    def end_step(self, loss: Tensor, started: float, step: int, lr_step: int) -> StepReport:
        report = StepReport()
        if self.inner is not None:  # DiLoCo's inner step
            report = self.inner.end_step(loss, started, step, lr_step)
        compute_s = time.perf_counter() - started
        value = loss.item()
        if not math.isfinite(value):  # never push a diverged gradient to the shards
            self.diverged(value)
        window = self._window
        window[0] += value
        window[1] += 1
        window[2] += compute_s
        client = self.client
        done = client.after_step if client.mode == "diloco" else client.after_backward
        if client.push_due:
            done(**self._push_info(step))
        else:
            done()
        return report

    @contextmanager
    def values(self) -> Iterator[None]:
        """The shards' current parameters for the block, this replica's own afterwards (its
        training goes on from where it was)."""
        with restored(self.params):
            self.client.fetch(update_versions=False)
            yield

    def evaluated(self) -> AbstractContextManager[None]:
        return self.values()

    def _push_info(self, step: int) -> dict[str, Any]:
        loss_sum, steps, compute_s = self._window
        self._window = [0.0, 0, 0.0]
        info: dict[str, Any] = {
            "replica": self.replica,
            "replica_step": step,
            "loss": loss_sum / steps if steps else None,
            "compute_s": round(compute_s, 6),
        }
        if self.worker is not None:
            info["worker"] = self.worker
        return info

    def take_records(self, step: int) -> list[dict[str, Any]]:
        """The push records since the last call; with bounded staleness, the window this
        chunk left open is pushed first (the replica may idle until its next chunk)."""
        if self.client.bounded:
            self.client.release(**self._push_info(step + 1))
        return self.client.take_records()

    def flush(self, step: int) -> list[dict[str, Any]]:
        """Push what is left and wait until the shards applied it; the last push records."""
        return self.client.flush(pull=False, **self._push_info(step + 1))

    def inner_state(self) -> OptimizerState | None:
        """DiLoCo: the replica's own optimizer state (None in gradient mode)."""
        optimizer = self.optimizer
        return optimizer_state(optimizer) if optimizer is not None else None

    def detach(self) -> dict[str, Any]:
        """Adopt the shards' final values and leave them; the client's statistics."""
        self.client.fetch()
        stats = {**self.client.stats, "staleness": list(self.client.staleness)}
        self.client.close()
        return stats
