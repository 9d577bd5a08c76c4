"""A Downpour replica: one worker actor, or a model-parallel grid or pipeline of them.

Both answer the same `Worker` methods; the strategy starts calls asynchronously (`submit`)
and waits on any replica's. A replica of one worker that dies (or raises) can be restarted
where it stopped; a grid or pipeline replica cannot go on without one of its workers (the
others wait for it in a collective), so its failure stops the run with `WorkerDied`.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from scaleout.comm import WorkerDied
from scaleout.nn.schedule import Schedule
from scaleout.progress import console
from scaleout.runtime import describe_failure
from scaleout.strategies.downpour.phase_shards import PhaseShards
from scaleout.strategies.group import ActorWorkers, Method, T, Where, spawn_worker
from scaleout.strategies.group import doing as describe
from scaleout.strategies.layout import ModelParallelSection
from scaleout.strategies.role import Role
from scaleout.train.job import Job


class Replica:
    def __init__(
        self,
        job: Job,
        replica_id: int,
        num_replicas: int,
        grid: ModelParallelSection | None,
        position: dict[str, int] | None,
        num_cpus: float,
        resource: str | None,
        where: Where,
        schedule: Schedule | None = None,
    ) -> None:
        self.id = replica_id
        role = Role(
            name=f"replica {replica_id}",
            replica=replica_id,
            num_replicas=num_replicas,
            schedule=schedule,  # DiLoCo's inner steps: the run's learning rate
        )
        self.actor: Any = None
        self.group: ActorWorkers | None = None
        if grid is None:
            self.actor = spawn_worker(job, role, position, num_cpus, resource)
            self.started = self.actor.start.remote()
            self.size = 1
        else:
            layout: dict[str, Any] = (
                dict(
                    stages=grid.stages,
                    microbatches=grid.num_microbatches,
                    pipeline_schedule=grid.schedule,
                )
                if grid.stages > 1
                else dict(grid=(grid.grid[0], grid.grid[1]), transport=grid.transport)
            )
            role = Role(name=role.name, replica=replica_id, num_replicas=num_replicas, **layout)
            self.group = ActorWorkers(
                job,
                role,
                grid.num_workers,
                f"replica {replica_id}'s model-parallel worker",
                where,
                grid.backend,
                grid.timeout_s,
                num_cpus=num_cpus,
            )
            self.started = None
            self.size = grid.num_workers

    @property
    def restartable(self) -> bool:
        return self.group is None

    def wait_started(self, timeout_s: float | None = None) -> None:
        """Wait until the replica has built its model and data. A one-worker replica that
        fails raises Ray's error (the strategy may start it again; `GetTimeoutError` when
        it did not start in `timeout_s`, e.g. no node took it); a grid replica `WorkerDied`
        with its own message (a user's error as itself)."""
        if self.started is not None:
            try:
                ray.get(self.started, timeout=timeout_s if self.restartable else None)
            except (RayActorError, RayTaskError) as error:
                if self.restartable:
                    raise
                raise WorkerDied(
                    f"replica {self.id} failed while starting: {describe_failure(error)[:300]}"
                ) from None
            self.started = None

    def submit(self, method: Method[Any], *args: Any) -> list[Any]:  # noqa: ANN401
        """Start `method` on every worker of the replica; the futures in rank order."""
        if self.group is not None:
            return self.group.submit(method, *args)
        return [self.actor.call.remote(method, *args)]

    def submit_each(self, method: Method[Any], args: list[tuple[Any, ...]]) -> list[Any]:
        """Start `method` with `args[rank]` on each worker."""
        actors = self.group.actors if self.group is not None else [self.actor]
        return [
            a.call.remote(method, *rank_args) for a, rank_args in zip(actors, args, strict=True)
        ]

    def get(self, futures: list[Any], doing: str) -> list[Any]:
        """The answers; a dead or failing one-worker replica raises Ray's error, a grid
        replica `WorkerDied` (or the user's own error)."""
        if self.group is not None:
            return self.group.get(futures, doing)
        return ray.get(futures)

    def call(self, method: Method[T], *args: Any, doing: str = "") -> list[T]:  # noqa: ANN401
        return self.get(self.submit(method, *args), doing or describe(method))

    def node(self) -> str:
        actor = self.actor if self.group is None else self.group.actors[0]
        return ray.get(actor.node.remote())

    def pid(self) -> int:
        actor = self.actor if self.group is None else self.group.actors[0]
        return ray.get(actor.pid.remote())

    def kill(self) -> None:
        if self.group is not None:
            self.group.close(timeout_s=0.0)
        else:
            ray.kill(self.actor, no_restart=True)


def placement(replicas: list[Replica], shards: PhaseShards) -> dict[str, list[str]]:
    """Where the replicas and the shards run (node addresses); printed when they span
    several nodes, and kept in checkpoints."""
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    nodes = [addresses.get(r.node(), "?") for r in replicas]
    shards = shards.nodes()
    shard_nodes = [addresses.get(primary, "?") for primary, _ in shards]
    backup_nodes = [addresses.get(backup, "?") for _, backup in shards if backup is not None]
    if len(set(nodes + shard_nodes + backup_nodes)) > 1:
        backups = f"; backups on {backup_nodes}" if backup_nodes else ""
        console.print(f"shards on {shard_nodes}{backups}; replicas on {nodes}")
    placed = {"shards": shard_nodes, "replicas": nodes}
    return {**placed, "backups": backup_nodes} if backup_nodes else placed
