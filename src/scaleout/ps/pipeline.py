"""Fetch and push threads beside a replica's compute thread (`ReplicaClient(threads=True)`,
the DistBelief paper's appendix): the compute thread adopts whatever parameters the fetch
thread last brought and hands its accumulated gradients to the push thread through a short
queue, so communication overlaps computation."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from scaleout.ps.client import ReplicaClient


class Pipeline:
    """Fetch and push threads beside the compute thread (`threads=True`).

    Weak synchronisation: the compute thread adopts the newest fetched parameters when
    there are any and never runs more than `2 * n_fetch` steps on the same ones (it waits
    for the fetch thread then); the push thread is at most two pushes behind (a queue of
    two). Without these bounds a fast compute thread runs on ever staler parameters.
    """

    def __init__(self, client: ReplicaClient) -> None:
        self.client = client
        self.fresh = [torch.empty_like(group.flat.params) for group in client.groups]
        self.fresh_versions: list[list[int]] | None = None
        self.fresh_ready = threading.Event()
        self.steps_on_current = 0
        self.lock = threading.Lock()
        self.fetch_due = threading.Event()
        self.fetch_due.set()
        self.outbox: queue.Queue[
            tuple[list[torch.Tensor], list[list[int]], dict[str, Any]] | None
        ] = queue.Queue(maxsize=2)
        self.running = True
        self.error: BaseException | None = None
        self.steps_since_fetch = 0
        self.fetcher = threading.Thread(target=self._fetch_loop, daemon=True)
        self.pusher = threading.Thread(target=self._push_loop, daemon=True)
        self.fetcher.start()
        self.pusher.start()
        self._wait_fresh()
        self.adopt_fresh_parameters()

    def _wait_fresh(self) -> None:
        while not self.fresh_ready.wait(timeout=0.1):
            if self.error is not None:
                raise self.error

    @torch.no_grad()
    def adopt_fresh_parameters(self) -> None:
        """Compute thread: take the newest fetched parameters, if any; ask for the next."""
        if self.error is not None:
            raise self.error
        if self.steps_on_current >= 2 * self.client.n_fetch:
            self._wait_fresh()
        with self.lock:
            if self.fresh_versions is not None:  # the buffers trade places, no copy
                for i, (group, versions) in enumerate(
                    zip(self.client.groups, self.fresh_versions, strict=True)
                ):
                    in_use = group.flat.params
                    group.flat.use_params(self.fresh[i])
                    self.fresh[i] = in_use
                    group.versions = versions
                self.fresh_versions = None
                self.fresh_ready.clear()
                self.steps_on_current = 0
                if self.client.after_pull is not None:
                    self.client.after_pull()
        self.steps_on_current += 1
        self.steps_since_fetch += 1
        if self.steps_since_fetch >= self.client.n_fetch:
            self.steps_since_fetch = 0
            self.fetch_due.set()

    def push(
        self, grads: list[torch.Tensor], versions: list[list[int]], record: dict[str, Any]
    ) -> None:
        if self.error is not None:
            raise self.error
        self.outbox.put((grads, versions, record))  # blocks when the pusher is two behind

    def stop(self) -> None:
        self.running = False
        self.fetch_due.set()
        self.outbox.put(None)
        self.pusher.join()
        self.fetcher.join()
        if self.error is not None:
            raise self.error

    def _fetch_loop(self) -> None:
        buffers = [torch.empty_like(f) for f in self.fresh]
        client = self.client
        try:
            while self.running:
                self.fetch_due.wait()
                self.fetch_due.clear()
                if not self.running:
                    return
                fetched = []
                for group, buffer in zip(client.groups, buffers, strict=True):
                    versions, received = group.server.pull_into(buffer)
                    fetched.append(versions)
                    with self.lock:
                        client._received += received
                        client.stats["bytes_received"] += received
                with self.lock:  # the buffers become the fresh ones, no copy
                    self.fresh, buffers = buffers, self.fresh
                    self.fresh_versions = fetched
                    client.stats["pulls"] += 1
                    self.fresh_ready.set()
        except BaseException as err:  # surfaced in the compute thread
            self.error = err

    def _push_loop(self) -> None:
        client = self.client
        try:
            while (item := self.outbox.get()) is not None:
                grads, versions, record = item
                client._send(grads, versions, record)
                client._collect(wait=False)
        except BaseException as err:
            self.error = err
