"""Strategy "sandblaster": Sandblaster L-BFGS (DistBelief section 4.2) on Ray.

The coordinator runs L-BFGS (`optim.lbfgs`) without a parameter vector of its own: x, the
gradient, the direction and the history live on the shards (`ps.vectors.VectorShard`), and
the coordinator sends them small commands. Each objective evaluation is one pass over the
batch, cut into many small portions (`portion_size`, much smaller than 1/R of the batch)
that the coordinator hands to whichever replica is free, so faster replicas do more. When
no portion is left to hand out, idle replicas get copies of the portions still running
(backup tasks); the first result wins and the others are dropped, so every example counts
exactly once. A replica that dies has its accepted portions recomputed by others (the
shards drop its sums), and is restarted.

The shards checkpoint every iteration together with the coordinator's scalars, so a
restarted coordinator (`--resume`) continues from the shards' state.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from scaleout.build import build_datasets, build_model_for, resolve_device
from scaleout.config import RunConfig
from scaleout.errors import UserError
from scaleout.interrupt import StopOnInterrupt
from scaleout.metrics import MetricsLog, truncate_metrics
from scaleout.optim.lbfgs import LbfgsState, ShardedVectors, lbfgs
from scaleout.optim.sandblaster_replica import SandblasterReplica
from scaleout.optim.single import TrainResult, evaluate, show_progress
from scaleout.progress import TrainingProgress, console
from scaleout.ps.layout import FlatParameters, shard_ranges
from scaleout.ps.vectors import VectorShard
from scaleout.rundir import RunDir
from scaleout.runtime import describe_failure, session

SHARD_DIR = "shards"


class Interrupted(Exception):
    """Ctrl-C between two objective evaluations."""


class Sandblaster:
    def __init__(self, config: RunConfig, run: RunDir, resume: bool) -> None:
        self.config, self.run, self.opts = config, run, config.sandblaster
        self.threads_before = torch.get_num_threads()  # restored by close()
        torch.set_num_threads(config.run.num_threads or 1)
        torch.manual_seed(config.run.seed)
        self.device = resolve_device(config.run.device)
        train, self.test_set = build_datasets(config)
        self.num_examples = min(self.opts.batch_size or len(train), len(train))  # type: ignore[arg-type]
        dtype = getattr(torch, self.opts.dtype)
        self.model = build_model_for(config, train).to(self.device, dtype).eval()
        self.flat = FlatParameters(self.model)
        self.ranges = shard_ranges(self.flat.numel, self.opts.num_shards)
        actor = ray.remote(VectorShard).options(num_cpus=0, scheduling_strategy="SPREAD")
        self.shards = [
            actor.remote(i, stop - start, str(run.path / SHARD_DIR / f"shard_{i}"))
            for i, (start, stop) in enumerate(self.ranges)
        ]
        self.space = ShardedVectors(self.shards)
        self.state = LbfgsState(history=self.opts.history)
        self.x_version = self.batch_id = 0
        self.examples = self.duplicates = 0
        self.failures: list[dict[str, Any]] = []
        self.incarnations = [0] * self.opts.num_replicas
        self.calls = [0] * self.opts.num_replicas  # numbers each replica's calls in order
        self.running: dict[Any, tuple[int, int, int]] = {}  # future -> (replica, batch, portion)
        self.elapsed = self._init_or_resume(resume)
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.replica_cpus = min(1.0, cpus / self.opts.num_replicas)
        self.replicas = [self._spawn(r) for r in range(self.opts.num_replicas)]
        ray.get([replica.ready.remote() for replica in self.replicas])
        self.interrupt: StopOnInterrupt | None = None

    # --- shards ----------------------------------------------------------------------------

    def _init_or_resume(self, resume: bool) -> float:
        """Give fresh shards x and the weight mask, or continue from their checkpoints."""
        mask = torch.cat(
            [
                torch.full((e.numel,), 0.0 if e.name.endswith("bias") else 1.0)
                for e in self.flat.entries
            ]
        )  # (P,) 1 where the L2 penalty applies
        x = self.flat.params.detach().to("cpu", torch.float64)
        fresh = ray.get(
            [
                shard.initialize.remote({"x": x[a:b].numpy(), "mask": mask[a:b].double().numpy()})
                for shard, (a, b) in zip(self.shards, self.ranges, strict=True)
            ]
        )
        if all(fresh):
            return 0.0
        if not resume:
            raise UserError(
                f"{self.run.path} holds shard checkpoints: pass --resume or --overwrite"
            )
        states = [info["state"] for info in ray.get([s.info.remote() for s in self.shards])]
        if any(state != states[0] for state in states):
            raise UserError(
                f"the shards in {self.run.path / SHARD_DIR} were checkpointed at different "
                "iterations; the run cannot resume consistently (start again with --overwrite)"
            )
        saved = states[0]
        self.state = LbfgsState(**saved["lbfgs"])
        self.x_version, self.batch_id = saved["x_version"], saved["batch_id"]
        self.examples, self.duplicates = saved["examples"], saved["duplicates"]
        truncate_metrics(self.run.metrics, self.state.iteration)
        console.print(
            f"resumed {self.run.path} at iteration {self.state.iteration} from the shards"
        )
        return saved["time_s"]

    def _checkpoint(self) -> None:
        state = {
            "lbfgs": self.state.to_dict(),
            "x_version": self.x_version,
            "batch_id": self.batch_id,
            "examples": self.examples,
            "duplicates": self.duplicates,
            "time_s": self.now(),
        }
        ray.get([shard.checkpoint.remote(state) for shard in self.shards])

    # --- replicas --------------------------------------------------------------------------

    def _spawn(self, replica_id: int) -> Any:  # noqa: ANN401
        actor = ray.remote(SandblasterReplica).options(
            num_cpus=self.replica_cpus, max_concurrency=2, scheduling_strategy="SPREAD"
        )
        return actor.remote(
            replica_id,
            self.incarnations[replica_id],
            self.config.model_dump(mode="json"),
            self.shards,
            self.ranges,
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
                "iteration": self.state.iteration,
                "replica": replica_id,
                "message": message[:300],
            }
        )
        console.print(f"replica {replica_id} failed: {message[:200]}; its portions are reassigned")
        ray.kill(self.replicas[replica_id], no_restart=True)
        self.running = {f: v for f, v in self.running.items() if v[0] != replica_id}
        if restarts >= self.opts.max_restarts:
            raise UserError(f"replica {replica_id} failed {restarts + 1} times (max_restarts)")
        self.incarnations[replica_id] += 1
        self.calls[replica_id] = 0
        self.replicas[replica_id] = self._spawn(replica_id)

    # --- one objective evaluation: a load-balanced pass over the batch -----------------------

    def evaluate_batch(self) -> float:
        """f(x) over the batch; leaves the mean gradient (plus L2) in the shards' g."""
        if self.interrupt is not None and self.interrupt.requested:
            raise Interrupted
        self.x_version += 1
        self.batch_id += 1
        batch = self.batch_id
        size = self.opts.portion_size
        bounds = [(s, min(s + size, self.num_examples)) for s in range(0, self.num_examples, size)]
        todo = deque(range(len(bounds)))
        winners: dict[int, tuple[str, float, int]] = {}  # portion -> (key, loss sum, count)
        verdicts: dict[int, dict[int, bool]] = {r: {} for r in range(len(self.replicas))}

        def busy() -> set[int]:
            return {r for r, _, _ in self.running.values()}

        def assign(replica_id: int) -> None:
            if replica_id in busy():
                return
            if todo:
                portion = todo.popleft()
            elif self.opts.backup_tasks:
                current = [
                    p for _, b, p in self.running.values() if b == batch and p not in winners
                ]
                copies = {p: current.count(p) for p in current}
                portion = next((p for p in current if copies[p] == 1), None)
                if portion is None:
                    return
            else:
                return
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
                for portion in range(len(bounds)):  # lost with a dead replica and not running
                    running = {p for _, b, p in self.running.values() if b == batch}
                    if portion not in winners and portion not in running and portion not in todo:
                        todo.append(portion)
                (future,), _ = ray.wait(list(self.running), num_returns=1)
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
                    ray.get(future)
                except (RayActorError, RayTaskError) as error:
                    drop(r, self._key(r))
                    self._replica_failed(r, error)
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

    # --- the run -------------------------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.start

    def x(self) -> torch.Tensor:
        slices = ray.get([shard.pull.remote("x") for shard in self.shards])
        return torch.from_numpy(np.concatenate(slices))

    def close(self) -> None:
        torch.set_num_threads(self.threads_before)
        for actor in [*self.replicas, *self.shards]:
            ray.kill(actor, no_restart=True)

    def train(self) -> TrainResult:
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> TrainResult:
        cfg = self.config.train
        self.start = time.perf_counter() - self.elapsed
        with (
            MetricsLog(self.run.metrics) as log,
            StopOnInterrupt() as self.interrupt,
            TrainingProgress(self.opts.max_iterations, self.state.iteration, "sandblaster") as bar,
        ):

            def after_iteration(state: LbfgsState, step: float) -> None:
                (max_grad,) = self.space.run([("max_abs", "g")])
                record = {
                    "time_s": round(self.now(), 4),
                    "step": state.iteration,
                    "examples": self.examples,
                    "loss": state.f,
                    "lr": step,
                    "grad_max": max_grad,
                    "evaluations": state.evaluations,
                    "duplicates_dropped": self.duplicates,
                    "replica_failures": len(self.failures),
                }
                if (
                    state.iteration % cfg.eval_every == 0
                    or state.iteration == self.opts.max_iterations
                ):
                    record["test_loss"], record["test_accuracy"] = self.test()
                log.log(record)
                show_progress(bar, record)
                self._checkpoint()
                if state.iteration % cfg.checkpoint_every == 0:
                    self._save_model()

            try:
                lbfgs(
                    self.space,
                    self.evaluate_batch,
                    self.state,
                    self.opts.max_iterations,
                    self.opts.tolerance_grad,
                    self.opts.tolerance_change,
                    self.opts.max_line_search,
                    after_iteration,
                )
            except Interrupted:
                console.print(
                    f"interrupted at iteration {self.state.iteration}: the shards hold its "
                    "checkpoint; continue with --resume"
                )
            else:
                console.print(f"L-BFGS stopped: {self.state.done}")
        self._save_model()
        summary = self.run.finish()
        summary.update(
            final_objective=self.state.f,
            iterations=self.state.iteration,
            evaluations=self.state.evaluations,
            duplicates_dropped=self.duplicates,
            replica_failures=len(self.failures),
            stopped=self.state.done,
        )
        return TrainResult(self.state.iteration, self.interrupt.requested, summary)

    def test(self) -> tuple[float, float]:
        self.flat.params.copy_(self.x().to(self.flat.params.device, self.flat.params.dtype))
        return evaluate(self.model, self.test_set, self.config.train.eval_batch_size, self.device)

    def _save_model(self) -> None:
        """The final parameters as a run checkpoint, like every strategy writes."""
        self.flat.params.copy_(self.x().to(self.flat.params.device, self.flat.params.dtype))
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        meta = {
            "step": self.state.iteration,
            "examples": self.examples,
            "time_s": self.now(),
            "strategy": "sandblaster",
            "objective": self.state.f,
            "failures": self.failures,
            "config": self.config.model_dump(mode="json"),
        }
        self.run.checkpoints.save(self.state.iteration, tensors, meta)


def train_sandblaster(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    with session(config.run.address):
        return Sandblaster(config, run, resume).train()
