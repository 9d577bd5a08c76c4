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
  once, computes a step, and every `n_push` steps waits until its previous push is applied
  and collects its answers, encodes its gradient per shard, puts it into the object store,
  zeroes its gradient buffer and goes on; its first calls after computing cost more than
  back to back (Ray's threads wake up: `_wake`);
- with `downpour.threads` (`ps.pipeline.Pipeline`) a replica's fetch and push run in threads
  of their own beside its compute, on its machine's cores: the fetch thread pulls all shards
  whenever `n_fetch` steps have passed since it was last asked, into a buffer the compute
  thread copies in before its next step (and waits for after `2 * n_fetch` steps on the same
  parameters); every `n_push` steps the compute thread copies its gradient into a queue of
  two (and zeroes it) that the push thread sends from (encode, a call per shard) without
  waiting for the shards to apply it, collecting the answers of the pushes applied by
  then. Every replica's threads start with the run and fetch once;
- a shard (`ParameterShard`) is one actor: pulls and pushes queue and are served one at a
  time on its machine's cores (decode, optimizer step); it checkpoints every
  `shard_checkpoint_every` updates. One replica's calls to a shard run in the order it made
  them (Ray's order for one submitter): a fetch right after a push waits at the shard until
  that push, its payload crossing the link first, is applied;
- with a backup (`downpour.shard_backups`; by default on several machines, or where one
  has a core for every replica, shard and backup: `DownpourSection.backups_per_shard`) a
  shard forwards each push to it (the payload into the object store, across to the
  backup's machine), applies its own copy meanwhile, and answers once the backup has
  applied it too;
- `downpour.mode = "diloco"` and `downpour.max_staleness` (threads off in both): the inner
  optimizer's steps and the outer one's, the gate that holds a replica back before its
  window's fetch, and the push of a window still open at a chunk's end, as
  `scaleout.sim.downpour_modes` prices them.

Byte counts are the library's: the shard ranges (`shard_ranges`) and each push's payload
size (`Wire` / `payload_size`). Costs are the calibration's: a pull's and a push's wall
time and the core-seconds it keeps busy (measured through a real shard, in all processes
together; the caller's share runs on the replica's machine, the rest inside the shard's
queue on the shard's); across machines, what Ray's moving the object between the nodes'
stores costs beyond the link (`pull_across` / `push_across`, measured between testnet
hosts), on the receiving machine during the transfer; codec and optimizer costs per
value; the model's step at its threads, slowed when several replicas compute on one
machine, and while calls run beside it on its machine, as calibrated; and each call's wait
for its hops to be handed a core, in proportion to how busy its machine's cores are as it
starts (`LockstepCost.hop_wait_s`).

Placement: `--machines 1` puts every replica and shard on one machine, as `scaleout train`
does here. On N > 1 machines each machine runs one replica (`run.num_threads` threads),
so there are N replicas, and shard i sits on machine i mod N (Ray spreads them; with backups
the server puts primary i there), where it
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
represented ones are. Simulating every replica is too slow at 1000 machines;
`tests/test_sim_downpour.py` holds the two together where both run.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import simpy

from scaleout.compress.payload import payload_size
from scaleout.ps.layout import shard_ranges
from scaleout.sim.downpour_modes import Gate, ReplicaModes
from scaleout.sim.downpour_report import RunReport
from scaleout.sim.downpour_shards import ShardCalls
from scaleout.sim.downpour_state import Replica, Shard
from scaleout.sim.downpour_threads import ReplicaThreads
from scaleout.sim.engine import Process
from scaleout.sim.result import Result
from scaleout.sim.setting import Setting, model_cost
from scaleout.sim.wire import wire_codec

CHUNK_STEPS = 20  # scaleout.strategies.downpour.strategy.CHUNK_STEPS
STEADY_STEPS_PER_REPLICA = 120  # simulated (6 chunks) when the run itself is longer
REPRESENTED = 64  # replicas simulated at most; more are represented by these


class DownpourSim(ShardCalls, ReplicaThreads, ReplicaModes, RunReport):
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
            machine.cores.beside_plain = self.cost.beside_calls
            machine.cores.call_wait = self.cost.call_wait_s
            machine.cores.call_wait_busy = self.cost.call_wait_busy_s
        env = self.env = self.cluster.env
        self.shards = [
            Shard(i, shard_machines[i], stop - start, simpy.Resource(env, capacity=1))
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
        self.replicas = [Replica(r, r % machines, [0] * len(self.shards)) for r in range(simulated)]
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
        bound = self.opts.max_staleness
        self.gate = None if bound is None else Gate(bound, self.opts.timeout_s)
        self.step = self.examples = 0
        self.pushes = self.pulls = 0
        self.times: list[tuple[float, int]] = []  # (time, examples) after each chunk
        self.steady_since: float | None = None  # when the warm start ended
        self.driver = simpy.Resource(env, capacity=1)
        self.driver_busy = 0.0
        self.paused_s = 0.0  # the driver evaluating or checkpointing, in the steady part
        self.trained_s = 0.0  # when the last chunk was answered
        self.step_ends: list[float] = []  # when each step's compute ended, in order

    # --- a replica's chunk ------------------------------------------------------------------

    def _driver_turn(self) -> Process:
        """The driver's one thread (on machine 0) makes or takes one call of a chunk: hands
        it out, or takes its answer; replicas whose chunks end together queue for it."""
        (wall, cpu), _ = self.cal.pull.sides(0)
        turn = self.driver.request()
        yield turn
        started = self.env.now
        yield from self.cluster.machines[0].call(wall, cpu, self._hop_wait(0))
        own = self.env.now - started
        self.driver_busy += own * self.scale  # it serves the represented replicas too
        self._release(self.driver, turn, own)

    def _chunk(self, replica: Replica, steps: int) -> Process:
        """`Worker.train(steps)` on the replica's actor."""
        yield from self._driver_turn()
        machine = self.cluster.machines[replica.machine]
        step_s = self.cost.step_s(self.train.batch_size, self.threads)
        threads = replica.threads
        for _ in range(steps):
            started = self.env.now
            if threads is not None:
                yield from self._adopt(replica, threads)
            else:
                yield from self._before_step(replica)
            computing = self.env.now
            yield from machine.compute(step_s, self.threads)
            yield from self._inner_step(replica)
            pushing = self.env.now
            replica.computed_s += pushing - computing
            replica.steps += 1
            self.step_ends.append(self.env.now)
            pushed = replica.steps - replica.steps_pushed >= self.opts.n_push
            if pushed:
                if threads is not None:
                    yield from self._hand_over(replica, threads)
                else:
                    yield from self._wake(replica)
                    yield from self._push(replica)
            replica.fetch_s += computing - started
            replica.compute_s += pushing - computing
            replica.push_s += self.env.now - pushing
            if replica.probe is not None:
                push_s = self.env.now - pushing
                self._measure_window(
                    replica, computing - started, pushing - computing, push_s, pushed
                )
                threads = replica.threads
            replica.steady_steps += 1
        yield from self._release_window(replica)
        _, (wall, cpu) = self.cal.pull.sides(0)  # the answer: a call's callee side, no payload
        yield from machine.call(wall, cpu, self._hop_wait(0))
        yield from self._driver_turn()

    def _before_step(self, replica: Replica) -> Process:
        """`ReplicaClient.before_step`, threads off: a fetch every `n_fetch` steps, and
        with a staleness bound, whenever no window is open, the gate and then a fetch (the
        window's first)."""
        opening = self.gate is not None and not replica.window_open
        if not opening and replica.steps % self.opts.n_fetch:
            return
        yield from self._wake(replica)
        if opening:
            waited = replica.wait_s
            yield from self._open_window(replica)
            replica.fetch_s -= replica.wait_s - waited  # not the fetch's: `wait_s`
        yield from self._fetch(replica, replica.versions)
        yield from self._anchor(replica)

    def _release_window(self, replica: Replica) -> Process:
        """At a chunk's end (`take_records`, `ReplicaClient.release`), with a staleness
        bound: a window still open is pushed now, with the steps it holds (a whole push's
        bytes), applied and closed, so the replica holds no other back while it idles."""
        if self.gate is None or not replica.window_open or replica.steps == replica.steps_pushed:
            return
        started = self.env.now
        yield from self._wake(replica)
        yield from self._push(replica)
        replica.push_s += self.env.now - started

    def _wake(self, replica: Replica) -> Process:
        """The first calls of a replica's compute thread after it computed: Ray's threads
        (in the replica, the raylet, the shards) wake up, their caches cold. Priced once
        per run of compute, on the replica's machine, as measured for a pull and a push
        after that much compute (`Calibration.lockstep["shard_calls"]`). (The calls' wait
        for cores on a busy machine is each call's own: `ShardCalls._hop_wait`.)"""
        after = self.cal.lockstep.get("shard_calls")
        computed, replica.computed_s = replica.computed_s, 0.0
        if after is None or computed <= 0:
            return
        nbytes = max(self.pull_bytes)
        wall, cores = after.extra(computed, nbytes), after.extra_core(computed, nbytes)
        yield from self.cluster.machines[replica.machine].call(wall, cores)

    def _look(self, replica: Replica) -> Process:
        """A fetch for an evaluation or a checkpoint (`fetch(update_versions=False)`): not a
        pull of training, so its bytes count as "look"."""
        yield from self._pull_all(replica, None, "look")

    def _evaluate(self, replica: Replica) -> Process:
        """Replica 0 fetches the shards' values and tests them."""
        yield from self._look(replica)
        seconds = self.cost.test_size * self.cost.eval_s
        yield from self.cluster.machines[replica.machine].compute(seconds, self.threads)

    def _checkpoint(self, replica: Replica) -> Process:
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

    def _flush(self, replica: Replica) -> Process:
        """`flush`: the push thread sends what is queued and stops; what is left is pushed,
        and every push applied."""
        if replica.threads is not None:
            yield replica.threads.outbox.put(None)
            yield replica.threads.stopped
        if replica.steps > replica.steps_pushed:
            yield from self._push(replica)
        yield self.env.all_of(replica.pending)

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
