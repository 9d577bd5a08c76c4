"""Workers in lock step: one in this process, or Ray actors joined in a process group.

A strategy talks to its workers through `call(Worker.method, *args)`: every worker runs
`method(worker, *args)` at once, and the answers come back in rank order. `LocalWorkers` is
one worker in the driver's process (strategy "single": no Ray at all); `ActorWorkers` is W
Ray actors (`WorkerActor`) in one placement group and, when W > 1 or the strategy needs
collectives, one torch.distributed group (gloo on CPU, NCCL on GPU). The same Worker code runs
in both: one code path that degrades to one worker.

A worker that dies takes its group down (the others would wait for it in a collective): the
call raises `WorkerDied` naming it and where the run stopped; an error the user can fix
raised inside a worker (a `UserError`) reaches the caller as itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from scaleout.comm import GroupMember, ProcessGroup
from scaleout.runtime import cpu_share, kill, resolve_device, spawn
from scaleout.runtime.actors import check_capacity, check_resources
from scaleout.strategies.role import Role
from scaleout.strategies.worker import Worker
from scaleout.train.job import Job

Where = Callable[[], str]  # where the run stopped, for messages
T = TypeVar("T")
Method = Callable[..., T]  # a `Worker` method, called with the worker first: Worker.evaluate


class WorkerActor(GroupMember):
    """A Ray actor that holds one `Worker` (built by `start`, after the group is formed)."""

    def __init__(
        self, rank: int, world: int, job: Job, role: Role, position: dict[str, int] | None = None
    ) -> None:
        torch.set_num_threads(job.run.num_threads or 1)
        self.job, self.role, self.position = job, role.named(rank, world), position
        self.worker: Worker | None = None

    def start(self) -> int:
        self.worker = Worker(self.job, self.role, self.position)
        self.worker.start()
        return os.getpid()

    def call(self, method: Method[T], *args: Any) -> T:  # noqa: ANN401
        assert self.worker is not None, "start() first"
        return method(self.worker, *args)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class LocalWorkers:
    """One worker in this process; torch's thread count is `run.num_threads` while it lives."""

    size = 1

    def __init__(self, job: Job, role: Role) -> None:
        self.threads_before = torch.get_num_threads()
        if job.run.num_threads:
            torch.set_num_threads(job.run.num_threads)
        try:
            self.worker = Worker(job, role)
            self.worker.start()
        except BaseException:
            torch.set_num_threads(self.threads_before)
            raise

    def call(self, method: Method[T], *args: Any, ranks: int | None = None) -> list[T]:  # noqa: ANN401
        return [method(self.worker, *args)]

    def close(self, timeout_s: float = 10.0) -> None:
        torch.set_num_threads(self.threads_before)


class ActorWorkers:
    """`world` worker actors in one process group (rank r = actors[r])."""

    def __init__(
        self,
        job: Job,
        role: Role,
        world: int,
        label: str,
        where: Where,
        backend: str = "auto",
        timeout_s: float = 300.0,
        num_cpus: float | None = None,
        actor_class: type[WorkerActor] = WorkerActor,
    ) -> None:
        self.label, self.where = label, where
        device = resolve_device(job.run.device)
        num_gpus = 1.0 if device.type == "cuda" else 0.0
        check_resources(num_gpus)  # Ray would wait for the placement group for minutes
        check_capacity(world, f"{world} x {label}")
        self.group = ProcessGroup.create(
            actor_class,
            world,
            args=(job, role),
            num_cpus=num_cpus if num_cpus is not None else cpu_share(world),
            num_gpus=num_gpus,
            backend=backend,
            device=str(device),
            timeout_s=timeout_s,
        )
        self.size = world
        try:
            self.get([a.start.remote() for a in self.actors], "starting")
        except BaseException:
            self.close(timeout_s=0.0)
            raise

    @property
    def actors(self) -> list[Any]:
        return self.group.actors

    def submit(self, method: Method[Any], *args: Any, ranks: int | None = None) -> list[Any]:  # noqa: ANN401
        """Start `method` on the first `ranks` workers (all by default); return the futures
        in rank order."""
        import ray

        shared = [ray.put(a) if isinstance(a, dict) else a for a in args]
        return [actor.call.remote(method, *shared) for actor in self.actors[:ranks]]

    def get(self, futures: list[Any], doing: str) -> list[Any]:
        return self.group.get(futures, doing, self.label, self.where)

    def call(self, method: Method[T], *args: Any, ranks: int | None = None) -> list[T]:  # noqa: ANN401
        """`method` on the first `ranks` workers (all by default), in rank order."""
        futures = self.submit(method, *args, ranks=ranks)
        return self.get(futures, doing(method))

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave the process group and end the actors (0: at once, when a member died and
        the others may hang in a collective)."""
        self.group.close(timeout_s)


def spawn_worker(
    job: Job,
    role: Role,
    position: dict[str, int] | None = None,
    num_cpus: float = 1.0,
    resource: str | None = None,
) -> Any:  # noqa: ANN401 - a Ray actor handle
    """One worker actor outside any process group (a Downpour replica of one worker); call
    `start` on it before anything else."""
    return spawn(WorkerActor, 0, 1, job, role, position, num_cpus=num_cpus, resource=resource)


def doing(method: Method[Any]) -> str:
    """What a worker is doing while it runs `method`, for messages."""
    return DOING.get(method.__name__, method.__name__)


DOING = {
    "train": "training",
    "evaluate": "evaluating",
    "state": "checkpointing",
    "rng_state": "checkpointing",
    "restore": "resuming",
    "average_now": "averaging",
}

__all__ = ["ActorWorkers", "LocalWorkers", "WorkerActor", "kill", "spawn_worker"]
