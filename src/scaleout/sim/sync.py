"""Strategy "sync" (`scaleout.strategies.sync`) as a simulation, and the ring collectives.

What runs, as the library runs it (`Lockstep` driver, `Worker.train`):

- the driver hands every worker the same chunk of steps, up to the next metrics line,
  evaluation or checkpoint (`driver_chunks`); a chunk's call and answer cost a Ray call;
- a step: every worker computes forward and backward on its slice of `train.batch_size`
  (`batch // workers` examples, `ModelCost.step_s` at `run.num_threads` threads; backward
  is the measured `ModelCost.backward_fraction` of it, else `BACKWARD_FRACTION`);
- loading (`ModelCost.load_s` per example, within the step's cost): with `loader.workers =
  0` the worker loads its slice itself before forward; otherwise a loader process on the
  worker's machine prepares the next slice while the step runs (Ding et al.'s parallel
  loading), keeping up to `loader.workers` cores busy, and the worker waits for it only
  when loading is the slower;
- mode "allreduce" (DDP): the gradient travels in DDP's buckets (`ddp_buckets`: from the
  tensors' sizes, as DDP rebuilds them after its first step: 1 MiB first, then at most
  `bucket_cap_mb` MiB, DDP's default 25; gradients come in reverse layer order, a bucket is
  ready when its share of backward is done). Each bucket is copied in, reduced as soon as
  every worker has it, one bucket after another, overlapping the rest of backward, then
  scaled and copied back (DDP's local work: `ModelCost.ddp_s`, measured, shared by size): a
  ring (`ring_allreduce`) for fp32; with `[compress] codec` other than fp32 the library's
  DDP hook instead encodes the bucket, all-gathers the packed codes (`ring_allgather`, bytes
  from `scaleout.compress.payload.layout`) and decodes every worker's payload; with
  `[compress] link` only where that is faster than the ring on the link, priced with the
  calibrated codec cost (`OnLink.encodes_allreduce`; a run decides by timing both between
  its workers instead). The optimizer step (`ModelCost.optimizer_s`) follows the last
  bucket;
- mode "average": every worker steps with its own optimizer; every `average_every` steps one
  fp32 ring all-reduce averages parameters and optimizer state (`4 * params * (1 + state
  floats per parameter)` bytes: sgd 0, momentum, adagrad and rmsprop 1, adam 2; floating
  buffers such as BatchNorm statistics are not counted); the flattening, scaling and
  copying back around it is priced from the measured two-process `average_tensors` less
  the measured all-reduce (`Calibration.average`);
- mode "fsdp": FSDP2's all-gathers and reduce-scatters per block (`scaleout.sim.sync_fsdp`);
- an evaluation runs on rank 0 (after averaging the weights in "average" mode; under
  "fsdp" on every worker); a checkpoint (after averaging in "average" mode; gathered under
  "fsdp") writes rank 0's model and optimizer.

Ring collectives: `ring_allreduce` is 2(N-1) steps, `ring_allgather` N-1; in each step
every rank sends one chunk to the next rank at once, and a step ends when all its sends have
ended. Between machines a send is `Cluster.send` (latency, then the chunk over the sender's
tx and the receiver's rx); between two ranks on one machine it is priced by the calibrated
gloo all-reduce of two processes (`Calibration.allreduce`: wall seconds and the
core-seconds of both processes, measured at the sizes a config reduces): a two-rank
all-reduce is two ring steps, so each rank's step takes half the calibrated seconds and
keeps a quarter of its core-seconds busy, and a two-rank ring on one machine takes exactly
the calibrated time on a quiet machine (longer when the cores are busy). The reduction's
arithmetic between machines is not priced. A collective after compute costs more than one
back to back (`CollectiveClock`: `Calibration.lockstep`, measured after that much compute).

Placement: `--machines 1` runs `sync.num_workers` workers on the one machine, sharing its
cores (slowed as calibrated when several compute at once). On N > 1 machines there is one
worker per machine, so N workers each on `batch // N` examples (N must divide the batch).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import simpy

from scaleout.compress.link import OnLink
from scaleout.compress.payload import layout
from scaleout.errors import ConfigError
from scaleout.nn.optim import state_buffers
from scaleout.sim.calibration import Calibration, MessageCost
from scaleout.sim.engine import Cluster, Process
from scaleout.sim.result import Result
from scaleout.sim.setting import Setting, model_cost
from scaleout.sim.wire import link_codec_speed

if TYPE_CHECKING:
    from scaleout.sim.sync_fsdp import ShardedStep

BACKWARD_FRACTION = 2 / 3  # of a training step unless measured; forward (and loading) the rest
BUCKET_CAP_MB = 25.0  # DDP's default bucket_cap_mb (MiB)
FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's first bucket (torch.distributed's default, 1 MiB)
STEADY_STEPS = 20  # simulated on N > 1 machines when the run itself is longer
EXACT_RING = 64  # rings of more ranks simulate one representative send per step


# --- ring collectives --------------------------------------------------------------------------


def ring_allreduce(
    cluster: Cluster,
    machines: Sequence[int],
    nbytes: int,
    calibration: Calibration | None = None,
    kind: str = "allreduce",
    exact: bool | None = None,
) -> Process:
    """All-reduce `nbytes` over ranks on `machines` (rank i on machine `machines[i]`) as a
    ring: 2(N-1) steps of `ceil(nbytes / N)` bytes from every rank to the next."""
    if nbytes < 0:
        raise ValueError(f"ring_allreduce: nbytes must be >= 0, got {nbytes}")
    n = len(machines)
    if n <= 1:
        return
    chunk = math.ceil(nbytes / n)
    yield from _ring(cluster, machines, chunk, 2 * (n - 1), calibration, kind, exact)


def ring_allgather(
    cluster: Cluster,
    machines: Sequence[int],
    nbytes_per_rank: int,
    calibration: Calibration | None = None,
    kind: str = "allreduce",
    exact: bool | None = None,
) -> Process:
    """All-gather `nbytes_per_rank` from every rank as a ring: N-1 steps of one rank's
    bytes from every rank to the next."""
    if nbytes_per_rank < 0:
        raise ValueError(f"ring_allgather: nbytes must be >= 0, got {nbytes_per_rank}")
    n = len(machines)
    if n <= 1:
        return
    yield from _ring(cluster, machines, nbytes_per_rank, n - 1, calibration, kind, exact)


def _ring(
    cluster: Cluster,
    machines: Sequence[int],
    chunk: int,
    steps: int,
    calibration: Calibration | None,
    kind: str,
    exact: bool | None,
) -> Process:
    """`steps` ring steps. `exact=False` (the default beyond `EXACT_RING` ranks on distinct
    machines) simulates one send per step and counts the others' bytes: the same time when
    nothing else uses those links, as every rank's send is then alike."""
    env, n = cluster.env, len(machines)
    distinct = len(set(machines)) == n
    if exact is None:
        exact = n <= EXACT_RING or not distinct
    if not exact and not distinct:
        raise ValueError("ring: exact=False needs every rank on its own machine")
    local = None
    if any(machines[i] == machines[(i + 1) % n] for i in range(n)):
        if calibration is None or calibration.allreduce is None:
            raise ConfigError(
                "the calibration has no gloo all-reduce between two processes: run "
                "`scaleout calibrate` again"
            )
        local = calibration.allreduce
    for _ in range(steps):
        if exact:
            sends = [
                env.process(
                    ring_send(cluster, machines[i], machines[(i + 1) % n], chunk, local, kind)
                )
                for i in range(n)
            ]
            yield env.all_of(sends)
        else:
            yield from cluster.send(machines[0], machines[1], chunk, kind)
            cluster.traffic.add(kind, chunk, remote=True, count=n - 1)  # the others' sends


def ring_send(
    cluster: Cluster, source: int, dest: int, nbytes: int, local: MessageCost | None, kind: str
) -> Process:
    """One rank's send of `nbytes` to the next: over the network between machines; within a
    machine, priced as a ring step of a calibrated two-process all-reduce."""
    yield from cluster.send(source, dest, nbytes, kind)
    if source == dest:  # half of a calibrated two-rank all-reduce of 2 * nbytes
        assert local is not None
        whole = 2 * nbytes
        seconds, cores = local.seconds(whole) / 2, local.cpu_s(whole) / 4  # per rank
        yield from cluster.machines[source].call(seconds, cores)


class CollectiveClock:
    """When lock-step workers' last collective ended. The next one, after `gap` seconds of
    compute, costs `Calibration.lockstep[kind].extra(gap, bytes)` more than back to back (the
    faster rank waits for the slower, gloo's threads wake up): measured by the calibration
    per kind of collective; a calibration without it (a hardware file) adds nothing."""

    def __init__(self, cluster: Cluster, calibration: Calibration, workers: int) -> None:
        self.env, self.cal, self.workers = cluster.env, calibration, workers
        self.last_end = 0.0

    def wake(self, nbytes: int, kind: str = "allreduce") -> Process:
        """Before a collective `kind` ("allreduce", "exchange") of `nbytes` (per rank)
        starts on every worker."""
        lockstep = self.cal.lockstep.get(kind)
        if lockstep is None or self.workers <= 1:
            return
        extra = lockstep.extra(self.env.now - self.last_end, nbytes)
        if extra > 0:
            yield self.env.timeout(extra)

    def ended(self) -> None:
        self.last_end = self.env.now


def ddp_buckets(
    numels: Sequence[int],
    cap_bytes: int = int(BUCKET_CAP_MB * 1024 * 1024),
    first_bytes: int = FIRST_BUCKET_BYTES,
) -> list[int]:
    """Values per DDP bucket, in the order they are reduced, for fp32 tensors of `numels`
    (registration order): DDP's rebuilt buckets (from the second step on) take tensors in
    the order their gradients become ready (the reverse, for a feed-forward model) and
    close a bucket once it holds at least `first_bytes`, then `cap_bytes`."""
    buckets, size, limit = [], 0, first_bytes
    for numel in reversed(numels):
        size += numel
        if 4 * size >= limit:
            buckets.append(size)
            size, limit = 0, cap_bytes
    if size:
        buckets.append(size)
    return buckets


# --- the driver's cadence --------------------------------------------------------------------


def checkpoint_bytes(numel: int, optimizer: str) -> int:
    """What a checkpoint writes of `numel` parameters: their values and their optimizer's
    parameter-sized buffers, fp32."""
    return 4 * numel * (1 + state_buffers(optimizer))


def driver_chunks(
    total: int,
    train: Any,  # noqa: ANN401
    boundaries: Sequence[int] = (),
) -> list[tuple[int, bool, bool]]:
    """(steps, evaluate after, checkpoint after) of each `strategy.train` call the driver
    makes (`scaleout.train.driver`): chunks end at metrics lines, evaluations, checkpoints
    and the phases' `boundaries` (a layer-wise model's: each phase's end evaluates and
    checkpoints); the last one evaluates and checkpoints."""
    chunks, step = [], 0
    cadence = [train.log_every, train.eval_every, train.checkpoint_every]
    while step < total:
        target = min([(step // every + 1) * every for every in cadence] + [total])
        target = min([target] + [b for b in boundaries if b > step])
        last, phase_end = target >= total, target in boundaries
        evaluating = target // train.eval_every > step // train.eval_every or last or phase_end
        saving = (
            target // train.checkpoint_every > step // train.checkpoint_every or last or phase_end
        )
        chunks.append((target - step, evaluating, saving))
        step = target
    return chunks


class LockstepSim:
    """What the simulations of lock-step workers share (`SyncSim`, `scaleout.sim.pipeline`):
    the driver's chunks of steps, evaluations and checkpoints, the run and its result.
    Subclasses give `_step`, `_evaluate`, `_checkpoint` and `extra`, and set `env`,
    `cluster`, `cal`, `train`, `cost`, `setting` and `compute_s`."""

    env: simpy.Environment
    cluster: Cluster
    cal: Calibration
    train: Any
    cost: Any
    setting: Setting
    compute_s: list[float]
    train_s: float = 0.0  # time spent in training chunks (no evaluation, no checkpoint)
    trained_s: float = 0.0  # when the last training chunk was answered

    def _step(self) -> Process:
        raise NotImplementedError

    def _evaluate(self) -> Process:
        raise NotImplementedError

    def _checkpoint(self) -> Process:
        raise NotImplementedError

    def extra(self) -> dict[str, Any]:
        return {}

    def _chunk(self, steps: int) -> Process:
        started = self.env.now
        yield self.env.timeout(self.cal.pull.fixed_s)  # the call to every worker
        for _ in range(steps):
            yield from self._step()
        yield self.env.timeout(self.cal.pull.fixed_s)  # the answers
        self.train_s += self.env.now - started

    def _driver(self, total: int) -> Process:
        for steps, evaluating, saving in driver_chunks(total, self.train):
            yield from self._chunk(steps)
            self.trained_s = self.env.now  # the metrics line's stamp, before evaluating
            if evaluating:
                yield from self._evaluate()
            if saving:
                yield from self._checkpoint()

    def total_steps(self) -> int:
        if self.setting.steps is not None:
            return self.setting.steps
        size, batch = self.cost.train_size, self.train.batch_size
        if self.train.steps is None and size <= 0:
            return STEADY_STEPS
        run = self.train.total_steps(size // batch if size >= batch else 1)
        return run if self.setting.machines == 1 else min(run, STEADY_STEPS)

    def run(self) -> Result:
        total = self.total_steps()
        if total < 1:
            raise ConfigError(f"steps to simulate must be >= 1, got {total}")
        driver = self.env.process(self._driver(total))
        self.env.run(until=driver)
        return self._result(total)

    def _result(self, total: int) -> Result:
        elapsed = self.env.now
        examples = total * self.train.batch_size
        roles = {"worker compute": statistics.mean(c / elapsed for c in self.compute_s)}
        return Result.of_run(
            self.cluster,
            roles,
            steps=total,
            examples=examples,
            step_s=elapsed / total,
            steady_examples_per_s=examples / self.train_s if self.train_s > 0 else None,
            trained_s=self.trained_s,
            extra=self.extra(),
        )


class SyncSim(LockstepSim):
    """One simulated sync run of `config` (a `RunConfig`) in `setting`."""

    def __init__(
        self,
        config: Any,  # noqa: ANN401
        setting: Setting,
        bucket_cap_mb: float = BUCKET_CAP_MB,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.config, self.setting = config, setting
        self.cal = setting.calibration
        self.opts = config.sync
        self.train = config.train
        self.cost = model_cost(config, self.cal)
        self.threads = config.run.num_threads or 1
        machines = setting.machines
        self.num_workers = self.opts.num_workers if machines == 1 else machines
        if self.train.batch_size % self.num_workers:
            where = "sync.num_workers" if machines == 1 else "--machines (one worker each)"
            raise ConfigError(
                f"train.batch_size = {self.train.batch_size} must be a multiple of {where} = "
                f"{self.num_workers} (each worker trains on an equal slice of the batch)"
            )
        self.cluster = setting.cluster()
        for machine in self.cluster.machines:
            machine.cores.slowdown = self.cost.slowdown
        self.env = self.cluster.env
        self.clock = CollectiveClock(self.cluster, self.cal, self.num_workers)
        self.where = [w % machines for w in range(self.num_workers)]
        self.numel = self.cost.num_parameters
        self.step_s = self.cost.step_s(self.train.batch_size // self.num_workers, self.threads)
        self.backward_s = self.step_s * (self.cost.backward_fraction or BACKWARD_FRACTION)
        self.loader_workers = config.loader.workers
        # the slice's loading, part of step_s; done beside the step by a loader process
        self.load_s = self.cost.load_s * (self.train.batch_size // self.num_workers)
        self.load_s = min(self.load_s, self.step_s - self.backward_s)
        self.loading: list[simpy.Process | None] = [None] * self.num_workers
        compress = config.compress
        self.codec = compress.codec
        self.block_size = compress.block_size or 0
        # on a `compress.link`: the hook's choice of raw or 8-bit
        codec = compress.build_for_collectives(link_codec_speed(self.cal, compress))
        self.on_link = codec if isinstance(codec, OnLink) else None
        cap = int(bucket_cap_mb * 1024 * 1024)
        if self.cost.parameter_numels:
            self.buckets = ddp_buckets(self.cost.parameter_numels, cap)
        else:  # tensor sizes not calibrated: equal buckets of at most the cap
            num_buckets = max(1, math.ceil(4 * self.numel / cap))
            base, extra = divmod(self.numel, num_buckets)
            self.buckets = [base + (1 if b < extra else 0) for b in range(num_buckets)]
        self.state_bytes = checkpoint_bytes(self.numel, self.train.optimizer)
        self.compute_s = [0.0] * self.num_workers
        self.exposed: list[float] = []  # per step: from backward's end to the last bucket's
        self.train_s = self.trained_s = 0.0
        self.step = 0
        self.sharded: ShardedStep | None = None
        if self.opts.mode == "fsdp" and self.num_workers > 1:
            from scaleout.sim.sync_fsdp import ShardedStep, fsdp_units  # (it imports the rings)

            self.sharded = ShardedStep(self, fsdp_units(config, self.num_workers))

    # --- collectives ---------------------------------------------------------------------

    def _allreduce(self, nbytes: int) -> Process:
        yield from self.clock.wake(nbytes)
        yield from ring_allreduce(self.cluster, self.where, nbytes, self.cal)
        self.clock.ended()

    def _allgather(self, nbytes: int) -> Process:
        """Every worker's `nbytes` to every other (a reduce-scatter moves the same)."""
        yield from self.clock.wake(nbytes)
        yield from ring_allgather(self.cluster, self.where, nbytes, self.cal)
        self.clock.ended()

    def _on_every_worker(self, seconds: float) -> Process:
        """`seconds` of one thread's work on every worker at once, until all are done."""
        env, machines = self.env, self.cluster.machines
        yield env.all_of([env.process(machines[m].work(seconds)) for m in self.where])

    def _bucket_copies(self, numel: int) -> Process:
        """Half of DDP's local work on a bucket (gradients copied in; or the average
        scaled and copied back): its share of the calibrated `ddp_s`, else priced as
        `average_tensors`' local work."""
        if self.cost.ddp_s is not None:
            seconds = self.cost.ddp_s * numel / self.numel / 2
        else:
            seconds = 4 * numel / self.cal.flatten_bytes_per_s / 2
        yield from self._on_every_worker(seconds)

    def _reduce_bucket(self, numel: int) -> Process:
        """One DDP bucket: copied in, a ring all-reduce (fp32) or the codec hook's
        all-gather, scaled and copied back (one worker has no DDP)."""
        if self.num_workers == 1:
            return
        yield from self._bucket_copies(numel)
        yield from self._reduce_codes(numel)
        yield from self._bucket_copies(numel)

    def _encodes(self, numel: int) -> bool:
        """Whether the hook sends a bucket of `numel` values 8-bit (`ddp_hook`'s choice)."""
        if self.codec == "fp32":
            return False
        if self.on_link is not None:
            return self.on_link.encodes_allreduce(numel, self.num_workers)
        return True

    def _reduce_codes(self, numel: int) -> Process:
        if not self._encodes(numel):
            yield from self._allreduce(4 * numel)
            return
        yield from self._on_every_worker(self.cal.codec_s(self.codec, numel, "encode"))
        codes, scales = layout(self.codec, numel, self.block_size)
        packed = codes + 4 * scales + 1  # `pack`: codes, scales, a flag byte
        yield from self._allgather(packed)
        decode = self.num_workers * self.cal.codec_s(self.codec, numel, "decode")
        yield from self._on_every_worker(decode)

    # --- one step ------------------------------------------------------------------------

    def _compute(self, worker: int, seconds: float) -> Process:
        started = self.env.now
        yield from self.cluster.machines[self.where[worker]].compute(seconds, self.threads)
        self.compute_s[worker] += self.env.now - started

    def _next_slice(self, worker: int) -> Process:
        """Wait for the worker's slice of the batch from its loader process, which then
        starts on the next one; the seconds of forward left to compute (loading is a part
        of forward's calibrated cost)."""
        forward = self.step_s - self.backward_s
        if self.loader_workers == 0 or self.load_s <= 0:
            return forward
        cores = self.cluster.machines[self.where[worker]].cores
        load = lambda: cores.run(self.load_s, self.loader_workers)  # noqa: E731
        loading = self.loading[worker] or self.env.process(load())
        yield loading
        self.loading[worker] = self.env.process(load())
        return forward - self.load_s

    def _worker_pass(self, worker: int, ready: list[list[simpy.Event]]) -> Process:
        """Forward, then backward bucket by bucket (each ready when its share is done)."""
        forward = yield from self._next_slice(worker)
        yield from self._compute(worker, forward)
        backward = self.backward_s
        for b, numel in enumerate(self.buckets):
            yield from self._compute(worker, backward * numel / self.numel)
            ready[b][worker].succeed()

    def _whole_step(self, worker: int) -> Process:
        """Forward and backward without buckets (mode "average")."""
        forward = yield from self._next_slice(worker)
        yield from self._compute(worker, forward + self.backward_s)

    def _communicate(self, ready: list[list[simpy.Event]]) -> Process:
        for b, numel in enumerate(self.buckets):
            yield self.env.all_of(ready[b])
            yield from self._reduce_bucket(numel)

    def _optimizer(self) -> Process:
        yield from self._on_every_worker(self.cost.optimizer_s)

    def _step(self) -> Process:
        env = self.env
        if self.sharded is not None:
            yield from self.sharded.step()
        elif self.opts.mode in ("allreduce", "fsdp"):  # (fsdp on one worker: a plain step)
            ready = [[env.event() for _ in self.where] for _ in self.buckets]
            passes = [env.process(self._worker_pass(w, ready)) for w in range(self.num_workers)]
            comm = env.process(self._communicate(ready))
            yield env.all_of(passes)
            computed = env.now
            yield comm
            self.exposed.append(env.now - computed)
            yield from self._optimizer()
        else:
            yield env.all_of([env.process(self._whole_step(w)) for w in range(self.num_workers)])
            yield from self._optimizer()
            if (self.step + 1) % self.opts.average_every == 0:
                averaging = env.now
                yield from self._average(self.state_bytes)
                self.exposed.append(env.now - averaging)
        self.step += 1

    # --- the driver ----------------------------------------------------------------------

    def _average_local_s(self, nbytes: int) -> float:
        """A worker's local work in `average_tensors` of `nbytes` (flatten, scale, copy
        back): the measured two-process average less the measured all-reduce (both ranks
        copying at once, as they do), else one process's flattening alone."""
        average, allreduce = self.cal.average, self.cal.allreduce
        if average is not None and allreduce is not None:
            return max(average.seconds(nbytes) - allreduce.seconds(nbytes), 0.0)
        return nbytes / self.cal.flatten_bytes_per_s

    def _average(self, nbytes: int) -> Process:
        """`average_tensors`: every worker flattens its tensors, the flat copy is
        all-reduced, then scaled and copied back (local work on each worker's cores); one
        worker has nothing to average."""
        if self.num_workers == 1:
            return
        half = self._average_local_s(nbytes) / 2
        yield from self._on_every_worker(half)
        yield from self._allreduce(nbytes)
        yield from self._on_every_worker(half)

    def _evaluate(self) -> Process:
        if self.sharded is not None:
            cost = self.cost
            batch = self.train.eval_batch_size
            yield from self.sharded.evaluate(cost.test_size, batch, cost.eval_s)
            return
        if self.opts.mode == "average":  # the workers' average weights, then rank 0 tests
            yield from self._average(4 * self.numel)
        seconds = self.cost.test_size * self.cost.eval_s
        yield from self.cluster.machines[self.where[0]].compute(seconds, self.threads)

    def _checkpoint(self) -> Process:
        if self.opts.mode == "average":  # `average_now` before rank 0's state
            yield from self._average(self.state_bytes)
        if self.sharded is not None:  # the full state gathered onto rank 0
            yield from self.sharded.gather_all()
        yield self.env.timeout(self.state_bytes / self.cal.checkpoint_bytes_per_s)

    def extra(self) -> dict[str, Any]:
        return {
            "workers": self.num_workers,
            "mode": self.opts.mode,
            "buckets": len(self.buckets),
            "exposed_communication_s": statistics.mean(self.exposed) if self.exposed else 0.0,
        }
