"""A Sandblaster replica: computes gradient sums over the portions the coordinator hands it.

Per portion: fetch x from the shards if the coordinator has moved it since (once per
objective evaluation), compute the summed loss and gradient over the portion's examples
(eval mode: dropout off, BatchNorm on its running statistics: a batch method needs a
deterministic objective), and keep the gradient apart
until the coordinator's verdict arrives with the next call — accepted (first result for
that portion) or dropped (a backup task that lost). Accepted gradients are summed and
pushed to the shards every `push_every` portions and at the end of the batch (`flush`),
under this replica incarnation's key, so the shards can drop everything a replica sent if
it dies mid-batch.

The actor runs two calls at once: `flush` must not wait behind a slow `compute` of a
backup portion that no longer matters.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
import torch
from torch.utils.data import default_collate

from scaleout.ps.layout import FlatParameters
from scaleout.strategies.sandblaster import SandblasterSection
from scaleout.train.job import Job
from scaleout.train.outputs import correct_counts


class SandblasterReplica:
    def __init__(
        self,
        replica_id: int,
        incarnation: int,
        job: Job,
        shards: list[Any],
        ranges: list[tuple[int, int]],
    ) -> None:
        self.opts = job.section("sandblaster", SandblasterSection)
        torch.set_num_threads(job.run.num_threads or 1)
        self.replica_id = replica_id
        self.key = f"{replica_id}.{incarnation}"
        self.dtype = getattr(torch, self.opts.dtype)
        torch.manual_seed(job.run.seed)
        train, _ = job.build_data()
        self.data = train
        self.loss = job.loss_fn()
        # eval mode: dropout off, BatchNorm uses its (fixed) running statistics, so the
        # objective is a deterministic function of the parameters, as L-BFGS needs
        self.model = job.build_model(train).to(self.dtype).eval()
        self.flat = FlatParameters(self.model)
        self.shards, self.ranges = shards, ranges
        self.x_version = -1
        self.batch_id = -1
        self.accumulated = torch.zeros_like(self.flat.grads)
        self.num_accumulated = 0
        self.pending: dict[tuple[int, int], torch.Tensor] = {}
        self.pushes: list[Any] = []
        self.compute_lock = threading.Lock()  # one portion at a time
        self.sum_lock = threading.Lock()  # accumulated, pending, pushes
        # Calls may start out of order (two threads): verdicts are applied in the order the
        # coordinator numbered the calls, or a flush could miss a portion it accepted.
        self.in_order = threading.Condition(self.sum_lock)
        self.settled = 0

    def ready(self) -> str:
        return self.key

    def pid(self) -> int:
        return os.getpid()

    def compute(
        self,
        seq: int,
        batch_id: int,
        portion: int,
        start: int,
        stop: int,
        x_version: int,
        verdicts: dict[int, bool],
    ) -> tuple[int, int, float, int, int]:
        """(batch, portion, loss sum, correct, examples) over examples [start, stop)."""
        with self.sum_lock:
            self._settle(seq, batch_id, verdicts)
        with self.compute_lock:
            started = time.perf_counter()
            if x_version != self.x_version:
                self._fetch_x()
                self.x_version = x_version
            x, y = self._portion(start, stop)
            output = self.model(x.to(self.dtype) if x.is_floating_point() else x)
            loss = self.loss(output, y) * (stop - start)  # the portion's sum
            loss.backward()  # into self.flat.grads
            loss = loss.detach()
            counts = correct_counts(output, y)
            correct = int(counts[0]) if counts is not None else 0
            with self.sum_lock:
                self.pending[(batch_id, portion)] = self.flat.grads.clone()
            self.flat.zero_grads()
            if self.opts.straggler_replica == self.replica_id:  # benchmarks only
                time.sleep((self.opts.straggler_factor - 1) * (time.perf_counter() - started))
        return batch_id, portion, loss.item(), correct, stop - start

    def _portion(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples [start, stop) as one batch (a batched fetch when the data has one)."""
        indices = list(range(start, stop))
        if hasattr(self.data, "__getitems__") and hasattr(self.data, "collate"):
            x, y = self.data.__getitems__(indices)[:2]
            return x, y
        x, y = default_collate([self.data[i] for i in indices])[:2]
        return x, y

    def flush(self, seq: int, batch_id: int, verdicts: dict[int, bool]) -> int:
        """Apply the last verdicts, push what is accepted, wait until the shards have it."""
        with self.sum_lock:
            self._settle(seq, batch_id, verdicts)
            if self.num_accumulated:
                self._push()
            pushes, self.pushes = self.pushes, []
        ray.get(pushes)
        return len(pushes)

    def _settle(self, seq: int, batch_id: int, verdicts: dict[int, bool]) -> None:
        """Apply the verdicts of call `seq` (1, 2, ...) after those of every earlier call."""
        self.in_order.wait_for(lambda: self.settled == seq - 1)
        self.settled = seq
        self.in_order.notify_all()
        if batch_id != self.batch_id:  # a new batch: gradients of the old one are void
            assert self.num_accumulated == 0, "a batch ended without a flush"
            self.pending = {k: v for k, v in self.pending.items() if k[0] == batch_id}
            self.batch_id = batch_id
        for portion, accepted in verdicts.items():
            grad = self.pending.pop((batch_id, portion), None)
            if accepted and grad is not None:
                self.accumulated += grad
                self.num_accumulated += 1
        if self.num_accumulated >= self.opts.push_every:
            self._push()

    def _push(self) -> None:
        for shard, (start, stop) in zip(self.shards, self.ranges, strict=True):
            self.pushes.append(
                shard.accumulate.remote(self.key, self.accumulated[start:stop].numpy())
            )
        self.accumulated = torch.zeros_like(self.accumulated)  # the old one is in flight
        self.num_accumulated = 0

    def _fetch_x(self) -> None:
        slices = ray.get([shard.pull.remote("x") for shard in self.shards])
        for (start, stop), values in zip(self.ranges, slices, strict=True):
            self.flat.params[start:stop].copy_(torch.from_numpy(values.copy()))
