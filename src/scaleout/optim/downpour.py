"""Strategy "downpour": Downpour SGD (DistBelief section 4.1) on Ray.

The driver starts S parameter-server shards holding the model's flat parameter vector (each
applies the configured torch.optim optimizer to its slice: Adagrad in the paper) and R
replicas, each owning a disjoint part of the training data (`DownpourReplica`). Replicas
talk to the shards directly; the driver only hands out chunks of steps, collects their
per-push records, evaluates the shards' current parameters on the test set, checkpoints,
and restarts what dies.

Warm start: only replica 0 trains until `warmstart_steps` global steps are done. A global
step is one minibatch on any replica; `train.steps` / `train.epochs` count them over all
replicas (an epoch is one pass over the whole training set).

Failures: a replica that dies (killed process, exception) is logged and restarted where it
stopped, up to `max_restarts` times, while the others go on; a shard that dies is restarted
by Ray from its last checkpoint (`ParameterShard`). The run ends with a summary of failures
and of the work lost.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from scaleout.build import build_datasets, build_model_for, resolve_device
from scaleout.checkpoint import load_checkpoint
from scaleout.config import RunConfig
from scaleout.data import num_batches
from scaleout.errors import UserError
from scaleout.interrupt import StopOnInterrupt
from scaleout.metrics import MetricsLog, truncate_metrics
from scaleout.optim.replica import DownpourReplica
from scaleout.optim.single import TrainResult, evaluate, reached, show_progress
from scaleout.progress import TrainingProgress, console
from scaleout.ps.layout import FlatParameters
from scaleout.ps.server import ParameterServer
from scaleout.rundir import RunDir
from scaleout.runtime import describe_failure, session

PUSHES_FILE = "pushes.jsonl"
SHARD_DIR = "shards"


class Downpour:
    """The driver's state: shards, replicas, counters, failures."""

    def __init__(self, config: RunConfig, run: RunDir, resume: bool) -> None:
        self.config, self.run = config, run
        self.opts = config.downpour
        self.threads_before = torch.get_num_threads()  # restored by close()
        torch.set_num_threads(config.run.num_threads or 1)
        self.device = resolve_device(config.run.device)
        torch.manual_seed(config.run.seed)
        train_set, self.test_set = build_datasets(config)
        self.model = build_model_for(config, train_set).to(self.device)
        self.flat = FlatParameters(self.model)
        batch = config.train.batch_size
        per_epoch = num_batches(len(train_set), batch, drop_last=True)  # type: ignore[arg-type]
        self.total_steps = config.train.steps or config.train.epochs * max(per_epoch, 1)
        self.step, self.examples, self.elapsed = 0, 0, 0.0
        self.positions: list[dict[str, int] | None] = [None] * self.opts.num_replicas
        self.failures: list[dict[str, Any]] = []
        self.restarts = [0] * self.opts.num_replicas
        self.steps_lost = 0
        self.shard_updates_lost = 0
        if resume:
            self._restore()
        self.server = ParameterServer.create(
            self.flat.params,
            self.opts.num_shards,
            config.train.model_dump(),
            config.compress.model_dump(),
            run.path / SHARD_DIR,
            self.opts.shard_checkpoint_every,
            self.opts.shard_checkpoint_seconds,
            resource=self.opts.shard_resource,
        )
        self.shard_pids = {info["shard"]: info["pid"] for info in self.server.info()}
        self.shard_versions = {info["shard"]: info["version"] for info in self.server.info()}
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.replica_cpus = min(1.0, cpus / self.opts.num_replicas)
        self.replicas: list[Any] = [self._spawn(r) for r in range(self.opts.num_replicas)]
        self.alive = [True] * self.opts.num_replicas
        # Wait until every replica is built and has its data; say where everything runs.
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        nodes = [addresses[n] for n in ray.get([r.node.remote() for r in self.replicas])]
        shard_nodes = [addresses[info["node"]] for info in self.server.info()]
        if len(set(nodes + shard_nodes)) > 1:
            console.print(f"shards on {shard_nodes}; replicas on {nodes}")
        self.placement = {"shards": shard_nodes, "replicas": nodes}

    # --- replicas --------------------------------------------------------------------------

    def _spawn(self, replica_id: int) -> Any:  # noqa: ANN401
        resource = self.opts.replica_resource
        actor = ray.remote(DownpourReplica).options(
            num_cpus=self.replica_cpus,
            max_restarts=0,
            scheduling_strategy="SPREAD",
            resources={resource: 0.001} if resource else None,
        )
        return actor.remote(
            replica_id,
            self.opts.num_replicas,
            self.config.model_dump(mode="json"),
            self.server,
            self.positions[replica_id],
        )

    def _replica_failed(self, replica_id: int, steps: int, error: BaseException) -> None:
        kind = "died" if isinstance(error, RayActorError) else "raised"
        message = describe_failure(error)  # a user error in a replica stops the run
        self.steps_lost += steps
        restart = self.restarts[replica_id] < self.opts.max_restarts
        self.failures.append(
            {
                "time_s": round(self.now(), 3),
                "step": self.step,
                "replica": replica_id,
                "kind": kind,
                "restarted": restart,
                "message": message[:300],
            }
        )
        console.print(
            f"replica {replica_id} {kind} at step {self.step}: {message[:200]}"
            + ("; restarting it" if restart else "; not restarting it (downpour.max_restarts)")
        )
        ray.kill(self.replicas[replica_id], no_restart=True)
        if restart:
            self.restarts[replica_id] += 1
            self.replicas[replica_id] = self._spawn(replica_id)
        else:
            self.alive[replica_id] = False
            if not any(self.alive):
                raise UserError("every Downpour replica failed; see the messages above")

    def _check_shards(self) -> None:
        """Count shards Ray restarted, and the updates they lost."""
        for info in self.server.info():
            shard = info["shard"]
            if info["pid"] != self.shard_pids[shard]:
                lost = max(self.shard_versions[shard] - info["version"], 0)
                self.shard_updates_lost += lost
                self.failures.append(
                    {
                        "time_s": round(self.now(), 3),
                        "step": self.step,
                        "shard": shard,
                        "kind": "shard restarted",
                        "restored_version": info["restored_version"],
                        "updates_lost": lost,
                    }
                )
                console.print(
                    f"shard {shard} restarted from its checkpoint at version "
                    f"{info['restored_version']} ({lost} updates lost)"
                )
            self.shard_pids[shard], self.shard_versions[shard] = info["pid"], info["version"]

    # --- time, evaluation, checkpoints -----------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.start

    def evaluate(self) -> tuple[float, float]:
        values = self.server.values()
        self.flat.params.copy_(values.to(self.flat.params.device))
        return evaluate(self.model, self.test_set, self.config.train.eval_batch_size, self.device)

    def checkpoint(self, record: dict[str, Any]) -> None:
        self.server.checkpoint()
        self.flat.params.copy_(self.server.values().to(self.flat.params.device))
        tensors = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        meta = {
            "step": self.step,
            "examples": self.examples,
            "time_s": self.now(),
            "strategy": "downpour",
            "positions": self.positions,
            "restarts": self.restarts,
            "failures": self.failures,
            "steps_lost": self.steps_lost,
            "shard_updates_lost": self.shard_updates_lost,
            "placement": self.placement,
            "config": self.config.model_dump(mode="json"),
            "metrics": record,
        }
        self.run.checkpoints.save(self.step, tensors, meta)

    def _restore(self) -> None:
        path = self.run.checkpoints.latest()
        assert path is not None  # RunDir.prepare checked
        _, meta = load_checkpoint(path)
        if meta.get("strategy") != "downpour":
            raise UserError(f"{path} is a {meta.get('strategy')} checkpoint, not a Downpour one")
        self.step, self.examples, self.elapsed = meta["step"], meta["examples"], meta["time_s"]
        positions = meta["positions"]
        if len(positions) == len(self.positions):
            self.positions = positions
        self.failures, self.steps_lost = meta["failures"], meta["steps_lost"]
        self.shard_updates_lost = meta["shard_updates_lost"]
        truncate_metrics(self.run.metrics, self.step)
        truncate_metrics(self.run.path / PUSHES_FILE, self.step)
        console.print(
            f"resumed {self.run.path} at step {self.step} (shards from their checkpoints)"
        )

    # --- the loop ----------------------------------------------------------------------------

    def close(self) -> None:
        """End this run's actors (on a shared cluster nothing else would)."""
        torch.set_num_threads(self.threads_before)
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)
        self.server.kill()

    def train(self) -> TrainResult:
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> TrainResult:
        cfg = self.config.train
        chunk = max(1, min(cfg.log_every, 20))
        self.start = time.perf_counter() - self.elapsed
        run_start_wall = time.time() - self.elapsed
        in_flight: dict[Any, tuple[int, int]] = {}  # future -> (replica, steps)
        assigned = self.step
        window = _Window()
        record: dict[str, Any] = {}
        next_log = (self.step // cfg.log_every + 1) * cfg.log_every
        next_eval = (self.step // cfg.eval_every + 1) * cfg.eval_every
        next_checkpoint = (self.step // cfg.checkpoint_every + 1) * cfg.checkpoint_every
        with (
            MetricsLog(self.run.metrics) as log,
            MetricsLog(self.run.path / PUSHES_FILE) as pushes,
            StopOnInterrupt() as interrupt,
            TrainingProgress(self.total_steps, completed=self.step, description="downpour") as bar,
        ):

            def submit(replica_id: int) -> None:
                nonlocal assigned
                steps = min(chunk, self.total_steps - assigned)
                if steps > 0 and not interrupt.requested and self.alive[replica_id]:
                    future = self.replicas[replica_id].train_chunk.remote(steps)
                    in_flight[future] = (replica_id, steps)
                    assigned += steps

            def active() -> list[int]:
                warm = self.step < self.opts.warmstart_steps
                return [0] if warm else [r for r in range(self.opts.num_replicas) if self.alive[r]]

            def busy() -> set[int]:
                return {r for r, _ in in_flight.values()}

            def log_pushes(records: list[dict[str, Any]]) -> None:
                for push in records:
                    push["time_s"] = round(push.pop("t") - run_start_wall, 4)
                    push.update(step=self.step, examples=self.examples, lr=cfg.lr)
                    pushes.log(push)
                    window.add(push)

            for r in active():
                submit(r)
            while in_flight:
                ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=1.0)
                for future in ready:
                    replica_id, steps = in_flight.pop(future)
                    try:
                        out = ray.get(future)
                    except (RayActorError, RayTaskError) as error:
                        assigned -= steps
                        self._replica_failed(replica_id, steps, error)
                        continue
                    self.step += out["steps"]
                    self.examples += out["steps"] * cfg.batch_size
                    window.steps += out["steps"]
                    self.positions[replica_id] = out["position"]
                    log_pushes(out["records"])
                done = self.step >= self.total_steps
                if self.step >= next_log or done:
                    next_log = (self.step // cfg.log_every + 1) * cfg.log_every
                    record = window.record(self.now(), self.step, self.examples, cfg.lr)
                    record["examples_per_s"] = record["updates_per_s"] * cfg.batch_size
                    record["replicas_alive"] = sum(self.alive)
                    if self.step >= next_eval or done:
                        next_eval = (self.step // cfg.eval_every + 1) * cfg.eval_every
                        record["test_loss"], record["test_accuracy"] = self.evaluate()
                        if reached(cfg.target_accuracy, record):
                            self.total_steps = assigned = self.step  # hand out no more work
                    self._check_shards()
                    log.log(record)
                    show_progress(bar, record)
                    bar.update(
                        self.step,
                        rate=f"{record['updates_per_s']:.1f} upd/s",
                        alive=f"{sum(self.alive)}/{len(self.alive)} alive",
                    )
                if self.step >= next_checkpoint and not done:
                    next_checkpoint = (self.step // cfg.checkpoint_every + 1) * cfg.checkpoint_every
                    self.checkpoint(record)
                for r in active():
                    if r not in busy():
                        submit(r)
            for r, replica in enumerate(self.replicas):
                if self.alive[r]:
                    try:
                        log_pushes(ray.get(replica.flush.remote()))
                    except (RayActorError, RayTaskError):
                        pass  # its last pushes are lost; the shards keep what arrived
            self.checkpoint(record)
        if interrupt.requested:
            console.print(
                f"interrupted at step {self.step}: checkpoint saved in "
                f"{self.run.checkpoints.directory}; continue with --resume"
            )
        summary = self.run.finish()
        summary.update(
            replica_failures=sum(1 for f in self.failures if "replica" in f),
            replica_restarts=sum(self.restarts),
            shard_restarts=sum(1 for f in self.failures if "shard" in f),
            steps_lost=self.steps_lost,
            shard_updates_lost=self.shard_updates_lost,
        )
        return TrainResult(step=self.step, interrupted=interrupt.requested, summary=summary)


class _Window:
    """Push records between two metrics lines."""

    def __init__(self) -> None:
        self.reset(time.perf_counter())

    def reset(self, now: float) -> None:
        self.started, self.steps, self.losses, self.staleness = now, 0, [], []
        self.staleness_max = 0
        self.bytes_sent = self.bytes_received = 0

    def add(self, push: dict[str, Any]) -> None:
        self.losses.append(push["loss"])
        if push.get("staleness") is not None:
            self.staleness.append(push["staleness"])
            self.staleness_max = max(self.staleness_max, push["staleness_max"])
        self.bytes_sent += push.get("bytes_sent", 0)
        self.bytes_received += push.get("bytes_received", 0)

    def record(self, time_s: float, step: int, examples: int, lr: float) -> dict[str, Any]:
        now = time.perf_counter()
        seconds = max(now - self.started, 1e-9)
        record = {
            "time_s": round(time_s, 4),
            "step": step,
            "examples": examples,
            "loss": sum(self.losses) / len(self.losses) if self.losses else None,
            "lr": lr,
            "updates_per_s": self.steps / seconds,
            "staleness_mean": sum(self.staleness) / len(self.staleness) if self.staleness else None,
            "staleness_max": self.staleness_max,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }
        self.reset(now)
        return record


def train_downpour(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    """Run Downpour SGD: embedded Ray by default, a cluster with `run.address`."""
    with session(config.run.address):
        return Downpour(config, run, resume).train()
