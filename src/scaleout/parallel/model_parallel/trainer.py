"""Strategy "model_parallel": greedy autoencoder training with one replica partitioned over a
`model_parallel.grid = [px, py]` of workers; and Downpour SGD over several such replicas
(strategy "downpour" with `model.kind = "sparse_autoencoder"`).

The workers of a replica are Ray actors in one placement group, joined in a torch.distributed
process group (`ProcessGroup`: gloo on CPU, NCCL on GPU). Each builds the global network from
the seed, keeps only its filters (`PartitionedAutoencoder`) and runs a `GreedyTrainer` on
them. The driver (`drive_greedy`, the same as strategy "single"'s) sends every call to all
workers at once; inside a call the workers exchange activations and gradients with the
workers their receptive fields reach through `DistributedArray`s, and all-reduce only alpha's
gradient, the objective's terms and, for checkpoints, the filters. Rank 0 answers; the
others' answers are the same sums. A grid of 1 x 1 is one worker, the same code.

Downpour (`downpour.num_replicas` R > 1 grids): replica r trains on every R-th example; for
the stack in training, worker w of every replica pulls from and pushes to the shards that
hold worker w's filters (`ShardLink`), which apply the updates. At each stack's start the
driver starts those shards from replica 0's values; at its end every worker flushes and
adopts the final values, so the frozen stacks are the same everywhere. `train.steps` counts
each replica's steps per stack; replicas run a chunk of steps each between the driver's
log, evaluation and checkpoint points. Evaluations and checkpoints read the shards.

A worker that dies stops the run with `WorkerDied` (the others wait on it in a collective);
`--resume` continues from the last checkpoint, which holds the whole replica in strategy
"single"'s format, so a run may resume under another grid or in one process (with
Downpour, the shards' optimizer state starts afresh).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import ray
import torch

from scaleout.build import resolve_device
from scaleout.comm import GroupMember, ProcessGroup
from scaleout.config import RunConfig
from scaleout.errors import ConfigError
from scaleout.optim.greedy import GreedyPlan, GreedyTrainer
from scaleout.optim.greedy_driver import drive_greedy
from scaleout.optim.single import TrainResult
from scaleout.ps.server import ParameterServer
from scaleout.rundir import RunDir
from scaleout.runtime import session

__all__ = ["ModelParallelWorker", "train_model_parallel"]

ROLE = "model-parallel worker"
DOING = {"train_chunk": "training", "evaluate": "evaluating", "state": "checkpointing"}
DOING.update(restore="resuming", get_plan="starting")
SHARD_DIR = "shards"


class ModelParallelWorker(GroupMember):
    """One worker of a model-parallel replica (a Ray actor): its filters and its trainer."""

    def __init__(
        self, rank: int, world: int, config: dict[str, Any], replica: tuple[int, int]
    ) -> None:
        self.rank, self.world, self.replica = rank, world, tuple(replica)
        self.config = RunConfig.model_validate(config)
        torch.set_num_threads(self.config.run.num_threads or 1)
        self.trainer: GreedyTrainer | None = None

    def pid(self) -> int:
        return os.getpid()

    def start(self) -> None:
        """After the group is formed: build the network and take this worker's part."""
        self.trainer = GreedyTrainer(
            self.config, model_parallel=True, rank=self.rank, replica=self.replica
        )

    def call(self, method: str, *args: Any) -> Any:  # noqa: ANN401 - the trainer's result
        assert self.trainer is not None, "start() first"
        return getattr(self.trainer, method)(*args)


def num_grid_workers(config: RunConfig) -> int:
    if config.model.kind != "sparse_autoencoder":
        raise ConfigError(
            f'train.strategy = "{config.train.strategy}" with model parallelism partitions a '
            f"sparse autoencoder; model.kind is {config.model.kind!r}: set "
            'model.kind = "sparse_autoencoder" or use another strategy'
        )
    px, py = config.model_parallel.grid
    return px * py


class Grids:
    """R replicas, each a grid of workers; `call` runs a trainer method on all of them."""

    def __init__(self, config: RunConfig, run: RunDir) -> None:
        self.config, self.run = config, run
        self.downpour = config.train.strategy == "downpour"
        self.num_replicas = config.downpour.num_replicas if self.downpour else 1
        world = num_grid_workers(config)
        device = resolve_device(config.run.device)
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.groups: list[ProcessGroup] = []
        try:
            for r in range(self.num_replicas):
                self.groups.append(
                    ProcessGroup.create(
                        ModelParallelWorker,
                        world,
                        args=(config.model_dump(mode="json"), (r, self.num_replicas)),
                        num_cpus=min(1.0, cpus / (world * self.num_replicas)),
                        num_gpus=1.0 if device.type == "cuda" else 0.0,
                        backend=config.model_parallel.backend,
                        device=str(device),
                        timeout_s=config.model_parallel.timeout_s,
                    )
                )
            self._get([[w.start.remote() for w in g.actors] for g in self.groups], "starting")
        except BaseException:
            self.close(timeout_s=0.0)
            raise
        self.step, self.stack, self.servers = 0, -1, []
        self.link_stats: list[dict[str, Any]] = []
        self.plan: GreedyPlan | None = None

    def _where(self) -> str:
        latest = self.run.checkpoints.latest()
        if latest:
            return f"(the last checkpoint is {latest}: continue with --resume)"
        return "(no checkpoint was written yet: start the run again)"

    def _get(self, futures: list[list[Any]], doing: str) -> list[list[Any]]:
        return [
            g.get(f, doing, ROLE, self._where) for g, f in zip(self.groups, futures, strict=True)
        ]

    def _on(self, groups: list[ProcessGroup], method: str, *args: Any) -> list[list[Any]]:
        shared = [ray.put(a) if isinstance(a, dict) else a for a in args]
        futures = [[w.call.remote(method, *shared) for w in g.actors] for g in groups]
        return [
            g.get(f, DOING.get(method, method), ROLE, self._where)
            for g, f in zip(groups, futures, strict=True)
        ]

    def call(self, method: str, *args: Any) -> Any:  # noqa: ANN401 - replica 0's rank 0's result
        if method == "restore":
            self.step = args[1]["step"]
        if method == "train_chunk" and self.downpour:
            self._start_stack()
        if method in ("evaluate", "state"):  # one replica reads the shards
            return self._on(self.groups[:1], method, *args)[0][0]
        results = self._on(self.groups, method, *args)
        if method == "get_plan":
            self.plan = results[0][0]
        if method != "train_chunk":
            return results[0][0]
        self.step += args[0]
        first = [answers[0] for answers in results]  # each replica's sums
        combined = dict(first[0])
        for key in ("reconstruction", "sparsity", "examples"):
            combined[key] = sum(out[key] for out in first)
        if self.downpour and self.step % self.plan.steps_per_stack == 0:  # type: ignore[union-attr]
            self._finish_stack()
        return combined

    # --- Downpour: shards for the stack in training ---------------------------------------------

    def _start_stack(self) -> None:
        assert self.plan is not None
        stack = self.step // self.plan.steps_per_stack
        if stack == self.stack:
            return
        self._finish_stack()
        opts = self.config.downpour
        initial = self._on(self.groups[:1], "begin_stack", stack)[0]  # per worker
        train = self.config.train.model_dump()
        alpha_train = {**train, "lr": train["lr"] * self.config.model.alpha_lr_scale}  # type: ignore[union-attr]
        self.servers = []
        for w, (filters, alpha) in enumerate(initial):
            lanes = [("filters", filters, train, opts.num_shards)]
            if alpha is not None:
                lanes.append(("alpha", alpha, alpha_train, 1))
            servers = []
            for name, values, options, num_shards in lanes:
                root = self.run.path / SHARD_DIR / f"stack{stack}.worker{w}.{name}"
                shutil.rmtree(root, ignore_errors=True)  # the run's checkpoint is the truth
                servers.append(
                    ParameterServer.create(
                        values,
                        num_shards,
                        options,
                        self.config.compress.model_dump(),
                        root,
                        opts.shard_checkpoint_every,
                        opts.shard_checkpoint_seconds,
                        resource=opts.shard_resource,
                    )
                )
            self.servers.append((servers[0], servers[1] if len(servers) > 1 else None))
        futures = [
            [
                w.call.remote("attach", stack, self.servers[rank], opts.n_fetch, opts.n_push)
                for rank, w in enumerate(g.actors)
            ]
            for g in self.groups
        ]
        self._get(futures, "attaching to the shards")
        self.stack = stack

    def _finish_stack(self) -> None:
        if not self.servers:
            return
        self.link_stats += [s for answers in self._on(self.groups, "finish_stack") for s in answers]
        self._kill_servers()
        self.stack = -1

    def _kill_servers(self) -> None:
        for pair in self.servers:
            for server in pair:
                if server is not None:
                    server.kill()
        self.servers = []

    def summary(self) -> dict[str, Any]:
        if not self.link_stats:
            return {}
        staleness = [s for stats in self.link_stats for s in stats["staleness"]]
        return {
            "num_replicas": self.num_replicas,
            "pushes": sum(s["pushes"] for s in self.link_stats),
            "mean_staleness": sum(staleness) / max(len(staleness), 1),
        }

    def close(self, timeout_s: float = 10.0) -> None:
        self._kill_servers()
        for group in self.groups:
            group.close(timeout_s)


def train_model_parallel(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    """Train on grids of Ray actors: embedded Ray by default, a cluster with `run.address`."""
    num_grid_workers(config)
    with session(config.run.address):
        grids = Grids(config, run)
        try:
            result = drive_greedy(config, run, resume, grids.call, config.train.strategy)
        except BaseException:
            grids.close(timeout_s=0.0)  # survivors may hang in a collective: kill them
            raise
        grids.close()
        result.summary.update(grid=list(config.model_parallel.grid), **grids.summary())
        return result
