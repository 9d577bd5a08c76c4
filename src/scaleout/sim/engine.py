"""The discrete-event engine: machines whose cores and network links are shared.

Every cost in the simulator is work on a shared resource. A `Shared` resource serves all its
jobs at once, as an operating system's scheduler serves threads and a network link serves
flows (processor sharing): a job that may use `demand` units (threads, or one flow) gets
`min(demand, capacity * demand / total demand)` of them, and its finish time moves whenever
another job starts or ends. That is what makes "two replicas and two shards on a 2-core box"
and "1000 replicas pushing into one shard's network link" come out right without a special
case.

A `Machine` has `cores` (a `Shared` of capacity `cores`, whose work is seconds of one core)
and a full-duplex network interface (`tx`, `rx`: `Shared` of capacity 1, whose work is
seconds of the whole link). A transfer between two machines runs on the sender's `tx` and
the receiver's `rx` at once and ends when both are done, after the link's latency; between
two processes of one machine it is a copy through memory, work on the machine's cores.

Built on SimPy (`env.process`, generators that `yield` events).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

Process = Generator[simpy.Event, Any, Any]
EPS = 1e-12


@dataclass
class _Job:
    remaining: float  # work left, in seconds of `demand` units
    demand: float
    done: simpy.Event
    contended: bool = False  # slowed further by other contended jobs (`Shared.slowdown`)
    rate: float = 0.0  # units it gets now


class Shared:
    """A resource of `capacity` units shared by every job on it (processor sharing).

    `yield env.process(resource.run(work, demand))` takes `work` seconds when the job has
    its `demand` units to itself; less of them stretch it. `slowdown(k)` (>= 1) slows each
    of k `contended` jobs running at once beyond their share of the units: processes that
    compute at once on one machine share its memory bandwidth and caches too (calibrated).
    """

    def __init__(self, env: simpy.Environment, capacity: float, name: str) -> None:
        if capacity <= 0:
            raise ValueError(f"{name}: capacity must be > 0, got {capacity}")
        self.env, self.capacity, self.name = env, float(capacity), name
        self.jobs: list[_Job] = []
        self._stamp = 0.0  # when `remaining` and `busy` were last brought up to date
        self.busy = 0.0  # integral of the units in use over time
        self._wake: simpy.Event | None = None
        self.slowdown: Callable[[int], float] | None = None
        self._server = env.process(self._serve())

    def run(self, work: float, demand: float = 1.0, contended: bool = False) -> Process:
        """Do `work` seconds of work that can use up to `demand` units in parallel."""
        if work <= EPS:
            return
            yield  # a generator either way
        self._advance()
        job = _Job(work, min(float(demand), self.capacity), self.env.event(), contended)
        self.jobs.append(job)
        self._reshare()
        yield job.done

    def utilisation(self, since: float = 0.0) -> float:
        """The mean fraction of the capacity in use from `since` to now."""
        self._advance()
        span = self.env.now - since
        return self.busy / (self.capacity * span) if span > 0 else 0.0

    def _advance(self) -> None:
        elapsed = self.env.now - self._stamp
        if elapsed > 0:
            for job in self.jobs:
                job.remaining -= elapsed * job.rate / job.demand
                self.busy += elapsed * job.rate
        self._stamp = self.env.now

    def _reshare(self) -> None:
        total = sum(job.demand for job in self.jobs)
        scale = min(1.0, self.capacity / total) if total > 0 else 1.0
        num_contended = sum(job.contended for job in self.jobs)
        slow = self.slowdown(num_contended) if self.slowdown and num_contended > 1 else 1.0
        for job in self.jobs:
            job.rate = job.demand * scale / (slow if job.contended else 1.0)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _serve(self) -> Process:
        """Ends each job when its work is done; wakes on every arrival."""
        while True:
            self._wake = self.env.event()
            if not self.jobs:
                yield self._wake
                continue
            next_end = min(job.remaining * job.demand / job.rate for job in self.jobs)
            yield self._wake | self.env.timeout(max(next_end, 0.0))
            self._advance()
            finished = [job for job in self.jobs if job.remaining <= EPS * max(1.0, job.demand)]
            if finished:
                self.jobs = [job for job in self.jobs if job not in finished]
                for job in finished:
                    job.done.succeed()
                self._reshare()


@dataclass(frozen=True)
class Link:
    """A machine's network interface: bandwidth in bytes/s each way, one-way latency."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"link latency must be >= 0 s, got {self.latency}")


@dataclass
class Traffic:
    """Bytes and messages that crossed the wire (between machines) or stayed on a machine."""

    wire_bytes: int = 0
    local_bytes: int = 0
    messages: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, remote: bool, count: int = 1) -> None:
        """`count` messages of `nbytes` each."""
        self.messages += count
        self.by_kind[kind] = self.by_kind.get(kind, 0) + count * nbytes
        if remote:
            self.wire_bytes += count * nbytes
        else:
            self.local_bytes += count * nbytes


class Machine:
    """`cores` shared by its processes, and a network interface."""

    def __init__(self, env: simpy.Environment, index: int, cores: float, link: Link) -> None:
        self.env, self.index, self.link = env, index, link
        self.cores = Shared(env, cores, f"machine {index} cores")
        self.tx = Shared(env, 1.0, f"machine {index} tx")
        self.rx = Shared(env, 1.0, f"machine {index} rx")

    def compute(self, seconds: float, threads: float = 1.0) -> Process:
        """A model's `seconds` of work at `threads` threads (seconds when it has the cores
        and the memory to itself)."""
        yield from self.cores.run(seconds, threads, contended=True)

    def work(self, seconds: float) -> Process:
        """One thread's `seconds` of other work (copies, codecs, an optimizer's update)."""
        yield from self.cores.run(seconds, 1.0)

    def call(self, seconds: float, cpu_seconds: float) -> Process:
        """A call between processes that takes `seconds` on a quiet machine and keeps
        `cpu_seconds` of cores busy meanwhile (several threads and processes at once)."""
        if seconds > EPS:
            yield from self.cores.run(seconds, cpu_seconds / seconds)
        elif cpu_seconds > EPS:  # work that waits for nothing: as fast as one thread
            yield from self.cores.run(cpu_seconds, 1.0)


class Cluster:
    """The machines of one simulated run and the bytes that move between them; messages
    between machines pay the link's latency and bandwidth on both ends."""

    def __init__(
        self, num_machines: int, cores: float, link: Link, idle_cores: float = 0.0
    ) -> None:
        """`idle_cores` of each machine are taken by background processes (Ray's own)."""
        if num_machines < 1:
            raise ValueError(f"need at least one machine, got {num_machines}")
        if not 0 <= idle_cores < cores:
            raise ValueError(f"idle_cores must be in [0, {cores}), got {idle_cores}")
        self.env = simpy.Environment()
        self.machines = [
            Machine(self.env, i, cores - idle_cores, link) for i in range(num_machines)
        ]
        self.traffic = Traffic()

    def send(self, source: int, dest: int, nbytes: int, kind: str = "message") -> Process:
        """Move `nbytes` from a process on machine `source` to one on `dest` over the
        network. Between two processes of one machine only the count changes: the callers
        price those copies from the calibration (they are work on the cores)."""
        remote = source != dest
        self.traffic.add(kind, nbytes, remote)
        if not remote:
            return
        sender, receiver = self.machines[source], self.machines[dest]
        env = self.env
        yield env.timeout(sender.link.latency)
        both = [
            env.process(sender.tx.run(nbytes / sender.link.bandwidth)),
            env.process(receiver.rx.run(nbytes / receiver.link.bandwidth)),
        ]
        yield env.all_of(both)

    def run(self, until: float | simpy.Event | None = None) -> None:
        self.env.run(until=until)
