"""Sandblaster L-BFGS (`scaleout.strategies.sandblaster`) as a simulation.

What runs, as the library runs it:

- the coordinator (the driver process, on machine 0) keeps only scalars; x, g, the search
  direction and the L-BFGS history live on `num_shards` shards (`VectorShard` actors, each a
  queue that serves one call at a time). The first `train` call evaluates the objective
  once; then each L-BFGS iteration sends the shards the vector commands of `lbfgs` (the
  two-loop recursion over the pairs held so far, the line search's trial point, the new
  pair: `_calls_before` / `_CALLS_AFTER`), evaluates the objective once (the line search
  accepts its first trial, as it does once the history is built; extra trials are not
  simulated), and has every shard checkpoint its vectors;
- an objective evaluation is one pass over the L-BFGS batch (`sandblaster.batch_size`, or
  the training set), cut into portions of `portion_size` examples. The coordinator hands a
  portion to whichever replica is free; when none is left and `backup_tasks` is on, an idle
  replica gets a copy of a portion of this pass that is running once only (the oldest
  first); the first result wins, the other is dropped when it ends, and the replica that
  computes it stays busy until then, into the next pass. Results that arrive at the same
  instant are all read before portions are handed out (the library reads them one by one,
  which differs only on exact ties, which a real run does not have);
- a replica's call: apply the verdicts of its previous portions (every `push_every`
  accepted gradients it pushes their sum to the shards, asynchronously), fetch x from every
  shard when the coordinator moved it (float64 values), compute the portion (forward and
  backward: `ModelCost.step_s` at `run.num_threads` threads), keep its gradient apart (one
  vector op); a straggler sleeps `(factor - 1)` times what the call took so far, as the
  library's `straggler_replica` does;
- after the last winner: every replica flushes (pushes what is accepted, waits until the
  shards have it), the shards sum the accepted replicas' gradients, the gradient is scaled.

Prices: a vector command costs `Calibration.apply_s("sgd", n)` per command per shard of `n`
values (an SGD update is one pass over a vector, as `dot`, `axpy`, `scale` and `copy` are);
every call costs `Calibration.pull.fixed_s`; pulls of x and pushes of gradients move bytes
as Downpour's pulls and pushes do (half the per-byte cost on each side); a shard's
checkpoint writes its vectors at `checkpoint_bytes_per_s`. Calls and scalar answers cross
the network as messages of 0 bytes (they pay the link's latency).

Placement: `--machines 1` runs `sandblaster.num_replicas` replicas and the shards on the one
machine, sharing its cores. On N > 1 machines each machine runs one replica (N replicas),
shard i sits on machine i mod N, the coordinator on machine 0.

Utilisation: "replica compute" (mean share of the run a replica computes, straggler sleep
included), "shard queue" (the busiest shard), "network link", "cores", and "coordinator":
the share of the run spent outside handing out portions (vector commands, flushes,
checkpoints, evaluations), when no replica has work from the coordinator waiting on it.

`slow={replica: factor}` makes replicas stragglers (>= 1, as `straggler_factor`); it
overrides the config's `straggler_replica`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import simpy

from scaleout.errors import ConfigError
from scaleout.ps.layout import shard_ranges
from scaleout.sim.engine import Process
from scaleout.sim.result import Result
from scaleout.sim.setting import Setting, model_cost
from scaleout.sim.sync import driver_chunks
from scaleout.strategies.sandblaster.portions import next_portion, portion_bounds

STEADY_ITERATIONS = 10  # beyond a full history, simulated on N > 1 machines
COORDINATOR = 0  # the machine of the driver process
_BASE_VECTORS = 9  # x, mask, g, q, d, x_prev, g_prev, s_new, y_new (+ tmp with l2)
_CALLS_AFTER = (1, 6, 2)  # dot(g, d); s, y, s'y, y'y; push_history (ops per call)


@dataclass
class _Shard:
    index: int
    machine: int
    numel: int
    queue: simpy.Resource
    busy: float = 0.0


@dataclass
class _Replica:
    index: int
    machine: int
    factor: float
    x_version: int = -1
    accepted: int = 0  # accepted gradients summed, not yet pushed
    pushes: list[simpy.Process] = field(default_factory=list)
    compute_s: float = 0.0


def _two_loop_calls(pairs: int) -> list[int]:
    """Vector ops per call of `two_loop` with `pairs` history pairs."""
    if pairs == 0:
        return [5]  # copy g q, scale, copy q d, scale, dot
    return [2] * pairs + [3] + [2] * (pairs - 1) + [4]


def _training_set_size(config: Any) -> int:  # noqa: ANN401
    """The training set's examples when the calibration does not record them (a model
    priced by its FLOPs): the config's data, built as the strategy builds it."""
    if config.data is None:
        raise ConfigError("the L-BFGS batch is unknown: the config names no [data]")
    train, _ = config.data.build(config.run.seed)
    return len(train)


class SandblasterSim:
    """One simulated Sandblaster run of `config` (a `RunConfig`) in `setting`."""

    def __init__(
        self,
        config: Any,  # noqa: ANN401
        setting: Setting,
        slow: dict[int, float] | None = None,
    ) -> None:
        self.config, self.setting = config, setting
        self.cal = setting.calibration
        self.opts = opts = config.sandblaster
        self.train = config.train
        self.cost = model_cost(config, self.cal)
        self.threads = config.run.num_threads or 1
        machines = setting.machines
        self.num_replicas = opts.num_replicas if machines == 1 else machines
        factors = [1.0] * self.num_replicas
        if opts.straggler_replica is not None and opts.straggler_replica < self.num_replicas:
            factors[opts.straggler_replica] = opts.straggler_factor
        for replica, factor in (slow or {}).items():
            if not 0 <= replica < self.num_replicas:
                raise ValueError(f"slow: replica {replica} of {self.num_replicas} does not exist")
            if factor < 1:
                raise ValueError(f"slow: replica {replica}'s factor must be >= 1, got {factor}")
            factors[replica] = float(factor)
        self.numel = self.cost.num_parameters
        if opts.num_shards > self.numel:
            raise ConfigError(
                f"sandblaster.num_shards = {opts.num_shards} exceeds the model's {self.numel} "
                f"parameters: use at most {self.numel}"
            )
        train_size = self.cost.train_size or _training_set_size(config)
        self.batch_size = min(opts.batch_size or train_size, train_size)
        self.bounds = portion_bounds(self.batch_size, opts.portion_size)
        self.cluster = setting.cluster()
        for machine in self.cluster.machines:
            machine.cores.slowdown = self.cost.slowdown
        self.env = self.cluster.env
        self.shards = [
            _Shard(i, i % machines, stop - start, simpy.Resource(self.env, capacity=1))
            for i, (start, stop) in enumerate(shard_ranges(self.numel, opts.num_shards))
        ]
        self.replicas = [_Replica(r, r % machines, factors[r]) for r in range(self.num_replicas)]
        self.grad_bytes = 8 if opts.dtype == "float64" else 4  # a replica's gradient value
        self.running: dict[simpy.Process, tuple[int, int, int]] = {}  # (replica, pass, portion)
        self.x_version = self.batch = 0
        self.pass_s: list[float] = []
        self.backups = self.duplicates = 0
        self.first_done = 0.0  # when the first objective evaluation ended
        self.trained_s = 0.0  # when the last chunk was answered
        self.portions_s = 0.0  # time spent handing out portions until the last winner

    # --- calls to the shards --------------------------------------------------------------

    def _serve(self, shard: _Shard, seconds: float) -> Process:
        with shard.queue.request() as turn:
            yield turn
            started = self.env.now
            yield from self.cluster.machines[shard.machine].work(seconds)
            shard.busy += self.env.now - started

    def _shard_call(self, shard: _Shard, ops: int) -> Process:
        yield from self.cluster.send(COORDINATOR, shard.machine, 0, "call")
        yield self.env.timeout(self.cal.pull.fixed_s)
        yield from self._serve(shard, ops * self.cal.apply_s("sgd", shard.numel))
        yield from self.cluster.send(shard.machine, COORDINATOR, 0, "call")

    def _commands(self, ops: int) -> Process:
        """One `space.run`: `ops` vector commands on every shard at once."""
        env = self.env
        yield env.all_of([env.process(self._shard_call(s, ops)) for s in self.shards])

    def _checkpoint_shard(self, shard: _Shard, vectors: int) -> Process:
        yield from self.cluster.send(COORDINATOR, shard.machine, 0, "call")
        yield self.env.timeout(self.cal.pull.fixed_s)
        with shard.queue.request() as turn:
            yield turn
            started = self.env.now
            yield self.env.timeout(8 * shard.numel * vectors / self.cal.checkpoint_bytes_per_s)
            shard.busy += self.env.now - started
        yield from self.cluster.send(shard.machine, COORDINATOR, 0, "call")

    def _pull_x(self, machine: int, shard: _Shard) -> Process:
        """x's slice (float64) from a shard to a process on `machine`."""
        nbytes, cost = 8 * shard.numel, self.cal.pull
        half = nbytes / cost.bytes_per_s / 2
        yield self.env.timeout(cost.fixed_s)
        yield from self._serve(shard, half)
        yield from self.cluster.send(shard.machine, machine, nbytes, "pull")
        yield from self.cluster.machines[machine].work(half)

    def _fetch_x(self, machine: int) -> Process:
        env = self.env
        yield env.all_of([env.process(self._pull_x(machine, s)) for s in self.shards])

    # --- a replica -------------------------------------------------------------------------

    def _accumulate(self, replica: _Replica, shard: _Shard) -> Process:
        nbytes = self.grad_bytes * shard.numel
        yield from self.cluster.send(replica.machine, shard.machine, nbytes, "push")
        half = nbytes / self.cal.push.bytes_per_s / 2
        yield from self._serve(shard, half + self.cal.apply_s("sgd", shard.numel))

    def _push(self, replica: _Replica) -> Process:
        """The accepted sum into the object store, one slice per shard, applied later."""
        cost = self.cal.push
        put = sum(self.grad_bytes * s.numel / cost.bytes_per_s / 2 for s in self.shards)
        yield from self.cluster.machines[replica.machine].work(put)
        yield self.env.timeout(cost.fixed_s * len(self.shards))
        replica.pushes += [self.env.process(self._accumulate(replica, s)) for s in self.shards]
        replica.accepted = 0

    def _settle(self, replica: _Replica, verdicts: list[bool], flush: bool = False) -> Process:
        replica.accepted += sum(verdicts)
        if replica.accepted >= self.opts.push_every or (flush and replica.accepted):
            yield from self._push(replica)

    def _compute(
        self, replica: _Replica, portion: int, x_version: int, verdicts: list[bool]
    ) -> Process:
        """One `compute` call: the verdicts, x if it moved, the portion's gradient."""
        env, machine = self.env, self.cluster.machines[replica.machine]
        yield from self.cluster.send(COORDINATOR, replica.machine, 0, "call")
        yield env.timeout(self.cal.pull.fixed_s)
        yield from self._settle(replica, verdicts)
        started = env.now
        if replica.x_version != x_version:
            yield from self._fetch_x(replica.machine)
            replica.x_version = x_version
        start, stop = self.bounds[portion]
        yield from machine.compute(self.cost.step_s(stop - start, self.threads), self.threads)
        yield from machine.work(self.cal.apply_s("sgd", self.numel))  # the gradient, kept
        if replica.factor > 1:
            yield env.timeout((replica.factor - 1) * (env.now - started))
        replica.compute_s += env.now - started
        yield from self.cluster.send(replica.machine, COORDINATOR, 0, "call")

    def _flush(self, replica: _Replica, verdicts: list[bool]) -> Process:
        yield from self.cluster.send(COORDINATOR, replica.machine, 0, "call")
        yield self.env.timeout(self.cal.pull.fixed_s)
        yield from self._settle(replica, verdicts, flush=True)
        pushes, replica.pushes = replica.pushes, []
        yield self.env.all_of(pushes)
        yield from self.cluster.send(replica.machine, COORDINATOR, 0, "call")

    # --- the coordinator -------------------------------------------------------------------

    def _evaluate_batch(self) -> Process:
        """One objective evaluation: a load-balanced pass over the batch."""
        env, started = self.env, self.env.now
        self.x_version += 1
        self.batch += 1
        batch, count = self.batch, len(self.bounds)
        todo = deque(range(count))
        winners: dict[int, int] = {}  # portion -> replica
        verdicts: dict[int, list[bool]] = {r.index: [] for r in self.replicas}

        def assign(r: int) -> None:
            if any(rr == r for rr, _, _ in self.running.values()):
                return
            chosen = next_portion(
                todo, self.running.values(), batch, winners, self.opts.backup_tasks
            )
            if chosen is None:
                return
            portion, copy = chosen
            self.backups += int(copy)
            replica = self.replicas[r]
            proc = env.process(self._compute(replica, portion, self.x_version, verdicts[r]))
            verdicts[r] = []
            self.running[proc] = (r, batch, portion)

        for r in range(self.num_replicas):
            assign(r)
        while len(winners) < count:
            yield env.any_of(list(self.running))
            for proc in [proc for proc in self.running if proc.triggered]:
                r, of_batch, portion = self.running.pop(proc)
                if of_batch == batch and portion not in winners:
                    winners[portion] = r
                    verdicts[r].append(True)
                else:
                    self.duplicates += 1
                    if of_batch == batch:
                        verdicts[r].append(False)
            if len(winners) < count:
                for other in range(self.num_replicas):
                    assign(other)
        self.portions_s += env.now - started
        yield env.all_of([env.process(self._flush(r, verdicts[r.index])) for r in self.replicas])
        yield from self._commands(1 + len(set(winners.values())))  # finalize: sum accepted
        yield from self._commands(4 if self.opts.l2 else 1)  # scale (and the L2 term)
        self.pass_s.append(env.now - started)

    def _calls_before(self, iteration: int) -> list[int]:
        """Ops per call before the line search's evaluation (every pair assumed kept)."""
        pairs = min(iteration, self.opts.history)
        first = [1] if iteration == 0 else []  # norm2(g) for the first step length
        return [1, *_two_loop_calls(pairs), *first, 2, 2]  # max_abs; ...; x_prev; trial x

    def _iteration(self, iteration: int) -> Process:
        for ops in self._calls_before(iteration):
            yield from self._commands(ops)
        yield from self._evaluate_batch()
        for ops in _CALLS_AFTER:
            yield from self._commands(ops)
        vectors = (
            _BASE_VECTORS + (1 if self.opts.l2 else 0) + 2 * min(iteration + 1, self.opts.history)
        )
        env = self.env
        yield env.all_of([env.process(self._checkpoint_shard(s, vectors)) for s in self.shards])

    def _driver(self, total: int) -> Process:
        iteration = 0
        for steps, evaluating, saving in driver_chunks(total, self.train):
            if iteration == 0:  # the first `train` call evaluates the objective once first
                yield from self._evaluate_batch()
                self.first_done = self.env.now
            for _ in range(steps):
                yield from self._iteration(iteration)
                iteration += 1
            yield from self._commands(1)  # max_abs(g) for the chunk's fields
            self.trained_s = self.env.now  # the metrics line's stamp, before evaluating
            machine = self.cluster.machines[COORDINATOR]
            if evaluating:  # x from the shards, then the test set on the driver
                yield from self._fetch_x(COORDINATOR)
                seconds = self.cost.test_size * self.cost.eval_s
                yield from machine.compute(seconds, self.threads)
            if saving:  # x as the model's weights
                yield from self._fetch_x(COORDINATOR)
                state = self.grad_bytes * self.numel
                yield self.env.timeout(state / self.cal.checkpoint_bytes_per_s)

    # --- the run ---------------------------------------------------------------------------

    def total_steps(self) -> int:
        if self.setting.steps is not None:
            return self.setting.steps
        if self.setting.machines == 1:
            return self.opts.max_iterations
        return min(self.opts.max_iterations, self.opts.history + STEADY_ITERATIONS)

    def run(self) -> Result:
        total = self.total_steps()
        if total < 1:
            raise ConfigError(f"L-BFGS iterations to simulate must be >= 1, got {total}")
        driver = self.env.process(self._driver(total))
        self.env.run(until=driver)
        return self._result(total)

    def _result(self, total: int) -> Result:
        elapsed = self.env.now
        examples = len(self.pass_s) * self.batch_size
        after_first = elapsed - self.first_done
        roles = {
            "replica compute": statistics.mean(r.compute_s / elapsed for r in self.replicas),
            "shard queue": max(s.busy / elapsed for s in self.shards),
        }
        return Result.of_run(
            self.cluster,
            roles,
            steps=total,
            examples=examples,
            step_s=after_first / total,
            steady_examples_per_s=total * self.batch_size / after_first,
            trained_s=self.trained_s,
            extra={
                "replicas": self.num_replicas,
                "shards": len(self.shards),
                "portions": len(self.bounds),
                "evaluations": len(self.pass_s),
                "evaluation_s_mean": statistics.mean(self.pass_s),
                "backups": self.backups,
                "duplicates": self.duplicates,
            },
            after={"coordinator": 1 - self.portions_s / elapsed},
        )
