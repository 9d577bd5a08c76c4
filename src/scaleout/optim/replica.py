"""A Downpour SGD model replica: computes gradients on its own part of the data.

Schedule (DistBelief section 4.1): every `n_fetch` steps the replica pulls fresh parameters
from all shards in parallel; every step it computes a minibatch gradient, which autograd
adds into a flat gradient buffer; every `n_push` steps it pushes the accumulated gradient to
all shards in parallel and goes on computing without waiting for the shards to apply it
(the results of a push — new versions and staleness — are collected at the next push).
Between fetches the replica's parameters do not change: only the shards apply updates.

With `downpour.threads = true` fetch, compute and push run in three weakly synchronised
threads, as in the paper's appendix: the compute thread adopts whatever parameters the
fetch thread last brought and hands its accumulated gradients to the push thread through
a short queue, so communication overlaps computation.

The driver runs the replica in chunks of steps (`train_chunk`), which return the per-push
records and the replica's position in its data, so a replica that dies can be restarted
where it stopped.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import ray
import torch
import torch.nn.functional as F
from ray.exceptions import RayActorError

from scaleout.build import build_datasets, build_model_for
from scaleout.config import RunConfig
from scaleout.data import ArrayDataset, derive_seed, make_loader
from scaleout.errors import UserError
from scaleout.ps.layout import FlatParameters
from scaleout.ps.server import ParameterServer


def data_part(dataset: Any, part: int, num_parts: int) -> Any:  # noqa: ANN401
    """Every `num_parts`-th example from `part` on: disjoint parts that cover the data."""
    indices = torch.arange(part, len(dataset), num_parts)
    if isinstance(dataset, ArrayDataset):
        y = None if dataset.y is None else dataset.y[indices]
        return ArrayDataset(dataset.x[indices], y, dataset.num_classes)
    return _Part(dataset, indices)


class _Part(torch.utils.data.Dataset):
    """A view of some examples of a dataset that keeps its batched fetch and collate."""

    def __init__(self, dataset: Any, indices: torch.Tensor) -> None:  # noqa: ANN401
        self.dataset, self.indices = dataset, indices.tolist()
        self.num_classes = getattr(dataset, "num_classes", 0)
        if hasattr(dataset, "__getitems__") and hasattr(dataset, "collate"):
            self.collate = dataset.collate

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:  # noqa: ANN401
        return self.dataset[self.indices[i]]

    def __getitems__(self, indices: list[int]) -> Any:  # noqa: ANN401
        picked = [self.indices[i] for i in indices]
        if hasattr(self.dataset, "__getitems__"):
            return self.dataset.__getitems__(picked)
        return [self.dataset[i] for i in picked]


class DownpourReplica:
    def __init__(
        self,
        replica_id: int,
        num_replicas: int,
        config: dict[str, Any],
        server: ParameterServer,
        position: dict[str, int] | None = None,
    ) -> None:
        self.config = RunConfig.model_validate(config)
        self.downpour = self.config.downpour
        torch.set_num_threads(self.config.run.num_threads or 1)
        self.replica_id = replica_id
        self.seed = derive_seed(self.config.run.seed, replica_id)
        position = position or {}
        torch.manual_seed(derive_seed(self.seed, position.get("local_step", 0)))  # dropout
        train, _ = build_datasets(self.config)
        self.data = data_part(train, replica_id, num_replicas)
        self.model = build_model_for(self.config, self.data)  # on the CPU; see README
        self.flat = FlatParameters(self.model)
        self.server = server
        self.versions = [0] * len(server.ranges)
        self.epoch = position.get("epoch", 0)
        self.batch = position.get("batch", 0)
        self.local_step = position.get("local_step", 0)
        self._batches = self._loader()
        self._pending: list[tuple[list[Any], dict[str, Any]]] = []
        self._received = 0  # bytes pulled since the last push record
        self._window_loss, self._window_steps = 0.0, 0
        self._seconds = {"fetch": 0.0, "compute": 0.0, "push": 0.0}
        self._records: list[dict[str, Any]] = []
        self._records_lock = threading.Lock()  # the push thread appends, train_chunk takes
        self._threads: _Pipeline | None = _Pipeline(self) if self.downpour.threads else None

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this replica runs on (its ID)."""
        return ray.get_runtime_context().get_node_id()

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "local_step": self.local_step}

    # --- one chunk of training -----------------------------------------------------------

    def train_chunk(self, num_steps: int) -> dict[str, Any]:
        """Train `num_steps` steps; return the push records and the new position."""
        for _ in range(num_steps):
            started = time.perf_counter()
            if self._threads is None and self.local_step % self.downpour.n_fetch == 0:
                self._fetch()
            elif self._threads is not None:
                self._threads.adopt_fresh_parameters()
            computing = time.perf_counter()
            x, y = self._next_batch()
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()  # adds into self.flat.grads
            loss_value = loss.item()
            self._seconds["fetch"] += computing - started
            self._seconds["compute"] += time.perf_counter() - computing
            if loss_value != loss_value or abs(loss_value) == float("inf"):
                raise UserError(
                    f"training diverged: replica {self.replica_id} loss is {loss_value} at its "
                    f"step {self.local_step}; lower train.lr"
                )
            self._window_loss += loss_value
            self._window_steps += 1
            self.local_step += 1
            if self.local_step % self.downpour.n_push == 0:
                pushing = time.perf_counter()
                self._push()
                self._seconds["push"] += time.perf_counter() - pushing
        return {"records": self._take_records(), "steps": num_steps, "position": self.position()}

    def flush(self) -> list[dict[str, Any]]:
        """Wait for pushes in flight and return their records (end of training)."""
        if self._threads is not None:
            self._threads.stop()
        self._collect(wait=True)
        return self._take_records()

    def _take_records(self) -> list[dict[str, Any]]:
        with self._records_lock:
            records, self._records = self._records, []
        return records

    # --- communication -------------------------------------------------------------------

    def _fetch(self) -> None:
        self.versions, received = self.server.pull_into(self.flat.params)
        self._received += received

    def _push(self) -> None:
        record = {
            "t": time.time(),
            "replica": self.replica_id,
            "replica_step": self.local_step,
            "loss": self._window_loss / max(self._window_steps, 1),
            # seconds this replica spent waiting for fetches, computing, and sending pushes
            **{f"{k}_s": round(v, 6) for k, v in self._seconds.items()},
        }
        self._window_loss, self._window_steps = 0.0, 0
        self._seconds = dict.fromkeys(self._seconds, 0.0)
        if self._threads is not None:
            self._threads.push(self.flat.grads.clone(), list(self.versions), record)
            self.flat.zero_grads()
            return
        self._collect(wait=True)  # the previous push has long been applied
        futures, sent = self.server.push(self.flat.grads, self.versions)
        self.flat.zero_grads()  # the payloads were copied into the object store
        record.update(bytes_sent=sent, bytes_received=self._received)
        self._received = 0
        self._pending.append((futures, record))

    def _collect(self, wait: bool) -> None:
        """Turn finished pushes into records: staleness per shard, or lost if a shard died."""
        still = []
        for futures, record in self._pending:
            if not wait and not all(_ready(f) for f in futures):
                still.append((futures, record))
                continue
            staleness, lost = [], 0
            for future in futures:
                try:
                    _, stale = ray.get(future)
                    staleness.append(stale)
                except RayActorError:
                    lost += 1  # the shard died before applying it
            record.update(
                staleness=sum(staleness) / len(staleness) if staleness else None,
                staleness_max=max(staleness) if staleness else None,
                shards_lost=lost,
            )
            with self._records_lock:
                self._records.append(record)
        self._pending = still

    def _loader(self) -> Any:  # noqa: ANN401
        return iter(
            make_loader(
                self.data,
                self.config.train.batch_size,
                shuffle=True,
                seed=self.seed,
                epoch=self.epoch,
                start_batch=self.batch,
                drop_last=len(self.data) >= self.config.train.batch_size,
            )
        )

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            batch = next(self._batches)
        except StopIteration:
            self.epoch, self.batch = self.epoch + 1, 0
            self._batches = self._loader()
            batch = next(self._batches)
        self.batch += 1
        return batch[0], batch[1]


def _ready(future: Any) -> bool:  # noqa: ANN401
    done, _ = ray.wait([future], timeout=0)
    return bool(done)


class _Pipeline:
    """Fetch and push threads beside the compute thread (`downpour.threads = true`).

    Weak synchronisation: the compute thread adopts the newest fetched parameters when
    there are any and never runs more than `2 * n_fetch` steps on the same ones (it waits
    for the fetch thread then); the push thread is at most two pushes behind (a queue of
    two). Without these bounds a fast compute thread runs on ever staler parameters.
    """

    def __init__(self, replica: DownpourReplica) -> None:
        self.replica = replica
        self.fresh = torch.empty_like(replica.flat.params)
        self.fresh_versions: list[int] | None = None
        self.fresh_ready = threading.Event()
        self.steps_on_current = 0
        self.lock = threading.Lock()
        self.fetch_due = threading.Event()
        self.fetch_due.set()
        self.outbox: queue.Queue[tuple[torch.Tensor, list[int], dict[str, Any]] | None] = (
            queue.Queue(maxsize=2)
        )
        self.running = True
        self.error: BaseException | None = None
        self.steps_since_fetch = 0
        self.fetcher = threading.Thread(target=self._fetch_loop, daemon=True)
        self.pusher = threading.Thread(target=self._push_loop, daemon=True)
        self.fetcher.start()
        self.pusher.start()
        self._wait_first_fetch()

    def _wait_first_fetch(self) -> None:
        self._wait_fresh()
        self.adopt_fresh_parameters()

    def _wait_fresh(self) -> None:
        while not self.fresh_ready.wait(timeout=0.1):
            if self.error is not None:
                raise self.error

    def adopt_fresh_parameters(self) -> None:
        """Compute thread: take the newest fetched parameters, if any; ask for the next."""
        if self.error is not None:
            raise self.error
        if self.steps_on_current >= 2 * self.replica.downpour.n_fetch:
            self._wait_fresh()
        with self.lock:
            if self.fresh_versions is not None:
                self.replica.flat.params.copy_(self.fresh)
                self.replica.versions = self.fresh_versions
                self.fresh_versions = None
                self.fresh_ready.clear()
                self.steps_on_current = 0
        self.steps_on_current += 1
        self.steps_since_fetch += 1
        if self.steps_since_fetch >= self.replica.downpour.n_fetch:
            self.steps_since_fetch = 0
            self.fetch_due.set()

    def push(self, grads: torch.Tensor, versions: list[int], record: dict[str, Any]) -> None:
        if self.error is not None:
            raise self.error
        self.outbox.put((grads, versions, record))  # blocks when the pusher is two behind

    def stop(self) -> None:
        self.running = False
        self.fetch_due.set()
        self.outbox.put(None)
        self.pusher.join()
        self.fetcher.join()

    def _fetch_loop(self) -> None:
        buffer = torch.empty_like(self.fresh)
        try:
            while self.running:
                self.fetch_due.wait()
                self.fetch_due.clear()
                if not self.running:
                    return
                versions, received = self.replica.server.pull_into(buffer)
                with self.lock:
                    self.fresh.copy_(buffer)
                    self.fresh_versions = versions
                    self.replica._received += received
                    self.fresh_ready.set()
        except BaseException as err:  # surfaced in the compute thread
            self.error = err

    def _push_loop(self) -> None:
        replica = self.replica
        try:
            while (item := self.outbox.get()) is not None:
                grads, versions, record = item
                futures, sent = replica.server.push(grads, versions)
                record.update(bytes_sent=sent, bytes_received=replica._received)
                replica._received = 0
                replica._pending.append((futures, record))
                replica._collect(wait=False)
        except BaseException as err:
            self.error = err
