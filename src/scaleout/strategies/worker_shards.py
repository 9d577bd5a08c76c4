"""A worker on the parameter server: which of its parameters live on Downpour's shards, and
the `ShardUpdate` that trains through them.

The strategy asks replica 0 for a phase's starting values (`Worker.begin_phase`, from
`start_values`), starts the shards from them, and attaches every replica's workers
(`Worker.attach`, with `shard_update`): from then on a `ReplicaClient` fetches every
`n_fetch` steps and pushes the accumulated gradient every `n_push` steps, and the worker
has no optimizer of its own (DiLoCo: it steps its own, built at each attach with the state
it is given, and pushes the change of its parameters instead). On a model-parallel grid or
a pipeline, each worker keeps its own part on shards of its own; a grid's replicated
parameters (alpha) are kept by rank 0 and broadcast after each fetch, their gradients
summed over the grid before a push; a pipeline's stages clip their pushes to the whole
replica's gradient norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaleout.checkpoint import OptimizerState, load_optimizer_state
from scaleout.nn.optim import build_optimizer
from scaleout.parallel import parts
from scaleout.strategies.updaters import LocalUpdate, ShardUpdate
from scaleout.train.step import clip_gradients

if TYPE_CHECKING:
    from scaleout.ps import ParameterServer
    from scaleout.train.job import Job
    from scaleout.train.step import Stepper

Groups = list[dict[str, Any]]  # the optimizer's parameter groups of the phase
Served = list[list[tuple[str, nn.Parameter]]]  # per group: the parameters kept on shards


def served_params(model: nn.Module, groups: Groups, partitioned: bool, rank: int) -> Served:
    """A worker's parameters of the phase, one list per parameter group; on a grid,
    replicated parameters (alpha) are kept on shards by rank 0 only."""
    served = []
    for g, group in enumerate(groups):
        params = [
            (f"group{g}.{i}", p)
            for i, p in enumerate(group["params"])
            if not (partitioned and rank > 0 and parts.is_replicated(model, p))
        ]
        served.append(params)
    return served


def start_values(groups: Groups, served: Served, lr: float) -> list[tuple[Tensor, float] | None]:
    """What the shards of each parameter group start from: this worker's values (P_g,) and
    the group's learning rate, or None where rank 0 of the grid keeps the group."""
    initial: list[tuple[Tensor, float] | None] = []
    for group, params in zip(groups, served, strict=True):
        if not params:
            initial.append(None)
            continue
        values = torch.cat([p.detach().reshape(-1).cpu() for _, p in params])
        initial.append((values, float(group.get("lr", lr))))
    return initial


def shard_update(
    job: Job,
    model: nn.Module,
    groups: Groups,
    served: Served,
    servers: list[ParameterServer | None],
    stepper: Stepper,
    *,
    partitioned: bool,
    pipeline: dist.ProcessGroup | None,
    sync_grads: Callable[[], None],
    diverged: Callable[[float], None],
    replica: int,
    worker: int | None,
    n_fetch: int,
    n_push: int,
    threads: bool | Literal["auto"] = False,
    mode: Literal["gradients", "diloco"] = "gradients",
    bounded: bool = False,
    outer_scale: float = 1.0,
    inner: OptimizerState | None = None,
) -> ShardUpdate:
    """The update through `servers` (one per parameter group, None where another worker of
    the grid keeps it). `mode` "diloco": the replica steps `train.optimizer` itself, from
    the state `inner` (a checkpoint's or a live replica's; fresh if None), and pushes
    pseudo-gradients; `bounded`: the shards bound staleness."""
    pairs = [
        (params, server)
        for params, server in zip(served, servers, strict=True)
        if params and server is not None
    ]
    after_pull = after_push = None
    pushed = [p for params, _ in pairs for _, p in params]
    clip = job.train.grad_clip_norm
    if partitioned:
        replicated = [p for g in groups for p in g["params"] if parts.is_replicated(model, p)]
        kept = {id(p) for p in pushed}
        others = [p for g in groups for p in g["params"] if id(p) not in kept]

        def after_pull() -> None:
            parts.broadcast_replicated(model, replicated)

        def after_push() -> None:
            for p in others:
                if p.grad is not None:
                    p.grad.zero_()

    def before_push() -> dict[str, Any] | None:
        """The grid sums its replicated parameters' gradients; the push is clipped to
        `train.grad_clip_norm` (its norm before, in the push's record)."""
        if partitioned:
            parts.sync_grads(model)
        if clip is None:
            return None
        return {"grad_norm": float(clip_gradients(pushed, clip, pipeline))}

    from scaleout.ps import ReplicaClient  # imports Ray: only Downpour's workers need it

    diloco = mode == "diloco"
    needed = partitioned or (clip is not None and not diloco)  # DiLoCo clips inside
    client = ReplicaClient(
        pairs,
        n_fetch,
        n_push,
        threads,
        after_pull,
        before_push if needed else None,
        after_push,
        bounded=bounded,
        owner=f"replica{replica}",
        mode=mode,
        outer_scale=outer_scale,
    )
    local = None
    if diloco:  # the inner optimizer, over the parameters' flat views
        optimizer = build_optimizer(groups, job.optimizer_options())
        if inner is not None:  # a fresh Adagrad or Adam would take a first step far
            load_optimizer_state(optimizer, *inner)  # larger than a trained one's
        local = LocalUpdate(optimizer, stepper, model, sync_grads)
    params = [p for g in groups for p in g["params"]]
    return ShardUpdate(client, params, local, diverged, replica, worker)
