"""What a simulated Downpour run keeps per shard, per replica and per replica's threads
(`scaleout.sim.downpour`): the simulation's counterpart of a `ParameterShard`'s version and
queue, and of a `ReplicaClient`'s versions, pending pushes and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy


@dataclass
class Shard:
    """A shard's actor (its queue, one call at a time), where it runs, and its updates."""

    index: int
    machine: int
    numel: int
    queue: simpy.Resource
    busy: float = 0.0
    version: int = 0
    updates: int = 0
    backup: int | None = None  # the machine of its backup (`downpour.shard_backups`)
    applying: simpy.Event | None = None  # ends with the update it holds its lock for now


@dataclass
class Threads:
    """A replica's fetch and push threads (`downpour.threads`)."""

    outbox: simpy.Store  # the push thread's queue of two (the base versions of each push)
    fresh: simpy.Event  # triggered while fetched parameters wait to be adopted
    stopped: simpy.Event  # the push thread took the last item
    wake: simpy.Event | None = None  # the fetch thread waits on it for `due`
    due: bool = True  # a fetch was asked for
    fresh_versions: list[int] | None = None
    adopted: int = 0  # parameters adopted so far
    steps_on_current: int = 0
    steps_since_fetch: int = 0


@dataclass
class Replica:
    """A replica's client: the versions it fetched, its pushes not yet applied, its time."""

    index: int
    machine: int
    versions: list[int]
    steps: int = 0
    steps_pushed: int = 0  # `steps` at its last push (`ReplicaClient._steps_pushed`)
    window_open: bool = False  # with a staleness bound: fetched, not pushed (`_window`)
    compute_s: float = 0.0  # since the warm start: computing,
    fetch_s: float = 0.0  # fetching (or adopting fetched parameters),
    push_s: float = 0.0  # pushing (or handing a push over), in its compute thread
    wait_s: float = 0.0  # and waiting at the staleness bound's gate (not in `fetch_s`)
    waits: list[float] = field(default_factory=list)  # seconds at the gate, per window
    steady_steps: int = 0
    pending: list[simpy.Event] = field(default_factory=list)
    free: simpy.Event | None = None  # set when its current chunk ends
    threads: Threads | None = None
    # `threads = "auto"`: (compute, communication) seconds of each push window measured so
    # far (None once decided), and the window now running, as `ReplicaClient` measures them
    probe: list[tuple[float, float]] | None = None
    window: list[float] | None = None
    # per shard, its last call from this replica: ends when the shard has served it
    calls: dict[int, simpy.Event] = field(default_factory=dict)
    # seconds its compute thread computed since it last called a shard (threads off)
    computed_s: float = 0.0
