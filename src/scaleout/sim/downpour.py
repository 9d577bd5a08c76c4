"""Downpour SGD's schedule as a simulation (`scaleout.strategies.downpour`).

What runs, as the library runs it:

- the driver hands chunks of at most `CHUNK_STEPS` steps (never past the next metrics line)
  to whichever replica is free, each hand-out and each answer a call its one thread makes;
  the first `warmstart_steps` go to replica 0 alone, which then stops exactly at each
  evaluation and checkpoint; at an evaluation the driver waits for replica 0 to finish its
  chunk, then replica 0 fetches the shards' values and runs the test set, while the others
  finish their chunks and wait for the driver (no chunk is handed out meanwhile: the
  role "evaluation pauses");
- a replica (`ReplicaClient`, threads off) fetches every `n_fetch` steps from all shards at
  once, computes a step, and every `n_push` steps waits until its previous push is applied,
  encodes its gradient per shard, puts it into the object store and goes on;
- with `downpour.threads` (`ps.client._Pipeline`) a replica's fetch and push run in threads
  of their own beside its compute, on its machine's cores: the fetch thread pulls all shards
  whenever `n_fetch` steps have passed since it was last asked, into a buffer the compute
  thread copies in before its next step (and waits for after `2 * n_fetch` steps on the same
  parameters); every `n_push` steps the compute thread copies its gradient into a queue of
  two that the push thread sends from (encode, a call per shard) without waiting for the
  shards to apply it. Every replica's threads start with the run and fetch once;
- a shard (`ParameterShard`) is one actor: pulls and pushes queue and are served one at a
  time on its machine's cores (decode, optimizer step); it checkpoints every
  `shard_checkpoint_every` updates. One replica's calls to a shard run in the order it made
  them (Ray's order for one submitter): a fetch right after a push waits at the shard until
  that push, its payload crossing the link first, is applied;
- with a backup (`downpour.shard_backups`; by default on several machines, or where one
  has a core for every replica, shard and backup: `DownpourSection.backups_per_shard`) a
  shard forwards each push to it (the payload into the object store, across to the
  backup's machine), applies its own copy meanwhile, and answers once the backup has
  applied it too.

Byte counts are the library's: the shard ranges (`shard_ranges`) and each push's payload
size (`Wire` / `payload_size`). Costs are the calibration's: a pull's and a push's wall
time and the core-seconds it keeps busy (measured through a real shard, in all processes
together; the caller's share runs on the replica's machine, the rest inside the shard's
queue on the shard's); across machines, what Ray's moving the object between the nodes'
stores costs beyond the link (`pull_across` / `push_across`, measured between testnet
hosts), on the receiving machine during the transfer; codec and optimizer costs per
value; the model's step at its threads, slowed when several replicas compute on one
machine as calibrated.

Placement: `--machines 1` puts every replica and shard on one machine, as `scaleout train`
does here. On N > 1 machines each machine runs one replica (`run.num_threads` threads),
so there are N replicas, and shard i sits on machine i mod N (Ray spreads them), where it
shares the cores and the link with that machine's replica; its backup on the next shard's
machine (Ray picks another node), or the next machine when that is its own.

Beyond `REPRESENTED` replicas (100 or 1000 machines) the run is simulated through
`REPRESENTED` representative replicas, each standing for `weight = N / REPRESENTED` alike
ones: after the warm start every transfer on a shard's link counts as `weight` flows in
its sharing, every call a shard's actor or the driver's thread serves keeps it busy
`weight` times as long (the caller goes on after its own part), and each simulated step
counts `weight` steps of the run (cadences are in the run's steps). The shards then have
machines of their own (at 1000 machines 64 shards would share theirs with 6% of the
replicas), and a one-off call to a shard (an evaluation's fetch) is weighted as the
represented ones are. Simulating every replica would take hours at 1000 machines;
`tests/test_sim_downpour.py` holds the two together where both run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import simpy

from scaleout.compress.payload import payload_size
from scaleout.nn.optim import STATE_BUFFERS
from scaleout.ps.client import auto_threads
from scaleout.ps.layout import shard_ranges
from scaleout.sim.calibration import MessageCost
from scaleout.sim.engine import Process
from scaleout.sim.result import Result
from scaleout.sim.setting import Setting, model_cost
from scaleout.sim.wire import wire_codec

CHUNK_STEPS = 20  # scaleout.strategies.downpour.strategy.CHUNK_STEPS
STEADY_STEPS_PER_REPLICA = 120  # simulated (6 chunks) when the run itself is longer
REPRESENTED = 64  # replicas simulated at most; more are represented by these


@dataclass
class _Shard:
    index: int
    machine: int
    numel: int
    queue: simpy.Resource
    busy: float = 0.0
    version: int = 0
    updates: int = 0
    backup: int | None = None  # the machine of its backup (`downpour.shard_backups`)


@dataclass
class _Threads:
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
class _Replica:
    index: int
    machine: int
    versions: list[int]
    steps: int = 0
    compute_s: float = 0.0  # since the warm start: computing,
    fetch_s: float = 0.0  # fetching (or adopting fetched parameters),
    push_s: float = 0.0  # pushing (or handing a push over), in its compute thread
    steady_steps: int = 0
    pending: list[simpy.Event] = field(default_factory=list)
    free: simpy.Event | None = None  # set when its current chunk ends
    threads: _Threads | None = None
    # `threads = "auto"`: (compute, communication) seconds of each push window measured so
    # far (None once decided), and the window now running, as `ReplicaClient` measures them
    probe: list[tuple[float, float]] | None = None
    window: list[float] | None = None
    # per shard, its last call from this replica: ends when the shard has served it
    calls: dict[int, simpy.Event] = field(default_factory=dict)


class DownpourSim:
    """One simulated Downpour run of `config` (a `RunConfig`) in `setting`."""

    def __init__(
        self,
        config: Any,  # noqa: ANN401
        setting: Setting,
        own_shard_machines: bool = False,
    ) -> None:
        """`own_shard_machines`: on N > 1 machines, the shards on machines of their own
        (N + shards of them), as they are whenever replicas are represented."""
        from scaleout.strategies.downpour import DownpourSection

        self.config, self.setting = config, setting
        cal = self.cal = setting.calibration
        self.opts: DownpourSection = config.downpour
        self.train = config.train
        self.cost = model_cost(config, cal)
        self.threads = config.run.num_threads or 1
        machines = setting.machines
        self.num_replicas = self.opts.num_replicas if machines == 1 else machines
        self.numel = self.cost.num_parameters
        ranges = shard_ranges(self.numel, min(self.opts.num_shards, self.numel))
        simulated = min(self.num_replicas, REPRESENTED) if machines > 1 else self.num_replicas
        self.weight = self.num_replicas / simulated  # run's replicas per simulated one
        if machines > 1 and (self.weight > 1 or own_shard_machines):
            self.cluster = replace(setting, machines=simulated + len(ranges)).cluster()
            shard_machines = [simulated + i for i in range(len(ranges))]
        else:
            self.cluster = setting.cluster()
            shard_machines = [i % machines for i in range(len(ranges))]
        for machine in self.cluster.machines:
            machine.cores.slowdown = self.cost.slowdown
        env = self.env = self.cluster.env
        self.shards = [
            _Shard(i, shard_machines[i], stop - start, simpy.Resource(env, capacity=1))
            for i, (start, stop) in enumerate(ranges)
        ]
        grid = getattr(config, "model_parallel", None)
        self.workers_per_replica = grid.num_workers if grid is not None else 1
        num_machines = len(self.cluster.machines)
        if self.opts.backups_per_shard(
            self.workers_per_replica, setting.cores_per_machine * machines, machines
        ):
            for shard in self.shards:  # Ray picks another node: the next shard's, or machine
                other = self.shards[(shard.index + 1) % len(self.shards)].machine
                shard.backup = other if other != shard.machine else (other + 1) % num_machines
        self.replicas = [
            _Replica(r, r % machines, [0] * len(self.shards)) for r in range(simulated)
        ]
        self.scale = 1.0  # the run's steps per simulated step: `weight` after the warm start
        self.warm_counts: tuple[int, int, int, dict[str, int]] = (0, 0, 0, {})
        self.warm_calls = (0, 0)  # pushes, pulls by the end of the warm start
        compress = config.compress
        self.push_codecs = [wire_codec(self.cal, compress, s.numel) for s in self.shards]
        self.push_bytes = [
            4 * s.numel
            if codec == "fp32"
            else payload_size(codec, (s.numel,), compress.block_size or 0)
            for s, codec in zip(self.shards, self.push_codecs, strict=True)
        ]
        self.pull_bytes = [4 * s.numel for s in self.shards]
        self.staleness: list[int] = []
        self.step = self.examples = 0
        self.pushes = self.pulls = 0
        self.times: list[tuple[float, int]] = []  # (time, examples) after each chunk
        self.steady_since: float | None = None  # when the warm start ended
        self.driver = simpy.Resource(env, capacity=1)
        self.driver_busy = 0.0
        self.paused_s = 0.0  # the driver evaluating or checkpointing, in the steady part
        self.trained_s = 0.0  # when the last chunk was answered
        self.step_ends: list[float] = []  # when each step's compute ended, in order

    def _state_bytes(self, shard: _Shard) -> int:
        """What a shard's checkpoint writes: its values and its optimizer's state."""
        return 4 * shard.numel * (1 + STATE_BUFFERS[self.train.optimizer])

    # --- one shard call --------------------------------------------------------------------

    def _serve(self, shard: _Shard, work: Process) -> Process:
        """`work` in the shard's actor, after the calls queued before (one at a time)."""
        turn = shard.queue.request()
        yield turn
        started = self.env.now
        yield from work
        own = self.env.now - started
        shard.busy += own * self.scale
        self._release(shard.queue, turn, own)

    def _release(self, queue: simpy.Resource, turn: simpy.Event, own: float) -> None:
        """Free a one-at-a-time actor after a call that took `own` seconds; with represented
        replicas it serves theirs too: it stays busy `(weight - 1) * own` longer, while the
        caller goes on."""
        if self.scale > 1:
            self.env.process(self._hold(queue, turn, (self.scale - 1) * own))
        else:
            queue.release(turn)

    def _hold(self, queue: simpy.Resource, turn: simpy.Event, seconds: float) -> Process:
        yield self.env.timeout(seconds)
        queue.release(turn)

    def _in_order(self, replica: _Replica, shard: _Shard) -> tuple[simpy.Event | None, simpy.Event]:
        """Ray runs one submitter's calls to an actor in the order they were submitted: a
        pull sent right after a push waits at the shard until that push (its payload still
        crossing the link) is applied. Returns (the call before this one, this one's end);
        taken as the call's process starts, which is in the order the calls were made."""
        before = replica.calls.get(shard.index)
        replica.calls[shard.index] = done = self.env.event()
        return before, done

    def _call(
        self, machine: int, cost: MessageCost, nbytes: int, caller: bool, times: float = 1.0
    ) -> Process:
        """The caller's or the callee's side of one call (its share of the wall time and of
        the cores it keeps busy), or of `times` such calls one after another."""
        wall, cpu = cost.sides(nbytes)[0 if caller else 1]
        yield from self.cluster.machines[machine].call(times * wall, times * cpu)

    def _cross(
        self,
        source: int,
        dest: int,
        nbytes: int,
        kind: str,
        cost: MessageCost | None,
        to_shard: bool,
        alone: bool = False,
    ) -> Process:
        """`nbytes` of a call's object from machine `source` to `dest`: over the link and,
        meanwhile, Ray's object managers moving it between the nodes' stores (`cost`:
        `Calibration.pull_across` / `push_across`, wall time beyond the link's transfer
        and core-seconds, priced on the receiving machine; nothing on one machine or
        without a measurement). A shard's machine receives the represented replicas'
        objects too, meanwhile. `alone`: one flow on the links (`Cluster.send`)."""
        send = self.cluster.send(source, dest, nbytes, kind, alone)
        if source == dest or cost is None:
            yield from send
            return
        machine = self.cluster.machines[dest]
        wall = nbytes / machine.link.bandwidth + cost.seconds(nbytes)
        cpu = cost.cpu_s(nbytes)
        if to_shard and self.scale > 1:
            self.env.process(machine.call((self.scale - 1) * wall, (self.scale - 1) * cpu))
        yield self.env.all_of([self.env.process(send), self.env.process(machine.call(wall, cpu))])

    def _pull(
        self, replica: _Replica, shard: _Shard, versions: list[int] | None, kind: str = "pull"
    ) -> Process:
        """One shard's slice to the replica; its version into `versions` (None: a look that
        the next push's staleness ignores)."""
        nbytes = self.pull_bytes[shard.index]
        before, done = self._in_order(replica, shard)
        if before is not None:
            yield before
        # the shard puts its slice into the object store
        yield from self._serve(shard, self._call(shard.machine, self.cal.pull, nbytes, False))
        done.succeed()
        if versions is not None:
            versions[shard.index] = shard.version
        across = self.cal.pull_across
        yield from self._cross(shard.machine, replica.machine, nbytes, kind, across, False)
        # the Ray call and the copy into the parameters
        yield from self._call(replica.machine, self.cal.pull, nbytes, caller=True)

    def _apply(self, replica: _Replica, shard: _Shard, base_version: int) -> Process:
        nbytes = self.push_bytes[shard.index]
        before, done = self._in_order(replica, shard)
        across = self.cal.push_across
        yield from self._cross(replica.machine, shard.machine, nbytes, "push", across, True)
        if before is not None:
            yield before
        yield from self._serve(shard, self._update(shard, nbytes, base_version))
        done.succeed()

    def _update(self, shard: _Shard, nbytes: int, base_version: int) -> Process:
        """The shard takes a push: the call's callee side, decode, the optimizer's step, and
        every `shard_checkpoint_every` updates a checkpoint."""
        codec = self.push_codecs[shard.index]
        seconds = self.cal.codec_s(codec, shard.numel, "decode") + self.cal.apply_s(
            self.train.optimizer, shard.numel
        )
        yield from self._call(shard.machine, self.cal.push, nbytes, caller=False)
        replicated = None
        if shard.backup is not None:  # the payload to the backup, put into the object store
            yield from self._call(shard.machine, self.cal.push, nbytes, caller=True)
            replicated = self.env.process(self._replicate(shard, nbytes, seconds))
        yield from self.cluster.machines[shard.machine].work(seconds)
        if replicated is not None:  # the push is answered once the backup has applied it
            yield replicated
        self.staleness.append(round((shard.version - base_version) * self.scale))
        shard.version += 1
        shard.updates += 1
        every = self.opts.shard_checkpoint_every
        if every and shard.updates % every == 0:
            state = self._state_bytes(shard)
            yield self.env.timeout(state / self.cal.checkpoint_bytes_per_s)

    def _replicate(self, shard: _Shard, nbytes: int, seconds: float) -> Process:
        """The backup's side of a push (`ParameterShard.replicate`): the payload crosses to
        the backup's machine, which applies it as the primary does, meanwhile."""
        assert shard.backup is not None
        across = self.cal.push_across
        # one flow: the primary's actor forwards the represented replicas' pushes one after
        # another, each while it holds its queue (`_release`), not all at once
        yield from self._cross(shard.machine, shard.backup, nbytes, "backup", across, True, True)
        if self.scale > 1:  # it applies the represented replicas' pushes too, meanwhile
            self.env.process(self._backup_side(shard.backup, nbytes, seconds, self.scale - 1))
        yield from self._backup_side(shard.backup, nbytes, seconds, 1.0)

    def _backup_side(self, machine: int, nbytes: int, seconds: float, times: float) -> Process:
        """`times` pushes taken and applied by a backup on `machine`: priced by what they
        cost, not by how long the one simulated took (on a busy machine that would count
        its wait for the cores as more work)."""
        yield from self._call(machine, self.cal.push, nbytes, caller=False, times=times)
        yield from self.cluster.machines[machine].work(times * seconds)

    # --- a replica's steps -----------------------------------------------------------------

    def _fetch(self, replica: _Replica, versions: list[int]) -> Process:
        self.pulls += 1
        pulls = [self.env.process(self._pull(replica, s, versions)) for s in self.shards]
        yield self.env.all_of(pulls)

    def _push(self, replica: _Replica) -> Process:
        """A push from the compute thread (threads off, or a flush)."""
        if replica.pending:  # the previous push must be applied first (`_collect(wait=True)`)
            yield self.env.all_of(replica.pending)
        replica.pending = []
        yield from self._send(replica, list(replica.versions))

    def _send(self, replica: _Replica, versions: list[int]) -> Process:
        """Encode the gradient per shard and put each slice into the object store; the
        shards apply them meanwhile (`replica.pending`)."""
        machine = self.cluster.machines[replica.machine]
        encode = sum(
            self.cal.codec_s(self.push_codecs[s.index], s.numel, "encode") for s in self.shards
        )
        yield from machine.work(encode)
        for nbytes in self.push_bytes:  # into the object store, a call per shard
            yield from self._call(replica.machine, self.cal.push, nbytes, caller=True)
        self.pushes += 1
        replica.pending += [
            self.env.process(self._apply(replica, s, versions[s.index])) for s in self.shards
        ]

    # --- threads mode ----------------------------------------------------------------------

    def _copy(self, replica: _Replica) -> Process:
        """One copy of the whole model's values on the replica's machine."""
        seconds = 4 * self.numel / self.cal.flatten_bytes_per_s
        yield from self.cluster.machines[replica.machine].work(seconds)

    def _measure_window(
        self, replica: _Replica, fetch: float, compute: float, push: float, pushed: bool
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

    def _start_threads(self, replica: _Replica) -> None:
        env = self.env
        replica.threads = _Threads(simpy.Store(env, capacity=2), env.event(), env.event())
        env.process(self._fetch_thread(replica, replica.threads))
        env.process(self._push_thread(replica, replica.threads))

    def _fetch_thread(self, replica: _Replica, threads: _Threads) -> Process:
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

    def _push_thread(self, replica: _Replica, threads: _Threads) -> Process:
        while (versions := (yield threads.outbox.get())) is not None:
            yield from self._send(replica, versions)
        threads.stopped.succeed()

    def _adopt(self, replica: _Replica, threads: _Threads) -> Process:
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

    def _hand_over(self, replica: _Replica, threads: _Threads) -> Process:
        """The compute thread's push: a copy of the gradient into the push thread's queue
        (waiting while two are queued)."""
        yield from self._copy(replica)
        yield threads.outbox.put(list(replica.versions))

    def _driver_turn(self) -> Process:
        """The driver's one thread (on machine 0) makes or takes one call of a chunk: hands
        it out, or takes its answer; replicas whose chunks end together queue for it."""
        (wall, cpu), _ = self.cal.pull.sides(0)
        turn = self.driver.request()
        yield turn
        started = self.env.now
        yield from self.cluster.machines[0].call(wall, cpu)
        own = self.env.now - started
        self.driver_busy += own * self.scale  # it serves the represented replicas too
        self._release(self.driver, turn, own)

    def _chunk(self, replica: _Replica, steps: int) -> Process:
        """`train_chunk(steps)` on the replica's actor."""
        yield from self._driver_turn()
        machine = self.cluster.machines[replica.machine]
        step_s = self.cost.step_s(self.train.batch_size, self.threads)
        threads = replica.threads
        for _ in range(steps):
            started = self.env.now
            if threads is not None:
                yield from self._adopt(replica, threads)
            elif replica.steps % self.opts.n_fetch == 0:
                yield from self._fetch(replica, replica.versions)
            computing = self.env.now
            yield from machine.compute(step_s, self.threads)
            pushing = self.env.now
            replica.steps += 1
            self.step_ends.append(self.env.now)
            if replica.steps % self.opts.n_push == 0:
                if threads is not None:
                    yield from self._hand_over(replica, threads)
                else:
                    yield from self._push(replica)
            replica.fetch_s += computing - started
            replica.compute_s += pushing - computing
            replica.push_s += self.env.now - pushing
            if replica.probe is not None:
                push_s, pushed = self.env.now - pushing, replica.steps % self.opts.n_push == 0
                self._measure_window(
                    replica, computing - started, pushing - computing, push_s, pushed
                )
                threads = replica.threads
            replica.steady_steps += 1
        _, (wall, cpu) = self.cal.pull.sides(0)  # the answer: a call's callee side, no payload
        yield from machine.call(wall, cpu)
        yield from self._driver_turn()

    def _look(self, replica: _Replica) -> Process:
        """A fetch for an evaluation or a checkpoint (`fetch(update_versions=False)`): not a
        pull of training, so its bytes count as "look"."""
        pulls = [self.env.process(self._pull(replica, s, None, "look")) for s in self.shards]
        yield self.env.all_of(pulls)

    def _evaluate(self, replica: _Replica) -> Process:
        """Replica 0 fetches the shards' values and tests them."""
        yield from self._look(replica)
        seconds = self.cost.test_size * self.cost.eval_s
        yield from self.cluster.machines[replica.machine].compute(seconds, self.threads)

    def _checkpoint(self, replica: _Replica) -> Process:
        """The shards checkpoint, then replica 0 writes the model."""
        for shard in self.shards:
            state = self._state_bytes(shard)
            yield from self._serve(shard, self.cluster.machines[shard.machine].work(0.0))
            yield self.env.timeout(state / self.cal.checkpoint_bytes_per_s)
        yield from self._look(replica)
        yield self.env.timeout(4 * self.numel / self.cal.checkpoint_bytes_per_s)

    # --- the driver ------------------------------------------------------------------------

    def _driver(self, total: int) -> Process:
        """Steps here are the run's: a simulated step counts `self.scale` of them."""
        env, cfg, opts = self.env, self.train, self.opts
        in_flight: dict[int, simpy.Process] = {}
        assigned: float = 0
        while self.step < total:
            before = self.step
            warm = self.step < opts.warmstart_steps
            if not warm and self.steady_since is None:
                self._mark()
            active = [0] if warm else list(range(len(self.replicas)))
            limit = total
            if len(active) == 1:  # one replica stops exactly at evaluations and checkpoints
                limit = min(
                    limit,
                    (self.step // cfg.eval_every + 1) * cfg.eval_every,
                    (self.step // cfg.checkpoint_every + 1) * cfg.checkpoint_every,
                )
            target = min((self.step // cfg.log_every + 1) * cfg.log_every, limit)
            while self.step < target:
                for r in active:
                    end = target if assigned < target else limit
                    left = math.ceil((end - assigned) / self.scale - 1e-9)
                    steps = min(cfg.log_every, CHUNK_STEPS, left)
                    if steps > 0 and r not in in_flight:
                        in_flight[r] = env.process(self._chunk(self.replicas[r], steps))
                        in_flight[r].steps = steps * self.scale  # type: ignore[attr-defined]
                        assigned += steps * self.scale
                done = yield env.any_of(list(in_flight.values()))
                for r, proc in list(in_flight.items()):
                    if proc in done:
                        del in_flight[r]
                        self.step += proc.steps  # type: ignore[attr-defined]
                        self.examples += proc.steps * cfg.batch_size  # type: ignore[attr-defined]
                self.times.append((env.now, self.examples))
            if self.step >= total:  # the last metrics line's stamp, before evaluating
                self.trained_s = env.now

            def crossed(every: int, before: float = before) -> bool:
                return self.step // every > before // every or self.step >= total

            evaluating, saving = crossed(cfg.eval_every), crossed(cfg.checkpoint_every)
            paused = env.now  # no chunk is handed out until the driver is back
            if (evaluating or saving) and 0 in in_flight:
                yield in_flight[0]  # the call waits behind replica 0's chunk (counted next)
            if evaluating:
                yield env.process(self._evaluate(self.replicas[0]))
            if saving:
                yield env.process(self._checkpoint(self.replicas[0]))
            if self.steady_since is not None:
                self.paused_s += env.now - paused
            self.times.append((env.now, self.examples))
        for proc in in_flight.values():  # chunks still running end with the run
            yield proc
        flushes = [env.process(self._flush(replica)) for replica in self.replicas]
        yield env.all_of(flushes)
        self.times.append((env.now, self.examples))

    def _flush(self, replica: _Replica) -> Process:
        """`flush`: the push thread sends what is queued and stops; what is left is pushed,
        and every push applied."""
        if replica.threads is not None:
            yield replica.threads.outbox.put(None)
            yield replica.threads.stopped
        if replica.steps % self.opts.n_push:
            yield from self._push(replica)
        yield self.env.all_of(replica.pending)

    def _mark(self) -> None:
        """Utilisation from here on: the warm start's one replica would hide the bottleneck
        of the steady part."""
        self.steady_since = self.env.now
        if self.weight > 1:  # the shards serve the represented replicas too
            self.scale = self.weight
            traffic = self.cluster.traffic
            self.warm_counts = (
                traffic.wire_bytes,
                traffic.local_bytes,
                traffic.messages,
                dict(traffic.by_kind),
            )
            self.warm_calls = (self.pushes, self.pulls)
            for shard in self.shards:
                self.cluster.machines[shard.machine].flows = self.weight
        self.cluster.mark()
        for shard in self.shards:
            shard.busy = 0.0
        for replica in self.replicas:
            replica.compute_s = replica.fetch_s = replica.push_s = 0.0
            replica.steady_steps = 0
        self.driver_busy = 0.0

    def _count_represented(self) -> None:
        """Traffic and calls since the warm start, times `weight`."""
        traffic, (wire, local, messages, by_kind) = self.cluster.traffic, self.warm_counts
        extra = self.weight - 1
        traffic.wire_bytes += round(extra * (traffic.wire_bytes - wire))
        traffic.local_bytes += round(extra * (traffic.local_bytes - local))
        traffic.messages += round(extra * (traffic.messages - messages))
        for kind, nbytes in traffic.by_kind.items():
            traffic.by_kind[kind] = nbytes + round(extra * (nbytes - by_kind.get(kind, 0)))
        self.pushes += round(extra * (self.pushes - self.warm_calls[0]))
        self.pulls += round(extra * (self.pulls - self.warm_calls[1]))

    # --- the run ---------------------------------------------------------------------------

    def total_steps(self) -> int:
        if self.setting.steps is not None:
            return self.setting.steps
        size = self.cost.train_size
        if self.train.steps is None and size <= 0:
            return self.opts.warmstart_steps + STEADY_STEPS_PER_REPLICA * self.num_replicas
        run = self.train.total_steps(size // self.train.batch_size)
        if self.setting.machines == 1:
            return run
        steady = self.opts.warmstart_steps + STEADY_STEPS_PER_REPLICA * self.num_replicas
        return max(min(run, 4 * steady), steady)

    def run(self) -> Result:
        total = self.total_steps()
        threads = self.opts.replica_threads(
            self.workers_per_replica,
            self.config.run.num_threads,
            self.setting.cores_per_machine,
            self.setting.machines,
        )
        for replica in self.replicas:
            if threads is True:
                self._start_threads(replica)
            elif threads == "auto":
                replica.probe = []
        driver = self.env.process(self._driver(total))
        self.env.run(until=driver)
        return self._result(total)

    def _result(self, total: int) -> Result:
        elapsed = self.env.now
        examples = self.examples
        # The steady rate: steps as they end, in the middle of the run after the warm start
        # (without the replicas' first fetches all at once, or the last chunks ending alone).
        ends, first = self.step_ends, self.opts.warmstart_steps
        low, high = first + (len(ends) - first) // 5, first + 9 * (len(ends) - first) // 10
        steady = None
        if high < len(ends) and ends[high] > ends[low]:
            steady = (high - low) * self.scale * self.train.batch_size / (ends[high] - ends[low])
        span = elapsed - (self.steady_since or 0.0)
        replica_busy = [r.compute_s / span for r in self.replicas if r.steps] if span else []
        roles = {
            "replica compute": statistics.mean(replica_busy) if replica_busy else 0.0,
            "shard queue": max(s.busy / span for s in self.shards) if span else 0.0,
            "driver": self.driver_busy / span if span else 0.0,
            "evaluation pauses": self.paused_s / span if span else 0.0,
        }
        stale = self.staleness or [0]
        if self.weight > 1:  # what the represented replicas sent too
            self._count_represented()
        return Result.of_run(
            self.cluster,
            roles,
            steps=total,
            examples=examples,
            step_s=elapsed / total,
            steady_examples_per_s=steady,
            trained_s=self.trained_s,
            num_machines=self.setting.machines,
            extra={
                "replicas": self.num_replicas,
                "simulated_replicas": len(self.replicas),
                "shards": len(self.shards),
                "pushes": self.pushes,
                "pulls": self.pulls,
                "staleness_mean": statistics.mean(stale),
                "staleness_max": max(stale),
                "staleness_histogram": _histogram(stale),
                # a replica's compute thread per step after the warm start, as pushes.jsonl
                # has it per push (compute_s, fetch_s, push_s)
                "replica_step_s": self._replica_step_s(),
            },
        )

    def _replica_step_s(self) -> dict[str, float]:
        active = [r for r in self.replicas if r.steady_steps]
        if not active:
            return {}
        return {
            part: statistics.mean(getattr(r, f"{part}_s") / r.steady_steps for r in active)
            for part in ("compute", "fetch", "push")
        }


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
