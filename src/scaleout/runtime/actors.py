"""Starting Ray actors: the one place that sets their CPU share, placement and restarts.

Every role of a run (parameter-server shards, replicas, workers of a process group,
Sandblaster's vector shards) is started through `spawn`, so the options that decide where
and how an actor runs are set the same way everywhere.
"""

from __future__ import annotations

from typing import Any


def cpu_share(count: int, limit: float = 1.0) -> float:
    """CPUs per actor so that `count` actors fit the cluster at once (at most `limit`):
    on a 2-core machine, 4 replicas get half a CPU each instead of waiting for one another."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 1.0)
    return min(limit, cpus / max(count, 1))


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
) -> Any:  # noqa: ANN401 - a Ray actor handle
    """Start `actor_class(*args)` as a Ray actor.

    `resource`: a custom resource the node must offer (pins shards or replicas to nodes
    started with `ray start --resources '{"ps": 100}'`); `max_restarts`: how often Ray
    restarts the process when it dies (its constructor runs again); `placement`: (placement
    group, bundle index) for workers that must sit together; otherwise actors are spread
    over the nodes (`spread`).
    """
    import ray

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
    elif spread:
        options["scheduling_strategy"] = "SPREAD"
    return ray.remote(actor_class).options(**options).remote(*args)


def kill(actors: list[Any]) -> None:
    """End actors for good (no restart); on a shared cluster nothing else would."""
    import ray

    for actor in actors:
        ray.kill(actor, no_restart=True)
