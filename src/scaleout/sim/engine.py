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

import heapq
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

Process = Generator[simpy.Event, Any, Any]
EPS = 1e-12


class Shared:
    """A resource of `capacity` units shared by every job on it (processor sharing).

    `yield env.process(resource.run(work, demand))` takes `work` seconds when the job has
    its `demand` units to itself; less of them stretch it. `slowdown(k)` (>= 1) slows each
    of k `contended` jobs running at once beyond their share of the units: processes that
    compute at once on one machine share its memory bandwidth and caches too (calibrated).
    `beside_plain` (>= 1) slows `contended` jobs further while any plain job (a call, a
    copy, an optimizer's update) runs beside them: their copies evict the compute's data
    from the caches (calibrated for Downpour's calls: `ModelCost.beside_calls`).
    `call_wait` (seconds) is what the contended jobs lose together, in wall time, each time
    a call between processes starts on the machine (`Machine.call`): the call's threads wake
    up and the scheduler hands them a computing thread's core, even with another core idle
    (calibrated for Downpour's calls: `ModelCost.call_wait_s`, one process computing).
    `call_wait_busy` (seconds, or None: as `call_wait`) is that loss when computing jobs ask
    for every unit: then each of the call's hops takes a computing thread's core, not an
    idle one (`ModelCost.call_wait_busy_s`); in between the two, the loss follows the share
    of the units the contended jobs ask for (`call_wait_now`).

    Every job of a class (contended or not) moves through its work at the same speed (its
    share of the units over its demand), so one virtual clock per class and a heap of the
    jobs' finishing points on it serve thousands of jobs (a shard's link under 1000
    replicas) in O(log n) per arrival or departure.
    """

    def __init__(self, env: simpy.Environment, capacity: float, name: str) -> None:
        if capacity <= 0:
            raise ValueError(f"{name}: capacity must be > 0, got {capacity}")
        self.env, self.capacity, self.name = env, float(capacity), name
        # per class (0: plain, 1: contended): work done by any job of it, the heap of its
        # jobs' (finishing point on that clock, order, units, done event), their demand,
        # and the speed (work per second) they move at now
        self._clock = [0.0, 0.0]
        self._heaps: list[list[tuple[float, int, float, simpy.Event]]] = [[], []]
        self._demand = [0.0, 0.0]
        self._speed = [1.0, 1.0]
        self._in_use = 0.0  # units in use now
        self._order = 0
        self._generation = 0  # the one scheduled end that is not stale
        self._stamp = 0.0  # when the clocks and `busy` were last brought up to date
        self.busy = 0.0  # integral of the units in use over time
        self._mark = (0.0, 0.0)  # (time, busy) that `utilisation` counts from
        self.slowdown: Callable[[int], float] | None = None
        self.beside_plain = 1.0
        self.call_wait = 0.0
        self.call_wait_busy: float | None = None

    def run(self, work: float, demand: float = 1.0, contended: bool = False) -> Process:
        """Do `work` seconds of work that can use up to `demand` units in parallel."""
        if work > EPS:
            yield self.start(work, demand, contended)

    def start(
        self, work: float, demand: float = 1.0, contended: bool = False, copies: float = 1.0
    ) -> simpy.Event:
        """`run` without a process: the event that triggers when the work is done.
        `copies`: the job stands for that many alike jobs started with it (they take their
        shares of the units and end with it: a represented replica's flow)."""
        done = self.env.event()
        if work <= EPS:
            return done.succeed()
        self._advance()
        kind, units = int(contended), min(float(demand), self.capacity) * copies
        self._order += 1
        heapq.heappush(self._heaps[kind], (self._clock[kind] + work, self._order, units, done))
        self._demand[kind] += units
        self._reshare()
        return done

    def preempt(self, seconds: float) -> None:
        """The contended jobs running now lose `seconds` of wall time together, shared
        evenly: each one's end moves later by its share (a preempted thread, not less
        work done)."""
        heap = self._heaps[1]
        if seconds <= EPS or not heap:
            return
        self._advance()
        lost = seconds / len(heap) * self._speed[1]  # on the contended jobs' clock
        self._heaps[1] = [(end + lost, order, units, done) for end, order, units, done in heap]
        self._schedule()

    def call_wait_now(self) -> float:
        """What the contended jobs lose to a call starting now: `call_wait` (measured with
        one 1-thread job computing) and `call_wait_busy` (with one on every unit) joined by
        a line in the units the contended jobs ask for, at least 0."""
        if self.call_wait_busy is None or self.capacity <= 1:
            return self.call_wait
        share = min(self.contended_demand(), self.capacity)
        slope = (self.call_wait_busy - self.call_wait) / (self.capacity - 1)
        return max(self.call_wait + slope * (share - 1), 0.0)

    def contended_demand(self) -> float:
        """Units the contended jobs (a model's compute) running now ask for."""
        return self._demand[1] if self._heaps[1] else 0.0

    def busy_fraction(self) -> float:
        """The share of the capacity the jobs running now ask for, at most 1."""
        return min(sum(self._demand) / self.capacity, 1.0)

    def mark(self) -> None:
        """Measure `utilisation` from now on (the steady part of a run)."""
        self._advance()
        self._mark = (self.env.now, self.busy)

    def utilisation(self) -> float:
        """The mean fraction of the capacity in use since `mark` (or the start) to now."""
        self._advance()
        since, busy = self._mark
        span = self.env.now - since
        return (self.busy - busy) / (self.capacity * span) if span > 0 else 0.0

    def _advance(self) -> None:
        elapsed = self.env.now - self._stamp
        if elapsed > 0:
            for kind in (0, 1):
                self._clock[kind] += elapsed * self._speed[kind]
            self.busy += elapsed * self._in_use
        self._stamp = self.env.now

    def _reshare(self) -> None:
        plain, contended = self._demand
        total = plain + contended
        scale = min(1.0, self.capacity / total) if total > EPS else 1.0
        count = len(self._heaps[1])
        slow = self.slowdown(count) if self.slowdown and count > 1 else 1.0
        if plain > EPS:
            slow *= self.beside_plain
        self._speed = [scale, scale / slow]
        self._in_use = scale * (plain + contended / slow)
        self._schedule()

    def _schedule(self) -> None:
        """One timeout for the next job to end; the ones scheduled before go stale."""
        self._generation += 1
        ends = [
            (heap[0][0] - self._clock[kind]) / self._speed[kind]
            for kind, heap in enumerate(self._heaps)
            if heap
        ]
        if ends:
            generation = self._generation
            timeout = self.env.timeout(max(min(ends), 0.0))
            timeout.callbacks.append(lambda _: self._end(generation))

    def _end(self, generation: int) -> None:
        """End every job whose work is done, then share the units anew."""
        if generation != self._generation:
            return
        self._advance()
        for kind, heap in enumerate(self._heaps):
            clock = self._clock[kind]
            while heap and heap[0][0] - clock <= EPS * max(1.0, abs(clock)):
                _, _, units, done = heapq.heappop(heap)
                self._demand[kind] = max(self._demand[kind] - units, 0.0) if heap else 0.0
                done.succeed()
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

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        cores: float | Shared,
        link: Link,
    ) -> None:
        """`cores`: how many, or the `Shared` cores of a box this machine is a part of."""
        self.env, self.index, self.link = env, index, link
        if isinstance(cores, Shared):
            self.cores = cores
        else:
            self.cores = Shared(env, cores, f"machine {index} cores")
        self.tx = Shared(env, 1.0, f"machine {index} tx")
        self.rx = Shared(env, 1.0, f"machine {index} rx")
        self.flows = 1.0  # flows each of its transfers stands for (represented replicas)

    def compute(self, seconds: float, threads: float = 1.0) -> Process:
        """A model's `seconds` of work at `threads` threads (seconds when it has the cores
        and the memory to itself)."""
        yield from self.cores.run(seconds, threads, contended=True)

    def work(self, seconds: float) -> Process:
        """One thread's `seconds` of other work (copies, codecs, an optimizer's update)."""
        yield from self.cores.run(seconds, 1.0)

    def call(self, seconds: float, cpu_seconds: float, hop_wait: float = 0.0) -> Process:
        """A call between processes that takes `seconds` on a quiet machine and keeps
        `cpu_seconds` of cores busy meanwhile (several threads and processes at once). The
        models computing on the machine lose `cores.call_wait_now()` to its threads waking
        up.
        `hop_wait`: what the call's hops between processes wait for a core to be handed
        over when other work keeps every core busy; it waits that times the busy fraction
        of the cores as it starts (`LockstepCost.hop_wait_s`), before its share of them."""
        self.cores.preempt(self.cores.call_wait_now())
        if (waiting := hop_wait * self.cores.busy_fraction()) > EPS:
            yield self.env.timeout(waiting)
        if seconds > EPS:
            # more parallel than the machine's cores: as long as they take for its CPU
            units = min(cpu_seconds / seconds, self.cores.capacity)
            yield from self.cores.run(cpu_seconds / units if units > EPS else seconds, units)
        elif cpu_seconds > EPS:  # work that waits for nothing: as fast as one thread
            yield from self.cores.run(cpu_seconds, 1.0)


class Cluster:
    """The machines of one simulated run and the bytes that move between them; messages
    between machines pay the link's latency and bandwidth on both ends."""

    def __init__(
        self,
        num_machines: int,
        cores: float,
        link: Link,
        idle_cores: float = 0.0,
        one_box: bool = False,
    ) -> None:
        """`idle_cores` of each machine are taken by background processes (Ray's own).
        `one_box`: the machines are network namespaces of one box (`benchmarks.testnet`
        hosts): each has its own link, and all share the box's `cores`."""
        if num_machines < 1:
            raise ValueError(f"need at least one machine, got {num_machines}")
        taken = idle_cores * (num_machines if one_box else 1)
        if not 0 <= taken < cores:
            raise ValueError(f"idle_cores must be in [0, {cores}), got {taken}")
        self.env = simpy.Environment()
        box = Shared(self.env, cores - taken, "the box's cores") if one_box else None
        self.machines = [
            Machine(self.env, i, box or cores - idle_cores, link) for i in range(num_machines)
        ]
        self.traffic = Traffic()

    def send(
        self, source: int, dest: int, nbytes: int, kind: str = "message", alone: bool = False
    ) -> Process:
        """Move `nbytes` from a process on machine `source` to one on `dest` over the
        network. Between two processes of one machine only the count changes: the callers
        price those copies from the calibration (they are work on the cores). `alone`: one
        flow, even where the machines' transfers count as several (`Machine.flows`: a
        transfer that stands for others made one after another, not at once)."""
        remote = source != dest
        self.traffic.add(kind, nbytes, remote)
        if not remote:
            return
        sender, receiver = self.machines[source], self.machines[dest]
        env = self.env
        if sender.link.latency > 0:
            yield env.timeout(sender.link.latency)
        both = [
            sender.tx.start(nbytes / sender.link.bandwidth, copies=1 if alone else sender.flows),
            receiver.rx.start(
                nbytes / receiver.link.bandwidth, copies=1 if alone else receiver.flows
            ),
        ]
        yield env.all_of(both)

    def mark(self) -> None:
        """Utilisation counts from now on, on every machine (after a warm start)."""
        for machine in self.machines:
            for resource in (machine.cores, machine.tx, machine.rx):
                resource.mark()

    def run(self, until: float | simpy.Event | None = None) -> None:
        self.env.run(until=until)
