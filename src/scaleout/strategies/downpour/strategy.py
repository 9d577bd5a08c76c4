"""Strategy "downpour": Downpour SGD (DistBelief section 4.1) on Ray.

The parameters live on parameter-server shards (`scaleout.ps`): each shard applies the
configured torch.optim optimizer to its slice (Adagrad in the paper). R replicas, each owning
a disjoint part of the training data (every R-th example), fetch parameters every `n_fetch`
steps and push accumulated gradients every `n_push` steps, straight to the shards
(`ReplicaClient`). The strategy only hands out chunks of steps to whichever replicas are
free, collects their per-push records (`pushes.jsonl`), and restarts what dies.

A replica is one worker, a model-parallel grid (`model_parallel.grid` with more than one
worker, a `SparseAutoencoderNetwork`) or a pipeline (`model_parallel.stages`): worker w of
every replica pulls from and pushes to the shards that hold worker w's part of the
parameters (a grid's rank 0 keeps its replicated parameters, alpha, on shards of their own;
a pipeline's stages hold disjoint parts, and clip the whole replica's gradient together).
Each parameter group is a separate set of shards, stepping with its group's learning rate.

Layer-wise models (the sparse autoencoder) train phase by phase: at each phase's start,
replica 0 fits the phase's start on its first minibatch and its values start the phase's
shards; at the phase's end every replica pushes what is left and adopts the final values,
so the frozen layers are the same everywhere.

Asynchrony (`docs/asynchrony.md`): `downpour.mode = "diloco"` has each replica step
`train.optimizer` itself and push the change of its parameters every `n_push` steps, on
which the shards step an outer optimizer (`scaleout.ps.outer`); `downpour.staleness_rule`
changes a late push where the shards apply it, and `downpour.max_staleness` has replicas
wait before a fetch so that no push lands later than that (`scaleout.ps.staleness`). Every
run draws `staleness.png` from its push records.

Steps are global: one step is one minibatch on any replica, and `train.steps` /
`train.epochs` count them over all replicas (an epoch is one pass over the whole training
set). Warm start: only replica 0 trains until `warmstart_steps` steps are done. Buffers
(e.g. BatchNorm statistics) are not on the shards: each replica keeps its own, and
evaluation and checkpoints use replica 0's (it evaluates the shards' current parameters).

Failures: a one-worker replica that dies (killed process, exception) is logged and restarted
where it stopped in its data, up to `max_restarts` times, while the others go on; a grid
replica's failure stops the run. A shard that dies is restarted by Ray from its last
checkpoint. The run ends with a summary of failures and of the work lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import ray
from ray.exceptions import RayActorError, RayTaskError

from scaleout.checkpoint import OptimizerState, optimizer_part
from scaleout.data import num_batches
from scaleout.errors import ConfigError, UserError
from scaleout.metrics import truncate_metrics
from scaleout.nn.optim import is_factory
from scaleout.progress import console
from scaleout.rundir import RunDir
from scaleout.runtime import cpu_share
from scaleout.strategies.downpour import DownpourSection
from scaleout.strategies.downpour.checks import (
    check_asynchrony,
    check_elastic,
    check_replica_steps,
)
from scaleout.strategies.downpour.phase_shards import PhaseShards
from scaleout.strategies.downpour.positions import data_progress, rescaled
from scaleout.strategies.downpour.pushes import PUSHES_FILE, Pushes
from scaleout.strategies.downpour.replicas import Replica, placement
from scaleout.strategies.downpour.scaling import ReplicaScaling
from scaleout.strategies.downpour.staleness_plot import STALENESS_PLOT, plot_staleness
from scaleout.strategies.layout import (
    ModelParallelSection,
    check_partitionable,
    check_pipeline,
)
from scaleout.strategies.worker import Worker, WorkerChunk
from scaleout.train.job import Job
from scaleout.train.protocol import Chunk, Plan, Resume, Tensors
from scaleout.train.step import schedule_for

CHUNK_STEPS = 20  # most steps handed to a replica at once


class Downpour(ReplicaScaling):
    name = "downpour"
    restartable = False  # it heals its own workers; a failure it cannot heal ends the run

    def __init__(self, job: Job) -> None:
        self.job, self.cfg = job, job.train
        self.opts = job.section("downpour", DownpourSection)
        grid = job.section("model_parallel", ModelParallelSection)
        if grid.tensor > 1:
            raise ConfigError(
                f"model_parallel.tensor = {grid.tensor} with Downpour: a replica may be a grid "
                'or a pipeline (model_parallel.stages); use train.strategy = "model_parallel" '
                "for tensor-parallel layers"
            )
        self.grid = grid if grid.num_workers > 1 else None  # each replica a grid or pipeline
        check_elastic(self.opts, self.grid is not None)
        if grid.stages > 1:
            check_pipeline(job, grid, tied=False)
        elif self.grid is not None:
            check_partitionable(job, self.name, grid.grid)
        if self.grid is not None and self.opts.threads is True:
            raise ConfigError(
                "downpour.threads = true needs replicas of one worker: a model-parallel "
                "replica's workers fetch and push in step; set model_parallel.grid = [1, 1] "
                "and model_parallel.stages = 1, or downpour.threads = false"
            )
        probe = job.probe
        if (
            probe is not None
            and not probe.layerwise
            and self.opts.num_shards > probe.num_parameters
        ):
            raise ConfigError(
                f"downpour.num_shards = {self.opts.num_shards} exceeds the model's "
                f"{probe.num_parameters} parameters: use at most {probe.num_parameters}"
            )
        if probe is not None and probe.train_size < self.opts.num_replicas:
            raise ConfigError(
                f"downpour.num_replicas = {self.opts.num_replicas}: the training set has "
                f"{probe.train_size} examples, and each replica trains on a part of its own; "
                f"use at most {probe.train_size} replicas or more data"
            )
        check_replica_steps(job, self.grid is not None and grid.stages == 1)
        check_asynchrony(self.opts, self.grid is not None)
        self.run = RunDir(job.run_dir)
        num = self.opts.num_replicas
        self.positions: list[dict[str, int] | None] = [None] * num
        self.failures: list[dict[str, Any]] = []
        self.restarts = [0] * num
        self.steps_lost = self.shard_updates_lost = 0
        self.replicas: list[Replica] = []
        self.alive = [True] * num
        self.shards = PhaseShards(job, self.opts, self.run)
        self.threads: bool | Literal["auto"] = False  # decided in `start`, on the cluster
        self.phase = -1
        self.step = self.assigned = self.examples = 0
        self.in_flight: dict[int, tuple[list[Any], int]] = {}  # replica -> (futures, steps)
        self.submitted_at: dict[int, float] = {}  # replica -> when its chunk started
        self.starting: dict[int, list[Any]] = {}  # restarted replica -> what it waits for
        self.placement: dict[str, list[str]] = {}
        self.weights: Tensors | None = None  # layer-wise: the whole model at the phase's start
        self.inner: OptimizerState | None = None  # DiLoCo: the replicas' optimizer, last checkpoint
        self.pushes: Pushes | None = None
        self._plan: Plan | None = None
        self.inner_schedule = None
        self._wall_start = time.time()
        self._reported = time.perf_counter()
        self._init_scaling()

    @property
    def count(self) -> int:
        """The replicas the run has now: `num_replicas`, or what it was scaled to."""
        return len(self.positions)

    @property
    def outer_scale(self) -> float:
        """DiLoCo: each push is 1/R of a round's mean (gradient pushes ignore it)."""
        return 1.0 / self.count

    # --- plan and start --------------------------------------------------------------------

    def plan(self) -> Plan:
        probe = self.job.probe
        assert probe is not None
        per_epoch = num_batches(probe.train_size, self.cfg.batch_size, drop_last=True)
        per_phase = self.cfg.total_steps(per_epoch)
        if not probe.layerwise:
            self._plan = Plan(per_phase, per_epoch)
        else:
            self._plan = Plan(per_phase * probe.num_phases, per_epoch, probe.num_phases, per_phase)
        # the shards' learning rate: Adagrad's default warm-up is 200 updates of n_push steps
        self.schedule = schedule_for(self.cfg, per_phase, steps_per_update=self.opts.n_push)
        # DiLoCo's replicas step train.optimizer themselves, at the rate of each global step
        self.inner_schedule = (
            schedule_for(self.cfg, per_phase) if self.opts.mode == "diloco" else None
        )
        return self._plan

    def _phase_of(self, step: int) -> int:
        assert self._plan is not None
        phase_steps = self._plan.phase_steps
        return min(step // phase_steps, self._plan.num_phases - 1) if phase_steps else 0

    def _phase_end(self) -> int:
        assert self._plan is not None
        if self._plan.phase_steps is None:
            return self._plan.total_steps
        return min((self.phase + 1) * self._plan.phase_steps, self._plan.total_steps)

    def _where(self) -> str:
        return self.run.stopped_at(self.step)

    def start(self, resume: Resume | None) -> dict[str, Any]:
        elapsed = 0.0
        if resume is not None:
            self._restore(resume)
            elapsed = resume.meta["time_s"]
            if self.opts.mode == "diloco":
                self.inner = optimizer_part(resume.tensors, resume.meta)
                if self.inner is None:
                    console.print(
                        f"{resume.path.name} holds no replica optimizer state (written with "
                        f"gradient pushes): the replicas start a fresh {self.job.train.optimizer}"
                    )
        self._wall_start = time.time() - elapsed
        self.pushes = Pushes(self.run.path / PUSHES_FILE, self._wall_start)
        workers = self.grid.num_workers if self.grid is not None else 1
        self.shards.size(workers)  # fail now if they cannot fit; backups or not
        self.threads = self.opts.replica_threads(
            workers,
            self.job.run.num_threads,
            ray.cluster_resources().get("CPU", 0.0),
            len(ray.nodes()),
        )
        self.replica_cpus = cpu_share(self.opts.num_replicas * workers)
        self.replicas = [self._spawn(r) for r in range(self.opts.num_replicas)]
        for replica_id in range(self.opts.num_replicas):
            self._wait_started(replica_id)  # built, with its data
        if resume is not None:  # every replica's frozen layers, and shards without a
            self.weights = resume.tensors  # checkpoint of their own, start from it
            self._load_weights(self.replicas, str(resume.path))
        self._begin_phase(self._phase_of(self.step), fresh=self._at_phase_start())
        if resume is not None:
            self._say_which_shards_restored(resume)
        self.placement = placement(self.replicas, self.shards)
        self._reported = time.perf_counter()
        return {}

    def _say_which_shards_restored(self, resume: Resume) -> None:
        """A shard without a checkpoint of its own (deleted, or on a disk that was lost)
        starts from the driver's checkpoint: its weights, but a fresh optimizer state."""
        fresh = [
            f"{info['shard']}"
            for _, server in self.shards.all()
            for info in server.info()
            if info["restored_version"] is None
        ]
        if fresh:
            console.print(
                f"shards {', '.join(fresh)} have no checkpoint of their own: they start from "
                f"the weights in {resume.path.name} with a fresh {self.job.train.optimizer} "
                "state"
            )

    def _at_phase_start(self) -> bool:
        assert self._plan is not None
        phase_steps = self._plan.phase_steps
        return self.step % phase_steps == 0 if phase_steps else self.step == 0

    def _restore(self, resume: Resume) -> None:
        meta = resume.meta
        if meta.get("strategy") != self.name:
            raise UserError(
                f"{resume.path} is a {meta.get('strategy')} checkpoint, not a Downpour one: "
                "resume it with the strategy that wrote it"
            )
        self.step = self.assigned = resume.step
        self.examples = meta["examples"]
        saved = meta.get("positions", [])
        if len(saved) == len(self.positions):
            self.positions = saved
        elif saved:  # another replica count: new parts of the data, at the run's place in it
            probe = self.job.probe
            assert probe is not None
            size, batch = probe.train_size, self.cfg.batch_size
            phase = self._phase_of(resume.step)
            self.positions = rescaled(saved, len(self.positions), size, batch, resume.step, phase)
            console.print(
                f"{resume.path.name} was written by {len(saved)} replicas; {len(self.positions)} "
                f"go on, each in its new part of the training set at epoch "
                f"{data_progress(saved, size, batch):.2f}"
            )
        self.failures, self.steps_lost = meta["failures"], meta["steps_lost"]
        self.shard_updates_lost = meta["shard_updates_lost"]
        self.events = meta.get("scaling", [])
        truncate_metrics(self.run.path / PUSHES_FILE, self.step)

    def _spawn(self, replica_id: int, most_cpus: float | None = None) -> Replica:
        """Start replica `replica_id` with its share of CPUs (at most `most_cpus`)."""
        cpus = self.replica_cpus if most_cpus is None else min(self.replica_cpus, most_cpus)
        return Replica(
            self.job,
            replica_id,
            self.count,
            self.grid,
            self.positions[replica_id],
            cpus,
            self.opts.replica_resource,
            self._where,
            self.inner_schedule,
        )

    def _load_weights(self, replicas: list[Replica], source: str) -> None:
        pending = [(r, r.submit(Worker.load_weights, self.weights, source)) for r in replicas]
        for replica, futures in pending:
            replica.get(futures, "loading weights")

    # --- phases: the shards of the parameters in training ----------------------------------

    def _begin_phase(self, phase: int, fresh: bool) -> None:
        """Start phase `phase`'s shards from replica 0's values; attach every replica."""
        self.shards.retire()
        self.phase = phase
        assert self._plan is not None
        if self._plan.phase_steps and phase > 0 and fresh:  # for replicas restarted later
            self.weights = self._ask_first_alive(Worker.state, doing="starting a phase")[0][0]
        initial = self._ask_first_alive(Worker.begin_phase, phase, fresh, doing="starting a phase")
        if fresh:  # DiLoCo: a new phase's parameters start a fresh optimizer
            self.inner = None
        phase_start = phase * self._plan.phase_steps if self._plan.phase_steps else 0
        self.shards.start(phase, initial, self.schedule, 0 if fresh else self.step - phase_start)
        attach = [
            (r, replica.submit_each(Worker.attach, self._attach_args(replica, fresh, self.inner)))
            for r, replica in enumerate(self.replicas)
            if self.alive[r]
        ]
        for r, futures in attach:
            self.replicas[r].get(futures, "attaching to the shards")

    def _attach_args(
        self, replica: Replica, fresh: bool, inner: OptimizerState | None = None
    ) -> list[tuple[Any, ...]]:
        """What each of `replica`'s workers attaches with; `inner`: DiLoCo's optimizer state
        for its replica to start from."""
        opts = self.opts
        bounded = opts.max_staleness is not None
        outer_scale = self.outer_scale
        return [
            (
                self.phase,
                self.shards.for_worker(w),
                opts.n_fetch,
                opts.n_push,
                self.threads,
                fresh,
                opts.mode,
                bounded,
                outer_scale,
                inner,
            )
            for w in range(replica.size)
        ]

    def _finish_phase(self) -> None:
        """Every replica pushes what is left; once all pushes are in, every replica adopts
        the shards' final values (so the frozen layers are the same everywhere)."""
        self._settle_starting(wait=True)
        live = [r for r in range(len(self.replicas)) if self.alive[r]]
        for method in (Worker.flush_pushes, Worker.adopt_final):
            futures = {r: self.replicas[r].submit(method) for r in live}
            for r, pending in futures.items():
                try:
                    outs = self.replicas[r].get(pending, "flushing its pushes")
                except (RayActorError, RayTaskError):
                    continue  # its last pushes are lost; the shards keep what arrived
                if method is Worker.flush_pushes:
                    for records in outs:
                        self._log_pushes(records)

    def _check_shards(self) -> None:
        """Count shards that failed over to their backup or that Ray restarted (the updates
        they lost are counted by the replicas that had them acknowledged)."""
        self.failures += self.shards.restarts(self.step, self._wall_start)

    # --- training: chunks to whichever replicas are free -----------------------------------

    def _active(self) -> list[int]:
        ready = [r for r in range(len(self.replicas)) if self.alive[r] and r not in self.starting]
        if self.step < self.opts.warmstart_steps:  # the first replica alive trains alone
            first = next(r for r in range(len(self.replicas)) if self.alive[r])
            return [r for r in ready if r == first]
        return ready

    def _submit(self, replica_id: int, target: int, limit: int) -> None:
        """Hand a chunk to a free replica: up to `target` first (the next metrics line is
        exactly there when one replica runs), then on up to `limit`."""
        end = target if self.assigned < target else limit
        steps = min(max(1, min(self.cfg.log_every, CHUNK_STEPS)), end - self.assigned)
        if steps <= 0 or replica_id in self.in_flight or not self.alive[replica_id]:
            return
        futures = self.replicas[replica_id].submit(Worker.train, steps)
        self.in_flight[replica_id] = (futures, steps)
        self.submitted_at[replica_id] = time.monotonic()
        self.assigned += steps

    def train(self, num_steps: int, stop: Callable[[], bool]) -> Chunk:
        phase = self._phase_of(self.step)
        if phase != self.phase:
            self._finish_phase()
            self._begin_phase(phase, fresh=True)
        # One replica alone stops exactly at an evaluation or a checkpoint (replica 0 answers
        # those, so the run is strategy "single"'s step for step); several run on past them,
        # as Downpour's replicas never wait for one another: replica 0 answers after its chunk.
        cfg = self.cfg
        phase_end = limit = self._phase_end()
        if len(self._active()) == 1:
            limit = min(
                limit,
                (self.step // cfg.eval_every + 1) * cfg.eval_every,
                (self.step // cfg.checkpoint_every + 1) * cfg.checkpoint_every,
            )
        target = min(self.step + num_steps, limit)
        chunk = Chunk()
        while True:
            if not stop():
                self._look_at_scaling(chunk)
                for r in self._active():
                    self._submit(r, target, limit)
            if self.step >= target and (self.step < limit or not self.in_flight):
                break
            if not self.in_flight and not self.starting:
                break  # nothing left to run: every replica failed for good, or stopped
            self._wait_one(chunk)
        if self.step >= phase_end and self._plan is not None and self._plan.phase_steps:
            self._finish_phase()  # the phase ends: evaluations see its final values
        now = time.perf_counter()
        chunk.seconds, self._reported = now - self._reported, now
        return chunk

    def _wait_one(self, chunk: Chunk) -> None:
        """Wait for one replica's chunk to finish and take its result into `chunk`."""
        owner = {f: r for r, (futures, _) in self.in_flight.items() for f in futures}
        starting = [f for futures in self.starting.values() for f in futures]
        ready, _ = ray.wait(list(owner) + starting, num_returns=1, timeout=1.0)
        self._settle_starting(wait=False)
        self._watch()
        for future in ready:
            replica_id = owner.get(future)
            if replica_id is None or replica_id not in self.in_flight:
                continue
            futures, steps = self.in_flight[replica_id]
            done, _ = ray.wait(futures, num_returns=len(futures), timeout=0)
            if len(done) < len(futures):
                continue
            del self.in_flight[replica_id]
            try:
                outs = self.replicas[replica_id].get(futures, "training")
            except (RayActorError, RayTaskError) as error:
                self._replica_failed(replica_id, steps, error)
                continue
            self._take(replica_id, outs, chunk)

    def _take(self, replica_id: int, outs: list[WorkerChunk], chunk: Chunk) -> None:
        part = outs[0]  # a grid's sums are reduced over it
        self.step += part.steps
        self.examples += part.examples
        self.positions[replica_id] = part.position
        part.seconds = None  # replicas run at once: the call's wall time counts (`train`)
        for key in ("epoch", "data_wait_s", "lr"):  # one replica's, not the run's
            part.fields.pop(key, None)
        chunk.add(part)
        assert self.pushes is not None
        self.pushes.steps += part.steps
        for worker_out in outs:
            self._log_pushes(worker_out.records)

    def _log_pushes(self, records: list[dict[str, Any]]) -> None:
        assert self.pushes is not None
        self._first_pushes(records)
        self.shard_updates_lost += sum(r.get("updates_lost", 0) for r in records)
        self.pushes.log(records, self.step, self.examples, self._lr())

    def finish(self) -> Chunk:
        """Wait for the chunks still running; every replica pushes what is left."""
        chunk = Chunk()
        while self.in_flight:
            self._wait_one(chunk)
        self._settle_starting(wait=True)
        if self.shards.servers:
            self._finish_phase()
        return chunk

    # --- metrics, evaluation, checkpoints --------------------------------------------------

    def _lr(self) -> float | None:
        """The shards' learning rate at the current global step (None for a factory's
        optimizer, whose base rate the driver does not know)."""
        if is_factory(self.job.optimizer_options().optimizer):
            return None
        assert self._plan is not None
        phase_steps = self._plan.phase_steps
        step = self.step - self.phase * phase_steps if phase_steps else self.step
        return self.cfg.lr * self.schedule.factor(step)

    def metrics(self) -> dict[str, Any]:
        self._check_shards()
        assert self.pushes is not None
        fields = self.pushes.window(self.cfg.batch_size)
        fields["lr"] = self._lr()
        alive = sum(self.alive)
        fields["replicas_alive"] = alive
        fields["replicas"] = self.count
        bar = {
            "rate": f"{fields['updates_per_s']:.1f} upd/s",
            "alive": f"{alive}/{self.count} alive",
        }
        bar["changed"] = " ".join(self.window_events)  # joined (+r) and left (-r), or ""
        if self.window_events:  # since the last line
            fields["replicas_changed"] = self.window_events
            self.window_events = []
        fields["_bar"] = bar
        return fields

    def evaluate(self) -> dict[str, float]:
        # the first worker that measured: rank 0, or a pipeline's last stage
        answers = self._ask_first_alive(Worker.evaluate, doing="evaluating")
        return next(a for a in answers if a is not None)

    def state(self) -> tuple[Tensors, dict[str, Any]]:
        self.shards.checkpoint()
        tensors, meta = self._ask_first_alive(Worker.state, doing="checkpointing")[0]
        if self.opts.mode == "diloco":  # a replica restarted later starts from it at worst
            self.inner = optimizer_part(tensors, meta)
        meta.update(
            positions=self.positions,
            restarts=self.restarts,
            failures=self.failures,
            steps_lost=self.steps_lost,
            shard_updates_lost=self.shard_updates_lost,
            placement=self.placement,
            scaling=self.events,
        )
        return tensors, meta

    def summary(self) -> dict[str, Any]:
        return {
            "replica_failures": sum(1 for f in self.failures if "replica" in f),
            "replica_restarts": sum(self.restarts),
            "shard_restarts": sum(1 for f in self.failures if "shard" in f),
            "shard_backups": self.shards.backups,
            "steps_lost": self.steps_lost,
            "shard_updates_lost": self.shard_updates_lost,
            **self.scaling_summary(),
        }

    def close(self) -> None:
        """End this run's actors (on a shared cluster nothing else would)."""
        for replica in self.replicas:
            replica.kill()
        self.replicas = []
        self.shards.retire()
        if self.pushes is not None:
            self.pushes.close()
            self.pushes = None
            plot = self.run.path / STALENESS_PLOT
            try:  # a plot drawn from the push records: never worth the run's own error
                plot_staleness(self.run.path / PUSHES_FILE, plot)
            except OSError as err:  # e.g. the disk that stopped the run is full
                console.print(f"{plot.name} not drawn: {err.strerror or err}")
