"""A worker on the parameter server: its phase's parameters live on Downpour's shards.

The strategy asks replica 0 for a phase's starting values (`begin_phase`), starts the
shards from them, and attaches every replica's workers (`attach`): from then on a
`ReplicaClient` fetches every `n_fetch` steps and pushes the accumulated gradient every
`n_push` steps, and the worker has no optimizer of its own (DiLoCo: it steps its own,
built at each attach with the state it is given, and pushes the change of its parameters
instead). On a model-parallel grid or a pipeline, each worker keeps its own part on
shards of its own; a grid's replicated parameters (alpha) are kept by rank 0 and broadcast
after each fetch, their gradients summed over the grid before a push; a pipeline's stages
clip their pushes to the whole replica's gradient norm.
At a phase's end every replica pushes what is left (`flush_pushes`), then adopts the final
values (`adopt_final`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaleout.checkpoint import OptimizerState, load_optimizer_state, optimizer_state
from scaleout.nn.optim import build_optimizer
from scaleout.parallel import parts
from scaleout.train.state import restored
from scaleout.train.step import clip_gradients

if TYPE_CHECKING:
    from scaleout.ps import ParameterServer, ReplicaClient
    from scaleout.strategies.role import Role
    from scaleout.train.job import Job
    from scaleout.train.objective import Objective


class OnShards:
    """The parameter-server side of a `Worker` (a mixin: it reads the worker's model, groups,
    phase and data position)."""

    job: Job
    role: Role
    cfg: Any
    model: nn.Module
    objective: Objective
    optimizer: torch.optim.Optimizer | None
    client: ReplicaClient | None
    groups: list[dict[str, Any]]
    partitioned: bool
    pipeline: dist.ProcessGroup | None  # a pipeline's stages: they clip one norm together
    layerwise: bool
    phase: int
    step: int
    epoch: int
    batch: int
    _batches: Any
    _push_window: list[float]

    if TYPE_CHECKING:  # defined by Worker and its other part

        def _select_phase(self, phase: int) -> None: ...
        def _peek_batch(self) -> tuple[Tensor, ...]: ...
        def _diverged(self, loss: float) -> None: ...

    @contextmanager
    def _shard_values(self) -> Iterator[None]:
        """Under Downpour: the shards' current parameters for the block, this replica's own
        afterwards (its training goes on from where it was)."""
        if self.client is None:
            yield
            return
        with restored(p for group in self.groups for p in group["params"]):
            self.client.fetch(update_versions=False)
            yield

    def _replicated(self, param: nn.Parameter) -> bool:
        return parts.is_replicated(self.model, param)

    def _group_params(self) -> list[list[tuple[str, nn.Parameter]]]:
        """This worker's parameters of the phase, one list per parameter group; on a grid,
        replicated parameters (alpha) are kept on shards by rank 0 only."""
        served = []
        for g, group in enumerate(self.groups):
            params = [
                (f"group{g}.{i}", p)
                for i, p in enumerate(group["params"])
                if not (self.partitioned and self.role.rank > 0 and self._replicated(p))
            ]
            served.append(params)
        return served

    def begin_phase(self, phase: int, fresh: bool = True) -> list[tuple[Tensor, float] | None]:
        """Make `phase` current (from its first minibatch when `fresh`; a layer-wise phase
        then fits its start, e.g. alpha, on that minibatch); return what its shards start
        from: per parameter group, this worker's values (P_g,) and the group's learning
        rate, or None where rank 0 of the grid keeps the group."""
        if fresh:
            self.epoch, self.batch, self._batches = 0, 0, None
        self._select_phase(phase)
        if fresh and self.layerwise:
            self.objective.begin_phase(self.model, self._peek_batch(), phase)
        initial: list[tuple[Tensor, float] | None] = []
        for group, params in zip(self.groups, self._group_params(), strict=True):
            if not params:
                initial.append(None)
                continue
            values = torch.cat([p.detach().reshape(-1).cpu() for _, p in params])
            initial.append((values, float(group.get("lr", self.cfg.lr))))
        return initial

    def attach(
        self,
        phase: int,
        servers: list[ParameterServer | None],
        n_fetch: int,
        n_push: int,
        threads: bool | Literal["auto"] = False,
        fresh: bool = True,
        mode: Literal["gradients", "diloco"] = "gradients",
        bounded: bool = False,
        outer_scale: float = 1.0,
        inner: OptimizerState | None = None,
    ) -> None:
        """Train phase `phase` through `servers` (one per parameter group, None where
        another worker of the grid keeps it). `mode` "diloco": this replica steps
        `train.optimizer` itself, from the state `inner` (a checkpoint's or a live
        replica's, see `inner_state`; fresh if None), and pushes pseudo-gradients
        (`ReplicaClient`); `bounded`: the shards bound staleness."""
        if self.phase != phase or fresh:
            if fresh:
                self.epoch, self.batch, self._batches = 0, 0, None
            self._select_phase(phase)
        self.optimizer = None
        served = [
            (params, server)
            for params, server in zip(self._group_params(), servers, strict=True)
            if params and server is not None
        ]
        after_pull = after_push = None
        pushed = [p for params, _ in served for _, p in params]
        clip = self.cfg.grad_clip_norm
        model = self.model
        if self.partitioned:
            replicated = [p for g in self.groups for p in g["params"] if self._replicated(p)]
            group_ids = {id(p) for params, _ in served for _, p in params}
            others = [p for g in self.groups for p in g["params"] if id(p) not in group_ids]

            def after_pull() -> None:
                parts.broadcast_replicated(model, replicated)

            def after_push() -> None:
                for p in others:
                    if p.grad is not None:
                        p.grad.zero_()

        def before_push() -> dict[str, Any] | None:
            """The grid sums its replicated parameters' gradients; the push is clipped to
            `train.grad_clip_norm` (its norm before, in the push's record)."""
            if self.partitioned:
                parts.sync_grads(model)
            if clip is None:
                return None
            return {"grad_norm": float(clip_gradients(pushed, clip, self.pipeline))}

        from scaleout.ps import ReplicaClient  # imports Ray: only Downpour's workers need it

        diloco = mode == "diloco"
        needed = self.partitioned or (clip is not None and not diloco)  # DiLoCo clips inside
        self.client = ReplicaClient(
            served,
            n_fetch,
            n_push,
            threads,
            after_pull,
            before_push if needed else None,
            after_push,
            bounded=bounded,
            owner=f"replica{self.role.replica}",
            mode=mode,
            outer_scale=outer_scale,
        )
        if diloco:  # the inner optimizer, over the parameters' flat views
            self.optimizer = build_optimizer(self.groups, self.job.optimizer_options())
            if inner is not None:  # a fresh Adagrad or Adam would take a first step far
                load_optimizer_state(self.optimizer, *inner)  # larger than a trained one's

    def inner_state(self) -> OptimizerState | None:
        """DiLoCo: this replica's own optimizer state, for a replica that (re)starts
        (`attach(inner=...)`); None in gradient mode, where the shards hold it."""
        if self.client is None or self.client.mode != "diloco" or self.optimizer is None:
            return None
        return optimizer_state(self.optimizer)

    def _after_backward(self, loss: Tensor, compute_s: float) -> None:
        value = loss.item()
        if not math.isfinite(value):  # never push a diverged gradient to the shards
            self._diverged(value)
        window = self._push_window
        window[0] += value
        window[1] += 1
        window[2] += compute_s
        client = self.client
        assert client is not None
        done = client.after_step if client.mode == "diloco" else client.after_backward
        if client.push_due:
            done(**self._push_info())
        else:
            done()

    def _push_info(self) -> dict[str, Any]:
        """What a push record says of this worker: the mean loss and compute seconds of the
        steps since the previous push."""
        loss_sum, steps, compute_s = self._push_window
        self._push_window = [0.0, 0, 0.0]
        info: dict[str, Any] = {
            "replica": self.role.replica,
            "replica_step": self.step + 1,
            "loss": loss_sum / steps if steps else None,
            "compute_s": round(compute_s, 6),
        }
        if self.partitioned or self.pipeline is not None:
            info["worker"] = self.role.rank
        return info

    def take_records(self) -> list[dict[str, Any]]:
        """The push records since the last call; with bounded staleness, the window this
        chunk left open is pushed first (the replica may idle until its next chunk)."""
        if self.client is None:
            return []
        if self.client.bounded:
            self.client.release(**self._push_info())
        return self.client.take_records()

    def flush_pushes(self) -> list[dict[str, Any]]:
        """Push what is left and wait until the shards applied it; the last push records."""
        if self.client is None:
            return []
        return self.client.flush(pull=False, **self._push_info())

    def adopt_final(self) -> dict[str, Any]:
        """Adopt the shards' final values and leave them (after every replica flushed);
        return the client's statistics."""
        if self.client is None:
            return {}
        self.client.fetch()
        stats = {**self.client.stats, "staleness": list(self.client.staleness)}
        self.client.close()
        self.client = None  # DiLoCo's optimizer stays, for the run's last checkpoint
        return stats
