"""Strategy "model_parallel" (`scaleout.strategies.model_parallel`) as a simulation: one
replica of a layer-wise locally connected network over a `model_parallel.grid` of workers.

What runs, as the library runs it: every worker takes the same greedy step of stack k on
the same minibatch, in lockstep. The step is the forward pass through the frozen stacks
below (each stack's filter, pooling and contrast normalisation on the worker's part),
then stack k's objective (W x and W^T h, fused; the pooled codes) and its backward, then
one all-reduce of the objective's sums and the replicated alpha's gradient, then each
worker's optimizer step on its own filters. Between the layers the workers exchange the
activations their receptive fields reach (and, in the backward, their gradients):
`scaleout.parallel.greedy_exchanges` lists those exchanges in order, and each one's bytes
per pair of workers are the library's (`DistributedArray.pair_bytes`, from the same
windows the real run's `ExchangePlan`s are built of; with `[compress] codec` the packed
codes and scales). An exchange is a collective: the next layer starts when every piece
has arrived.

Prices: a worker's compute is its part's FLOPs (its block positions' filters, its pixels
of pooling and normalisation; `scaleout.nn.local` counts them; the calibrated share of a
step that does not shrink with the work, `ModelCost.phase_fixed_fraction` of its stack,
stays whole on every worker) at the machine's FLOP rate:
measured, when the calibration has this config's model (the rate of its measured step of
that stack in one process, the frozen stacks below included: pooling and normalisation
cost more per FLOP than the filters' GEMMs), else the file's `flops_per_s` per thread (a
hardware file: one GPU per worker). Pieces between workers of one machine are priced as
the calibration's two-process exchange (`Calibration.exchange`: the library's exchange
over gloo, measured by the calibration; a copy between GPUs of a server in a hardware
file), each worker paying it for the bytes it sends its machine's workers (a calibration without it:
as ring steps of its all-reduce, `sync.ring_send`); pieces between machines cross the
sender's and the receiver's links. An exchange that follows a layer's compute costs
`Calibration.lockstep["exchange"]` more (a worker that finished first waits for the
other, gloo's threads wake up; measured by the calibration after that much compute), and
the sums' all-reduce `lockstep["allreduce"]` (`CollectiveClock`).

Placement: the P workers of the grid over N machines, consecutive ranks together (worker
r on machine r * N // P: COTS HPC's four GPUs per server); `--machines 1` is the run as
`scaleout train` runs it here, every worker on this machine's cores. N may not exceed P.

Every stack's step is simulated once (steps are alike in lockstep) and the run is
`train.steps` of each stack, with the driver's evaluations and checkpoints between its
chunks (`driver_chunks`; each stack's end evaluates and checkpoints). An evaluation of
stack k is the forward pass of its step over the test set in `train.eval_batch_size`
batches, at the rate of this model's measured evaluation of stack k in one process
(`ModelCost.phase_eval_s`); a checkpoint writes the replica and its optimizer's state at
`Calibration.checkpoint_bytes_per_s`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from scaleout.comm.windows import Window, partition_local
from scaleout.compress.transfer import CodecSpeed
from scaleout.errors import ConfigError
from scaleout.parallel import Exchange, greedy_exchanges, parallelize
from scaleout.sim.engine import Process
from scaleout.sim.result import Result
from scaleout.sim.setting import Setting
from scaleout.sim.sync import (
    CollectiveClock,
    checkpoint_bytes,
    driver_chunks,
    ring_allreduce,
    ring_send,
)
from scaleout.sim.wire import link_codec_speed
from scaleout.strategies.layout import ModelParallelSection

SUM_VALUES = 4  # the objective's two sums, the example count and alpha's gradient
MATMULS_FORWARD, MATMULS_BACKWARD = 2, 3  # W x, W^T h; then W dL/dr and two weight products


@dataclass(frozen=True)
class Compute:
    """Work every worker does at once: FLOPs per rank."""

    what: str
    flops: tuple[int, ...]


@dataclass(frozen=True)
class Move:
    """One exchange (or its transposed one, `backward`): bytes per (sender, receiver)."""

    exchange: Exchange
    backward: bool
    pairs: dict[tuple[int, int], int]


def _compute(what: str, per_example: list[float], batch: int, times: float = 1.0) -> Compute:
    return Compute(what, tuple(round(times * f * batch) for f in per_example))


def _flops(items: Iterable[Compute | Move], rank: int | None = None) -> int:
    computes = [i for i in items if isinstance(i, Compute)]
    return sum(sum(i.flops) if rank is None else i.flops[rank] for i in computes)


def _shares(windows: list[Window]) -> list[float]:
    total = sum(w.num_pixels for w in windows)
    return [w.num_pixels / total for w in windows]


class GreedySchedule:
    """The greedy steps of a config's partitioned network, for every worker of its grid:
    built once on PyTorch's meta device (shapes only) as `parallelize` partitions it."""

    def __init__(
        self,
        config: Any,  # noqa: ANN401
        grid: tuple[int, int] | None = None,
        speed: CodecSpeed | None = None,
    ) -> None:
        """`grid`: another grid than the config's (`model_parallel.grid`); `speed`: the
        codec's cost that decides, on a `compress.link`, which pieces go raw (None:
        measured in this process)."""
        from scaleout.api import build_job

        job = build_job(config)
        if grid is None:
            given = job.section("model_parallel", ModelParallelSection).grid
            grid = (given[0], given[1])
        self.grid = grid
        self.workers = self.grid[0] * self.grid[1]
        self.batch = config.train.batch_size
        with torch.device("meta"):
            network = job.model.build()
        if not hasattr(network, "stacks"):
            raise ConfigError(
                'train.strategy = "model_parallel" simulates a SparseAutoencoderNetwork '
                f'(model.kind = "sparse_autoencoder"); {job.model.name} is not one'
            )
        geometries = [stack.filter.geometry for stack in network.stacks]
        layer_flops = [stack.flops_per_example() for stack in network.stacks]
        codec = job.compress.build_for_collectives(speed)
        try:
            parallelize(network, list(self.grid), rank=0, codec=codec)
        except ValueError as err:
            raise ConfigError(f"model_parallel.grid = {list(self.grid)}: {err}") from None
        self.network = network
        self.num_stacks = len(network.stacks)
        # per stack, per rank: FLOPs per example of one matmul, pooling, normalisation, and
        # the parameters the worker updates (its filters)
        self.matmul, self.pool, self.lcn, self.own_numel = [], [], [], []
        for stack, g, flops in zip(network.stacks, geometries, layer_flops, strict=True):
            parts = [g.sub(p.units.rows, p.units.cols) for p in partition_local(g, self.grid)]
            self.matmul.append([part.matmul_flops(1) for part in parts])
            self.own_numel.append([part.num_weights for part in parts])
            self.pool.append([flops["pool"] * s for s in _shares(stack.pool.output_windows)])
            self.lcn.append([flops["lcn"] * s for s in _shares(stack.lcn.output_windows)])

    def step(self, index: int) -> Iterator[Compute | Move]:
        """One greedy step of stack `index`, in the order it runs."""
        yield from self.forward(index)
        move, batch, k = self._moves(index), self.batch, index
        yield _compute("backward: pool", self.pool[k], batch, 2)
        yield from move(k, "pool.to_input", batch, True)
        yield from move(k, "filter.to_owners", batch, True)
        yield _compute("backward: W", self.matmul[k], batch, MATMULS_BACKWARD)

    def forward(self, index: int, batch: int | None = None) -> Iterator[Compute | Move]:
        """The forward pass of a step of stack `index` on `batch` examples (the step's
        minibatch by default): the frozen stacks' features, then stack `index`'s objective.
        An evaluation of the stack is this on the test set."""
        move, batch, k = self._moves(index), batch or self.batch, index
        for frozen in range(index):
            yield from move(frozen, "filter.to_input", batch)
            yield _compute(f"stack {frozen + 1} filter", self.matmul[frozen], batch)
            yield from move(frozen, "pool.to_input", batch)
            yield _compute(f"stack {frozen + 1} pool", self.pool[frozen], batch)
            yield from move(frozen, "lcn.to_input", batch)
            yield _compute(f"stack {frozen + 1} lcn", self.lcn[frozen], batch)
        yield from move(k, "filter.to_input", batch)
        yield _compute("objective: W x, W^T h", self.matmul[k], batch, MATMULS_FORWARD)
        yield from move(k, "filter.to_owners", batch)
        yield from move(k, "pool.to_input", batch)
        yield _compute("objective: pool", self.pool[k], batch)

    def _moves(self, index: int) -> Callable[..., Iterator[Move]]:
        """`move(k, name, batch, backward=False)`: stack k's exchange `name` in a step of
        stack `index` on `batch` examples, when the step makes it."""
        moves = {(e.stack, e.name): e for e in greedy_exchanges(self.network, index)}

        def move(k: int, name: str, batch: int, backward: bool = False) -> Iterator[Move]:
            if (k, name) in moves:
                exchange = moves[(k, name)]
                pairs = exchange.array.pair_bytes(batch, exchange.channels, backward=backward)
                yield Move(exchange, backward, pairs)

        return move

    def step_flops(self, index: int, rank: int | None = None) -> int:
        """FLOPs of one step of stack `index`: of worker `rank`, or of all of them."""
        return _flops(self.step(index), rank)

    def forward_flops(self, index: int, batch: int) -> int:
        """FLOPs of all workers in the forward pass of stack `index` on `batch` examples."""
        return _flops(self.forward(index, batch))

    def bytes_per_step(self, index: int) -> int:
        """Bytes all workers send each other in one step of stack `index`."""
        return sum(sum(i.pairs.values()) for i in self.step(index) if isinstance(i, Move))


class ModelParallelSim:
    """One model-parallel run of `config` on `setting`'s machines."""

    def __init__(self, config: Any, setting: Setting) -> None:  # noqa: ANN401
        from scaleout.sim.measuring import model_key

        self.config, self.setting, self.train = config, setting, config.train
        speed = link_codec_speed(setting.calibration, config.compress)  # the library's choice
        self.schedule = GreedySchedule(config, speed=speed)
        self.workers = self.schedule.workers
        if setting.machines > self.workers:
            raise ConfigError(
                f"--machines {setting.machines}: model_parallel.grid = "
                f"{list(self.schedule.grid)} has {self.workers} workers; give at most that many"
            )
        self.cal = cal = setting.calibration
        self.threads = config.run.num_threads or 1
        self.cost = cal.models.get(model_key(config))
        # the whole network in one worker: what a measured model's rates are per FLOP of
        one = GreedySchedule(config, grid=(1, 1)) if self.cost is not None else self.schedule
        self.s_per_flop = self._seconds_per_flop(one)
        self.fixed = self._fixed_fractions()
        # an older calibration's model has no test size (0): the config's, when it gives one
        self.test_size = (self.cost.test_size if self.cost else 0) or config.data.num_test or 0
        self.eval_s_per_flop = self._seconds_per_flop_evaluating(one)
        self.cluster = setting.cluster()
        if self.cost is not None:
            for machine in self.cluster.machines:
                machine.cores.slowdown = self.cost.slowdown
        self.env = self.cluster.env
        self.clock = CollectiveClock(self.cluster, cal, self.workers)
        self.machine_of = [r * setting.machines // self.workers for r in range(self.workers)]
        self.shares_machine = [self.machine_of.count(m) > 1 for m in self.machine_of]
        self.compute_s = self.exchange_s = 0.0  # wall time in layers' compute, in exchanges

    def _seconds_per_flop(self, one: GreedySchedule) -> list[float]:
        """Seconds per FLOP of one worker at its threads, per stack: the measured rate of
        this model's step of that stack (of stack 1 when only it was measured), else the
        file's FLOP/s per thread."""
        stacks = range(self.schedule.num_stacks)
        if self.cost is not None:
            batch = self.train.batch_size
            whole = self.cost.step_s(batch, self.threads)  # stack 1's step
            if len(self.cost.phase_s) != len(stacks):
                return [whole / one.step_flops(0) for _ in stacks]
            threads = whole / self.cost.step_s(batch, 1)
            return [threads * batch * self.cost.phase_s[k] / one.step_flops(k) for k in stacks]
        rate = self.cal.flops_per_s
        if rate is None:
            raise ConfigError(
                "this config's model is not in the calibration and it has no flops_per_s: "
                "run `scaleout calibrate CONFIG` with it"
            )
        return [1.0 / (rate * self.threads) for _ in stacks]

    def _seconds_per_flop_evaluating(self, one: GreedySchedule) -> list[float]:
        """Seconds per FLOP of one worker's evaluation at its threads, per stack: the rate
        of this model's measured evaluation of that stack in one process (its batches are
        bigger than a step's), else the step's rate."""
        cost, stacks = self.cost, range(self.schedule.num_stacks)
        measured = [] if cost is None else cost.phase_eval_s or [cost.eval_s]
        if cost is None or len(measured) != len(stacks) or not self.test_size:
            return self.s_per_flop
        batch = self.train.batch_size
        threads = cost.step_s(batch, self.threads) / cost.step_s(batch, 1)
        return [
            threads * self.test_size * measured[k] / one.forward_flops(k, self.test_size)
            for k in stacks
        ]

    def _fixed_fractions(self) -> list[float]:
        """Per stack, the share of its step that stays whole on every worker: measured per
        stack (a stack of small maps is mostly fixed costs), else the model's, else 0."""
        stacks = self.schedule.num_stacks
        if self.cost is None:
            return [0.0] * stacks
        if len(self.cost.phase_fixed_fraction) == stacks:
            return list(self.cost.phase_fixed_fraction)
        return [self.cost.fixed_fraction] * stacks

    def _worker_compute(self, rank: int, seconds: float) -> Process:
        yield from self.cluster.machines[self.machine_of[rank]].compute(seconds, self.threads)

    def _piece(self, source: int, dest: int, nbytes: int, kind: str) -> Process:
        """One piece of an exchange when the calibration has no measured exchange: over
        the links between machines, as a ring step of its all-reduce within one."""
        a, b = self.machine_of[source], self.machine_of[dest]
        if a == b and self.cal.allreduce is None:
            raise ConfigError(
                "the calibration has no exchange or all-reduce between two processes (they "
                "price exchanges within a machine): run `scaleout calibrate` again"
            )
        yield from ring_send(self.cluster, a, b, nbytes, self.cal.allreduce, kind)

    def _exchange(self, rank: int, move: Move, kind: str) -> Process:
        """Worker `rank`'s part of an exchange with calibrated exchanges: its pieces to
        workers of its machine as one measured two-process exchange of their bytes (the
        fixed cost paid even with nothing to send: the collective meets), its pieces to
        other machines over the links."""
        env, cal, here = self.env, self.cal, self.machine_of[rank]
        assert cal.exchange is not None
        local, remote = 0, []
        for (i, j), nbytes in move.pairs.items():
            if i != rank:
                continue
            if self.machine_of[j] == here:
                local += nbytes
                self.cluster.traffic.add(kind, nbytes, remote=False)
            else:
                remote.append(
                    env.process(self.cluster.send(here, self.machine_of[j], nbytes, kind))
                )
        jobs = remote
        if self.shares_machine[rank]:
            cost = cal.exchange
            call = self.cluster.machines[here].call(cost.seconds(local), cost.cpu_s(local) / 2)
            jobs = [env.process(call), *remote]
        yield env.all_of(jobs)

    def _step(self, index: int) -> Process:
        """One greedy step of stack `index` on every worker, then their optimizer steps."""
        env = self.env
        yield from self._items(self.schedule.step(index), self.s_per_flop[index], self.fixed[index])
        yield from self._sums()
        optimizer = self.train.optimizer
        updates = [
            env.process(
                self.cluster.machines[self.machine_of[r]].work(self.cal.apply_s(optimizer, n))
            )
            for r, n in enumerate(self.schedule.own_numel[index])
        ]
        yield env.all_of(updates)

    def _evaluation(self, index: int) -> Process:
        """An evaluation of stack `index`: the forward pass over the test set in batches of
        `train.eval_batch_size` on every worker, then the all-reduce of the sums. Its
        compute is all FLOPs (a fixed share per call is small beside a test batch)."""
        full, rest = divmod(self.test_size, self.train.eval_batch_size)
        for batch in [self.train.eval_batch_size] * full + ([rest] if rest else []):
            forward = self.schedule.forward(index, batch)
            yield from self._items(forward, self.eval_s_per_flop[index], 0.0)
        yield from self._sums()

    def _sums(self) -> Process:
        """The all-reduce of the objective's sums over the grid."""
        yield from self.clock.wake(4 * SUM_VALUES)
        yield from ring_allreduce(self.cluster, self.machine_of, 4 * SUM_VALUES, self.cal, "sums")
        self.clock.ended()

    def _items(self, items: Iterable[Compute | Move], price: float, fixed: float) -> Process:
        """Run `items` on every worker in order, a compute at `price` seconds per FLOP."""
        env = self.env
        for item in items:
            start = env.now
            if isinstance(item, Compute):
                # a share of a layer's time does not shrink with the part (Python, the
                # operators' fixed costs): as with the batch, `ModelCost.fixed_fraction`
                whole = sum(item.flops)
                seconds = [price * (fixed * whole + (1 - fixed) * f) for f in item.flops]
                jobs = [env.process(self._worker_compute(r, t)) for r, t in enumerate(seconds)]
            elif not item.pairs:
                continue  # an exchange without peers skips the collective on every worker
            else:
                yield from self.clock.wake(max(item.pairs.values()), "exchange")
                kind = f"exchange {item.exchange.name}"
                if self.cal.exchange is not None:
                    jobs = [env.process(self._exchange(r, item, kind)) for r in range(self.workers)]
                else:
                    pieces = item.pairs.items()
                    jobs = [env.process(self._piece(i, j, n, kind)) for (i, j), n in pieces]
            yield env.all_of(jobs)
            if isinstance(item, Compute):
                self.compute_s += env.now - start
            else:
                self.clock.ended()
                self.exchange_s += env.now - start

    def run(self) -> Result:
        steps = self.setting.steps or self.train.steps or 1
        num_stacks = self.schedule.num_stacks
        stack_s, eval_s = [], []
        for index in range(num_stacks):
            start = self.env.now
            self.cluster.run(until=self.env.process(self._step(index)))
            stack_s.append(self.env.now - start)
        elapsed = self.env.now
        roles = {  # of the steps (the machines' cores and links: of the evaluations too)
            "worker compute": self.compute_s / elapsed,
            "exchanges": self.exchange_s / elapsed,
        }
        for index in range(num_stacks):
            start = self.env.now
            self.cluster.run(until=self.env.process(self._evaluation(index)))
            eval_s.append(self.env.now - start)
        # the driver's cadence: evaluations and checkpoints between the chunks (the last ones
        # come after the last metrics line's stamp); a chunk never crosses a stack's end
        boundaries = [steps * (k + 1) for k in range(num_stacks)]
        trained_s = run_s = 0.0
        step = 0
        for chunk, evaluating, saving in driver_chunks(num_stacks * steps, self.train, boundaries):
            index = step // steps
            step += chunk
            trained_s = run_s = run_s + chunk * stack_s[index]
            run_s += (eval_s[index] if evaluating else 0.0) + (
                self._checkpoint_s() if saving else 0.0
            )
        batch = self.train.batch_size
        result = Result.of_run(
            self.cluster,
            roles,
            steps=steps * num_stacks,
            examples=steps * num_stacks * batch,
            step_s=sum(stack_s) / num_stacks,
            steady_examples_per_s=None,
            extra={
                "grid": list(self.schedule.grid),
                "stack_step_s": stack_s,
                "stack_eval_s": eval_s,
                "stack_exchange_bytes": [
                    self.schedule.bytes_per_step(k) for k in range(num_stacks)
                ],
                "stack_flops": [self.schedule.step_flops(k) for k in range(num_stacks)],
            },
            trained_s=trained_s,
        )
        return replace(result, run_s=run_s)

    def _checkpoint_s(self) -> float:
        """Rank 0 gathers the whole replica and writes it with its optimizer's state."""
        numel = self.cost.num_parameters if self.cost else sum(map(sum, self.schedule.own_numel))
        return checkpoint_bytes(numel, self.train.optimizer) / self.cal.checkpoint_bytes_per_s
