"""A model-parallel replica as one Downpour replica: each grid worker exchanges its own filters
with its own parameter-server shards (DistBelief section 4.1, figure 2: "each machine talks
only to the subset of parameter-server shards that hold the parameters of its partition").

For the stack in training, worker w of the grid owns a slice of the filters; the driver
starts a `ParameterServer` per worker index w (`downpour.num_shards` shards each), holding
that slice, and one more shard for the stack's alpha (replicated in the grid, stepped with
its own learning rate), which rank 0 talks to. Worker w of
every replica pulls from and pushes to server w only. Schedule per worker, every step:

    every n_fetch steps: pull the slice (and alpha, rank 0) from its shards; rank 0 then
                         broadcasts alpha to the grid (one scalar)
    forward, backward (the grid's exchanges), alpha's gradient summed over the grid
    gradients accumulate; every n_push steps they are pushed to the shards, which apply
    them with the configured optimizer; the next push first waits for this one

All workers of a grid take the same steps, so they pull, broadcast and push at the same
steps. Stacks below the one in training are frozen and identical in every replica: at a
stack's end every worker flushes its gradients and pulls the final slice (`flush`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["ShardLink"]


class ShardLink:
    """One grid worker's connection to the shards that hold its parameters: `lanes` pairs a
    list of parameters with the `ParameterServer` that holds them flattened (the current
    stack's filter slice; on the grid's rank 0 also alpha, on a shard of its own that steps
    it with `lr * alpha_lr_scale`, as the single-process optimizer does)."""

    def __init__(
        self,
        lanes: list[tuple[list[Tensor], Any]],
        n_fetch: int,
        n_push: int,
        after_pull: Callable[[], None] | None = None,
    ) -> None:
        self.lanes = lanes
        self.n_fetch, self.n_push = n_fetch, n_push
        self.after_pull = after_pull
        for params, server in lanes:
            assert sum(p.numel() for p in params) == server.numel, "the shards hold another slice"
        self.values = [torch.zeros(server.numel) for _, server in lanes]  # (P_lane,) CPU
        self.grads = [torch.zeros(server.numel) for _, server in lanes]  # since the last push
        self.versions = [[0] * len(server.shards) for _, server in lanes]
        self.pending: list[Any] = []  # futures of the last push
        self.steps = 0
        self.stats = {"pushes": 0, "pulls": 0, "bytes_sent": 0, "bytes_received": 0}
        self.staleness: list[int] = []

    @torch.no_grad()
    def pull(self) -> None:
        """Adopt the shards' current values."""
        for i, (params, server) in enumerate(self.lanes):
            self.versions[i], received = server.pull_into(self.values[i])
            offset = 0
            for p in params:
                p.copy_(self.values[i][offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.stats["bytes_received"] += received
        self.stats["pulls"] += 1
        if self.after_pull is not None:
            self.after_pull()

    def before_step(self) -> None:
        if self.steps % self.n_fetch == 0:
            self.pull()

    @torch.no_grad()
    def after_backward(self) -> None:
        """Accumulate this step's gradients; push every `n_push` steps."""
        for (params, _), grads in zip(self.lanes, self.grads, strict=True):
            offset = 0
            for p in params:
                if p.grad is not None:
                    grads[offset : offset + p.numel()] += p.grad.detach().view(-1).cpu()
                offset += p.numel()
        self.steps += 1
        if self.steps % self.n_push == 0:
            self.push()

    def push(self) -> None:
        self._collect()
        for i, (_, server) in enumerate(self.lanes):
            futures, sent = server.push(self.grads[i].clone(), self.versions[i])
            self.pending += futures
            self.grads[i].zero_()
            self.stats["bytes_sent"] += sent
        self.stats["pushes"] += 1

    def _collect(self) -> None:
        import ray

        for _version, staleness in ray.get(self.pending):
            self.staleness.append(staleness)
        self.pending = []

    def flush(self) -> None:
        """Push what is left, wait for every push to be applied, pull the final values."""
        if self.steps % self.n_push:
            self.push()
        self._collect()
        self.pull()
