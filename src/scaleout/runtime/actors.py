"""Starting Ray actors: the one place that sets their CPU share, placement and restarts.

Every role of a run (parameter-server shards, replicas, workers of a process group,
Sandblaster's vector shards) is started through `spawn`, so the options that decide where
and how an actor runs are set the same way everywhere.
"""

from __future__ import annotations

from typing import Any

# A new actor imports torch and builds its model and data before it answers: on a busy
# machine that takes tens of seconds, which a watchdog for progress must not count.
START_TIMEOUT_S = 120.0
# An actor that failed is started again after 0.5, 1, 2, 4, 8, 8, ... s: a node that is
# going away, or a port still held, gets time; a run with one restart loses half a second.
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 8.0


def restart_backoff_s(attempt: int) -> float:
    """The wait before restart number `attempt` (1, 2, ...) of one actor."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(attempt - 1, 0))


def cpu_share(count: int, limit: float = 1.0) -> float:
    """CPUs per actor so that `count` actors fit the cluster at once (at most `limit`):
    on a 2-core machine, 4 replicas get half a CPU each instead of waiting for one another."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 1.0)
    return min(limit, cpus / max(count, 1))


def check_resources(num_gpus: float = 0.0, resource: str | None = None) -> None:
    """Fail at once, naming the resource, when no node of the cluster offers what an actor
    asks for: Ray would keep the actor pending forever, waiting for such a node."""
    import ray

    from scaleout.errors import UserError

    offered = ray.cluster_resources()
    if resource and offered.get(resource, 0.0) <= 0:
        custom = sorted(k for k in offered if k not in _BUILTIN and not k.startswith("node:"))
        raise UserError(
            f"no node of the Ray cluster offers the resource {resource!r} (custom resources "
            f"offered: {', '.join(custom) or 'none'}); start such a node with `ray start "
            f"--resources '{{\"{resource}\": 100}}'`, or fix or unset the setting that names "
            "it (downpour.shard_resource / downpour.replica_resource)"
        )
    if num_gpus and offered.get("GPU", 0.0) < num_gpus:
        raise UserError(
            f"an actor asks for {num_gpus:g} GPU, the Ray cluster has "
            f'{offered.get("GPU", 0.0):g}; set run.device = "cpu" or join a cluster with GPUs'
        )


_BUILTIN = ("CPU", "GPU", "memory", "object_store_memory")

# Memory of one actor process before it holds any data: Python, torch and Ray's worker
# (between what such a process holds alone and what it keeps resident with shared pages).
PROCESS_BYTES = 200 * 2**20


def fits(num_processes: int) -> bool:
    """Whether the cluster's memory holds `num_processes` more actor processes."""
    import ray

    memory = ray.cluster_resources().get("memory", 0.0)
    return not memory or num_processes * PROCESS_BYTES <= memory


def check_capacity(num_processes: int, what: str) -> None:
    """Fail at once when a run would start more processes than the cluster's memory can
    hold (`what` names the settings that decide the count): thousands of shard or replica
    processes would exhaust the machines long before training starts."""
    import ray

    from scaleout.errors import UserError

    if not fits(num_processes):
        memory = ray.cluster_resources()["memory"]
        most = int(memory // PROCESS_BYTES)
        raise UserError(
            f"this run would start {num_processes} processes ({what}); the Ray cluster's "
            f"memory ({memory / 2**30:.1f} GiB) holds about {most} (~{PROCESS_BYTES // 2**20} "
            "MiB each before any data): use fewer, or join a larger cluster (run.address)"
        )


def spawn(
    actor_class: type,
    *args: Any,  # noqa: ANN401
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    resource: str | None = None,
    max_restarts: int = 0,
    max_concurrency: int | None = None,
    placement: tuple[Any, int] | None = None,
    spread: bool = True,
    node: str | None = None,
) -> Any:  # noqa: ANN401 - a Ray actor handle
    """Start `actor_class(*args)` as a Ray actor.

    `resource`: a custom resource the node must offer (pins shards or replicas to nodes
    started with `ray start --resources '{"ps": 100}'`); `max_restarts`: how often Ray
    restarts the process when it dies (its constructor runs again); `placement`: (placement
    group, bundle index) for workers that must sit together; otherwise actors are spread
    over the nodes (`spread`); `node`: on that node and no other (a node ID; the actor
    fails with `ActorUnschedulableError` when the node is gone: Ray's soft affinity was seen
    to place an actor elsewhere with its node alive, which put a keeper on a shard's node).
    """
    import ray

    check_resources(num_gpus, resource)
    options: dict[str, Any] = dict(num_cpus=num_cpus, max_restarts=max_restarts)
    if num_gpus:
        options["num_gpus"] = num_gpus
    if resource:
        options["resources"] = {resource: 0.001}
    if max_concurrency is not None:
        options["max_concurrency"] = max_concurrency
    if placement is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, index = placement
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index
        )
    elif node is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    elif spread:
        options["scheduling_strategy"] = "SPREAD"
    return ray.remote(actor_class).options(**options).remote(*args)


def kill(actors: list[Any]) -> None:
    """End actors for good (no restart); on a shared cluster nothing else would."""
    import ray

    for actor in actors:
        ray.kill(actor, no_restart=True)
