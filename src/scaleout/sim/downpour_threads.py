"""A simulated Downpour replica's fetch and push threads (`downpour.threads`, the
library's `ps.pipeline.Pipeline`): the fetch thread pulls every shard whenever `n_fetch`
steps have passed since it was last asked, into a buffer the compute thread copies in before
its next step; the compute thread hands each push to a queue of two that the push thread
sends from. `threads = "auto"` measures the push windows first, as `ReplicaClient` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import simpy

from scaleout.ps.client import auto_threads
from scaleout.sim.downpour_state import Replica, Threads
from scaleout.sim.engine import Process

if TYPE_CHECKING:
    from scaleout.sim.calibration import Calibration
    from scaleout.sim.engine import Cluster


class ReplicaThreads:
    """A mixin of `DownpourSim`: threads mode, on top of its shard calls."""

    env: simpy.Environment
    cluster: Cluster
    cal: Calibration
    opts: Any  # DownpourSection
    numel: int

    if TYPE_CHECKING:  # `ShardCalls`

        def _fetch(self, replica: Replica, versions: list[int]) -> Process: ...
        def _send(self, replica: Replica, versions: list[int]) -> Process: ...
        def _zero_s(self) -> float: ...

    def _copy(self, replica: Replica) -> Process:
        """One copy of the whole model's values on the replica's machine."""
        seconds = 4 * self.numel / self.cal.flatten_bytes_per_s
        yield from self.cluster.machines[replica.machine].work(seconds)

    def _measure_window(
        self, replica: Replica, fetch: float, compute: float, push: float, pushed: bool
    ) -> None:
        """With threads "auto" (`ReplicaClient._measure_window`): a step's part of its push
        window; the first window is not counted; after the probes, decide."""
        assert replica.probe is not None
        if replica.window is not None:
            replica.window[0] += compute
            replica.window[1] += fetch + push
        if not pushed:
            return
        if replica.window is not None:
            replica.probe.append((replica.window[0], replica.window[1]))
        replica.window = [0.0, 0.0]
        decided = auto_threads(replica.probe)
        if decided is not None:
            replica.probe = None
            if decided:
                self._start_threads(replica)

    def _start_threads(self, replica: Replica) -> None:
        env = self.env
        replica.threads = Threads(simpy.Store(env, capacity=2), env.event(), env.event())
        env.process(self._fetch_thread(replica, replica.threads))
        env.process(self._push_thread(replica, replica.threads))

    def _fetch_thread(self, replica: Replica, threads: Threads) -> Process:
        while True:
            if not threads.due:
                threads.wake = self.env.event()
                yield threads.wake
            threads.due = False
            versions = list(replica.versions)
            yield from self._fetch(replica, versions)
            yield from self._copy(replica)  # the fetched buffer into `fresh`
            threads.fresh_versions = versions
            if not threads.fresh.triggered:
                threads.fresh.succeed()

    def _push_thread(self, replica: Replica, threads: Threads) -> Process:
        """Sends each queued gradient, then collects the answers of the pushes applied
        by then (`_collect(wait=False)`: in a steady run the previous one)."""
        machine = self.cluster.machines[replica.machine]
        while (versions := (yield threads.outbox.get())) is not None:
            yield from self._send(replica, versions)
            applied = [p for p in replica.pending if p.triggered]
            if applied:
                yield from machine.work(self.cal.collect_push_s(len(applied)))
                replica.pending = [p for p in replica.pending if p not in applied]
        threads.stopped.succeed()

    def _adopt(self, replica: Replica, threads: Threads) -> Process:
        """The compute thread before a step: the newest fetched parameters, if any (waiting
        for them after `2 * n_fetch` steps on the same ones, or for the first fetch)."""
        n_fetch = self.opts.n_fetch
        first = threads.adopted == 0
        if first or threads.steps_on_current >= 2 * n_fetch:
            yield threads.fresh
        for _ in range(2 if first else 1):  # the client adopts once more as it starts
            if threads.fresh_versions is not None:
                yield from self._copy(replica)
                replica.versions = threads.fresh_versions
                threads.fresh_versions = None
                threads.fresh = self.env.event()
                threads.adopted += 1
                threads.steps_on_current = 0
            threads.steps_on_current += 1
            threads.steps_since_fetch += 1
            if threads.steps_since_fetch >= n_fetch:
                threads.steps_since_fetch = 0
                threads.due = True
                if threads.wake is not None and not threads.wake.triggered:
                    threads.wake.succeed()

    def _hand_over(self, replica: Replica, threads: Threads) -> Process:
        """The compute thread's push: a copy of the gradient into the push thread's queue
        (waiting while two are queued), its buffer zeroed."""
        replica.steps_pushed = replica.steps
        yield from self._copy(replica)
        yield from self.cluster.machines[replica.machine].work(self._zero_s())
        yield threads.outbox.put(list(replica.versions))
