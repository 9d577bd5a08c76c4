"""Strategy "sandblaster": Sandblaster L-BFGS (DistBelief section 4.2) on Ray.

The coordinator runs L-BFGS (`lbfgs`) without a parameter vector of its own: x, the
gradient, the direction and the history live on the shards (`scaleout.ps.vectors`), and the
coordinator sends them small commands. Each objective evaluation is one pass over the batch,
cut into many small portions (`portion_size`, much smaller than 1/R of the batch) that the
coordinator hands to whichever replica is free, so faster replicas do more. When no portion
is left to hand out, idle replicas get copies of the portions still running (backup tasks);
the first result wins and the others are dropped, so every example counts exactly once. A
replica that dies has its accepted portions recomputed by others (the shards drop its sums),
and is restarted.

One step of the driver is one L-BFGS iteration. The shards checkpoint every iteration
together with the coordinator's scalars, so a restarted coordinator (`--resume`) continues
from the shards' state; the run's own checkpoints hold x as model weights.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from scaleout.errors import ConfigError, UserError
from scaleout.progress import console
from scaleout.ps.layout import FlatParameters, shard_ranges
from scaleout.ps.vectors import VectorShard
from scaleout.rundir import RunDir
from scaleout.runtime import (
    START_TIMEOUT_S,
    cpu_share,
    describe_failure,
    kill,
    resolve_device,
    spawn,
)
from scaleout.runtime.actors import check_capacity
from scaleout.strategies.sandblaster import SandblasterSection
from scaleout.strategies.sandblaster.lbfgs import LbfgsState, ShardedVectors, lbfgs
from scaleout.strategies.sandblaster.portions import next_portion, portion_bounds
from scaleout.strategies.sandblaster.replica import SandblasterReplica
from scaleout.train.job import Job
from scaleout.train.objective import Supervised, is_classification
from scaleout.train.protocol import Chunk, Plan, Resume, Tensors
from scaleout.train.state import model_tensors


def check_batch_method(job: Job) -> None:
    """L-BFGS takes its own steps along a line search, on the whole batch's gradient in
    `sandblaster.dtype`: a learning-rate schedule, clipping, micro-batches (its portions
    already split the batch) and autocast have no place in it; one line each."""
    train, strategy = job.train, 'train.strategy = "sandblaster"'
    if train.lr_schedule != "constant":
        raise ConfigError(
            f'train.lr_schedule = "{train.lr_schedule}" with {strategy}: L-BFGS chooses its '
            "own step sizes by line search; leave train.lr_schedule out"
        )
    if train.grad_clip_norm is not None:
        raise ConfigError(
            f"train.grad_clip_norm with {strategy}: clipping would change the gradient its "
            "line search relies on; leave train.grad_clip_norm out"
        )
    if train.accumulate_steps != 1:
        raise ConfigError(
            f"train.accumulate_steps = {train.accumulate_steps} with {strategy}: its replicas "
            "already sum the batch's gradient over portions (sandblaster.portion_size); "
            "leave train.accumulate_steps out"
        )
    if job.run.precision != "fp32":
        raise ConfigError(
            f'run.precision = "{job.run.precision}" with {strategy}: it computes in '
            'sandblaster.dtype; use run.precision = "fp32"'
        )


class Interrupted(Exception):
    """Ctrl-C between two objective evaluations."""


class Sandblaster:
    name = "sandblaster"
    restartable = False  # it heals its own workers; a failure it cannot heal ends the run

    def __init__(self, job: Job) -> None:
        self.job, self.opts = job, job.section("sandblaster", SandblasterSection)
        self.run = RunDir(job.run_dir)
        if job.probe is not None and job.probe.layerwise:
            raise ConfigError(
                'train.strategy = "sandblaster" trains supervised models; model '
                f'({job.model.name}) trains layer-wise: use strategy "single" or "downpour"'
            )
        check_batch_method(job)
        probe = job.probe
        if probe is not None and self.opts.num_shards > probe.num_parameters:
            raise ConfigError(
                f"sandblaster.num_shards = {self.opts.num_shards} exceeds the model's "
                f"{probe.num_parameters} parameters: use at most {probe.num_parameters}"
            )
        self.lbfgs_state = LbfgsState(history=self.opts.history)
        self.x_version = self.batch_id = 0
        self.snapshot = 0  # the shards' newest snapshot
        self.examples = self.duplicates = 0
        self.failures: list[dict[str, Any]] = []
        self.incarnations = [0] * self.opts.num_replicas
        self.calls = [0] * self.opts.num_replicas  # numbers each replica's calls in order
        self.running: dict[Any, tuple[int, int, int]] = {}  # future -> (replica, batch, portion)
        self.submitted: dict[Any, float] = {}  # future -> when it was sent (the watchdog)
        self.replicas: list[Any] = []
        self.shards: list[Any] = []
        self.stop: Callable[[], bool] = lambda: False
        self.start_time = time.perf_counter()

    def plan(self) -> Plan:
        return Plan(total_steps=self.opts.max_iterations, batches_per_epoch=0)

    def start(self, resume: Resume | None) -> dict[str, Any]:
        job = self.job
        self.device = resolve_device(job.run.device)
        torch.manual_seed(job.run.seed)
        train, self.test_set = job.build_data()
        self.num_examples = min(self.opts.batch_size or len(train), len(train))  # type: ignore[arg-type]
        dtype = getattr(torch, self.opts.dtype)
        self.model = job.build_model(train).to(self.device, dtype).eval()
        self.objective = Supervised(
            job.loss_fn(), is_classification(self.test_set), job.metrics_source()
        )
        self.flat = FlatParameters(self.model)
        self.ranges = shard_ranges(self.flat.numel, self.opts.num_shards)
        check_capacity(
            self.opts.num_replicas + self.opts.num_shards,
            f"sandblaster.num_replicas = {self.opts.num_replicas}, sandblaster.num_shards = "
            f"{self.opts.num_shards}",
        )
        self.shards = [
            spawn(VectorShard, i, stop - start, str(self.run.shards / f"shard_{i}"), num_cpus=0)
            for i, (start, stop) in enumerate(self.ranges)
        ]
        self.space = ShardedVectors(self.shards)
        counters = self._init_or_resume(resume is not None)
        self.start_time = time.perf_counter() - counters.get("time_s", 0.0)
        self.replica_cpus = cpu_share(self.opts.num_replicas)
        self.replicas = [self._spawn(r) for r in range(self.opts.num_replicas)]
        ray.get([replica.ready.remote() for replica in self.replicas])
        return counters

    # --- shards ----------------------------------------------------------------------------

    def _init_or_resume(self, resume: bool) -> dict[str, Any]:
        """Give fresh shards x and the weight mask, or continue from the newest snapshot
        that every shard holds."""
        held = ray.get([shard.snapshots.remote() for shard in self.shards])
        if not resume:
            if any(held):
                raise UserError(
                    f"{self.run.path} holds shard checkpoints: pass --resume or --overwrite"
                )
            mask = torch.cat(
                [
                    torch.full((e.numel,), 0.0 if e.name.endswith("bias") else 1.0)
                    for e in self.flat.entries
                ]
            )  # (P,) 1 where the L2 penalty applies
            x = self.flat.params.detach().to("cpu", torch.float64)
            ray.get(
                [
                    shard.initialize.remote({"x": x[a:b].numpy(), "mask": mask[a:b].numpy()})
                    for shard, (a, b) in zip(self.shards, self.ranges, strict=True)
                ]
            )
            return {}
        common = set.intersection(*(set(snapshots) for snapshots in held))
        if not common:
            raise UserError(
                f"--resume: the shards in {self.run.shards} hold no L-BFGS snapshot in common "
                f"(each holds {held}; the model or sandblaster.num_shards changed, or the "
                "files were removed), so the run cannot continue; start it again with "
                "--overwrite"
            )
        self.snapshot = max(common)
        saved = ray.get([shard.restore.remote(self.snapshot) for shard in self.shards])[0]
        self.lbfgs_state = LbfgsState(**saved["lbfgs"])
        self.x_version, self.batch_id = saved["x_version"], saved["batch_id"]
        self.examples, self.duplicates = saved["examples"], saved["duplicates"]
        console.print(
            f"the shards hold L-BFGS iteration {self.lbfgs_state.iteration} "
            f"(snapshot {self.snapshot})"
        )
        return {
            "step": self.lbfgs_state.iteration,
            "examples": self.examples,
            "time_s": saved["time_s"],
        }

    def _checkpoint(self) -> None:
        state = {
            "lbfgs": self.lbfgs_state.to_dict(),
            "x_version": self.x_version,
            "batch_id": self.batch_id,
            "examples": self.examples,
            "duplicates": self.duplicates,
            "time_s": self.now(),
        }
        self.snapshot += 1
        ray.get([shard.checkpoint.remote(state, self.snapshot) for shard in self.shards])

    # --- replicas --------------------------------------------------------------------------

    def _spawn(self, replica_id: int) -> Any:  # noqa: ANN401
        return spawn(
            SandblasterReplica,
            replica_id,
            self.incarnations[replica_id],
            self.job,
            self.shards,
            self.ranges,
            num_cpus=self.replica_cpus,
            max_concurrency=2,
        )

    def _call(self, replica_id: int) -> int:
        self.calls[replica_id] += 1
        return self.calls[replica_id]

    def _key(self, replica_id: int) -> str:
        return f"{replica_id}.{self.incarnations[replica_id]}"

    def _replica_failed(self, replica_id: int, error: BaseException) -> None:
        message = describe_failure(error)  # a user error in a replica stops the run
        restarts = self.incarnations[replica_id]
        self.failures.append(
            {
                "time_s": round(self.now(), 3),
                "iteration": self.lbfgs_state.iteration,
                "replica": replica_id,
                "message": message[:300],
            }
        )
        console.print(f"replica {replica_id} failed: {message[:200]}; its portions are reassigned")
        ray.kill(self.replicas[replica_id], no_restart=True)
        self.running = {f: v for f, v in self.running.items() if v[0] != replica_id}
        self.submitted = {f: t for f, t in self.submitted.items() if f in self.running}
        if restarts >= self.opts.max_restarts:
            raise UserError(f"replica {replica_id} failed {restarts + 1} times (max_restarts)")
        self.incarnations[replica_id] += 1
        self.calls[replica_id] = 0
        self.replicas[replica_id] = self._spawn(replica_id)
        # Ready before it takes portions: the watchdog times portions, not start-ups (a
        # process that imports torch and loads its data), which get at least START_TIMEOUT_S.
        limit = max(self.opts.timeout_s, START_TIMEOUT_S)
        try:
            ray.get(self.replicas[replica_id].ready.remote(), timeout=limit)
        except GetTimeoutError:
            raise UserError(f"replica {replica_id} did not start again in {limit:g} s") from None
        except (RayActorError, RayTaskError) as error:
            why = describe_failure(error)
            raise UserError(f"replica {replica_id} could not start again: {why}") from None

    def _silent(self) -> TimeoutError:
        return TimeoutError(f"no answer for {self.opts.timeout_s:g} s (sandblaster.timeout_s)")

    def _stuck(self) -> list[int]:
        """Replicas with a portion running longer than `sandblaster.timeout_s`."""
        now, limit = time.monotonic(), self.opts.timeout_s
        late = {self.running[f][0] for f, t in self.submitted.items() if now - t > limit}
        return sorted(late)

    # --- one objective evaluation: a load-balanced pass over the batch -----------------------

    def evaluate_batch(self) -> float:
        """f(x) over the batch; leaves the mean gradient (plus L2) in the shards' g."""
        if self.stop():
            raise Interrupted
        self.x_version += 1
        self.batch_id += 1
        batch = self.batch_id
        bounds = portion_bounds(self.num_examples, self.opts.portion_size)
        todo = deque(range(len(bounds)))
        winners: dict[int, tuple[str, float, int]] = {}  # portion -> (key, loss sum, count)
        verdicts: dict[int, dict[int, bool]] = {r: {} for r in range(len(self.replicas))}

        def busy() -> set[int]:
            return {r for r, _, _ in self.running.values()}

        def assign(replica_id: int) -> None:
            if replica_id in busy():
                return
            chosen = next_portion(
                todo, self.running.values(), batch, winners, self.opts.backup_tasks
            )
            if chosen is None:
                return
            portion, _ = chosen
            start, stop = bounds[portion]
            future = self.replicas[replica_id].compute.remote(
                self._call(replica_id),
                batch,
                portion,
                start,
                stop,
                self.x_version,
                verdicts[replica_id],
            )
            verdicts[replica_id] = {}
            self.running[future] = (replica_id, batch, portion)
            self.submitted[future] = time.monotonic()

        def drop(replica_id: int, key: str) -> None:
            """A replica died: its portions of this batch are redone by others."""
            for portion in [p for p, (k, _, _) in winners.items() if k == key]:
                del winners[portion]
                todo.append(portion)
            verdicts[replica_id] = {}

        while True:
            for r in range(len(self.replicas)):
                assign(r)
            while len(winners) < len(bounds):
                running = {p for _, b, p in self.running.values() if b == batch}
                for portion in range(len(bounds)):  # lost with a dead replica and not running
                    if portion not in winners and portion not in running and portion not in todo:
                        todo.append(portion)
                for r in range(len(self.replicas)):  # a restarted replica takes one of them
                    assign(r)
                assert self.running, "portions left but no replica computes one"
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=1.0)
                if not ready:  # the watchdog: a replica silent for timeout_s is stuck
                    for replica_id in self._stuck():
                        drop(replica_id, self._key(replica_id))
                        self._replica_failed(replica_id, self._silent())
                        assign(replica_id)
                    continue
                future = ready[0]
                self.submitted.pop(future, None)
                replica_id, future_batch, portion = self.running.pop(future)
                key = self._key(replica_id)
                try:
                    _, _, loss, correct, count = ray.get(future)
                except (RayActorError, RayTaskError) as error:
                    drop(replica_id, key)
                    self._replica_failed(replica_id, error)
                    assign(replica_id)
                    continue
                if future_batch == batch:
                    accepted = portion not in winners
                    verdicts[replica_id][portion] = accepted
                    if accepted:
                        winners[portion] = (key, loss, count)
                    else:
                        self.duplicates += 1
                else:  # a copy that lost in an earlier batch: its gradient is already void
                    self.duplicates += 1
                for r in range(len(self.replicas)):
                    assign(r)
            flushes = {
                r: self.replicas[r].flush.remote(self._call(r), batch, verdicts[r])
                for r in range(len(self.replicas))
            }
            lost = False
            for r, future in flushes.items():
                verdicts[r] = {}
                try:
                    ray.get(future, timeout=self.opts.timeout_s)
                except (RayActorError, RayTaskError, GetTimeoutError) as error:
                    drop(r, self._key(r))
                    silent = isinstance(error, GetTimeoutError)
                    self._replica_failed(r, self._silent() if silent else error)
                    lost = True
            if not lost:
                break
        keys = sorted({key for key, _, _ in winners.values()})
        ray.get([shard.finalize.remote(keys, "g") for shard in self.shards])
        counted = sum(count for _, _, count in winners.values())
        assert counted == self.num_examples, f"counted {counted} of {self.num_examples} examples"
        self.examples += counted
        f = sum(loss for _, loss, _ in winners.values()) / counted
        commands: list[tuple[Any, ...]] = [("scale", 1.0 / counted, "g")]
        if self.opts.l2:
            commands += [
                ("mul", "mask", "x", "tmp"),
                ("dot", "x", "tmp"),
                ("axpy", 2 * self.opts.l2, "tmp", "g"),
            ]
        results = self.space.run(commands)
        return f + (self.opts.l2 * results[2] if self.opts.l2 else 0.0)

    # --- the driver's calls ---------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.start_time

    def x(self) -> torch.Tensor:
        slices = ray.get([shard.pull.remote("x") for shard in self.shards])
        return torch.from_numpy(np.concatenate(slices))

    def train(self, num_steps: int, stop: Callable[[], bool]) -> Chunk:
        """`num_steps` L-BFGS iterations (fewer when it converges or `stop()` turns true);
        the shards checkpoint after each."""
        self.stop = stop
        first, examples = self.lbfgs_state.iteration, self.examples
        last_step = [1.0]

        def after_iteration(state: LbfgsState, step: float) -> None:
            last_step[0] = step
            self._checkpoint()

        limit = min(first + num_steps, self.opts.max_iterations)
        try:
            lbfgs(
                self.space,
                self.evaluate_batch,
                self.lbfgs_state,
                limit,
                self.opts.tolerance_grad,
                self.opts.tolerance_change,
                self.opts.max_line_search,
                after_iteration,
            )
        except Interrupted:
            pass  # the shards hold the last iteration's checkpoint
        stopped = self.lbfgs_state.done
        if stopped == "max_iterations reached":
            stopped = None  # the driver's plan ends the run there
        self.lbfgs_state.done = stopped
        (max_grad,) = self.space.run([("max_abs", "g")])
        fields = {
            "loss": self.lbfgs_state.f,
            "lr": last_step[0],
            "grad_max": max_grad,
            "evaluations": self.lbfgs_state.evaluations,
            "duplicates_dropped": self.duplicates,
            "replica_failures": len(self.failures),
        }
        return Chunk(
            steps=self.lbfgs_state.iteration - first,
            examples=self.examples - examples,
            fields=fields,
            stopped=stopped,
        )

    def metrics(self) -> dict[str, Any]:
        return {}

    def _load_x(self) -> None:
        self.flat.params.copy_(self.x().to(self.flat.params.device, self.flat.params.dtype))

    def evaluate(self) -> dict[str, float]:
        self._load_x()
        return self.objective.evaluate(
            self.model, self.test_set, self.job.train.eval_batch_size, self.device
        )

    def state(self) -> tuple[Tensors, dict[str, Any]]:
        """x as the model's weights (a run checkpoint like every strategy writes)."""
        self._load_x()
        meta = {"objective": self.lbfgs_state.f, "failures": self.failures}
        return model_tensors(self.model), meta

    def finish(self) -> Chunk:
        return Chunk()

    def summary(self) -> dict[str, Any]:
        return {
            "final_objective": self.lbfgs_state.f,
            "iterations": self.lbfgs_state.iteration,
            "evaluations": self.lbfgs_state.evaluations,
            "duplicates_dropped": self.duplicates,
            "replica_failures": len(self.failures),
        }

    def close(self) -> None:
        kill([*self.replicas, *self.shards])
        self.replicas, self.shards = [], []
