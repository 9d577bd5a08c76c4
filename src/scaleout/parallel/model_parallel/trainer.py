"""Strategy "model_parallel": greedy autoencoder training with one replica partitioned over a
`model_parallel.grid = [px, py]` of workers.

The workers are Ray actors in one placement group, joined in a torch.distributed process
group (`ProcessGroup`: gloo on CPU, NCCL on GPU). Each builds the global network from the
seed, keeps only its filters (`PartitionedAutoencoder`) and runs a `GreedyTrainer` on them.
The driver (`drive_greedy`, the same as strategy "single"'s) sends every call to all workers
at once; inside a call the workers exchange activations and gradients with their grid
neighbours (and farther workers where receptive fields reach) through `DistributedArray`s,
and all-reduce only alpha's gradient, the objective's terms and, for checkpoints, the
filters. Rank 0 answers; the others' answers are the same sums.

A grid of 1 x 1 is one worker, the same code. A worker that dies stops the run with
`WorkerDied` (the others wait on it in a collective); `--resume` continues from the last
checkpoint, which holds the whole replica in strategy "single"'s format, so a run may resume
under another grid or in one process.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from scaleout.build import resolve_device
from scaleout.comm import GroupMember, ProcessGroup
from scaleout.config import RunConfig
from scaleout.errors import ConfigError
from scaleout.optim.greedy import GreedyTrainer
from scaleout.optim.greedy_driver import drive_greedy
from scaleout.optim.single import TrainResult
from scaleout.rundir import RunDir
from scaleout.runtime import session

__all__ = ["ModelParallelWorker", "train_model_parallel"]


DOING = {"train_chunk": "training", "evaluate": "evaluating", "state": "checkpointing"}
DOING.update(restore="resuming", get_plan="starting")


class ModelParallelWorker(GroupMember):
    """One worker of a model-parallel replica (a Ray actor): its filters and its trainer."""

    def __init__(self, rank: int, world: int, config: dict[str, Any]) -> None:
        self.rank, self.world = rank, world
        self.config = RunConfig.model_validate(config)
        torch.set_num_threads(self.config.run.num_threads or 1)
        self.trainer: GreedyTrainer | None = None

    def pid(self) -> int:
        return os.getpid()

    def start(self) -> None:
        """After the group is formed: build the network and take this worker's part."""
        self.trainer = GreedyTrainer(self.config, model_parallel=True, rank=self.rank)

    def call(self, method: str, *args: Any) -> Any:  # noqa: ANN401 - the trainer's result
        assert self.trainer is not None, "start() first"
        return getattr(self.trainer, method)(*args)


def _check(config: RunConfig) -> int:
    if config.model.kind != "sparse_autoencoder":
        raise ConfigError(
            f'train.strategy = "model_parallel" partitions a sparse autoencoder; model.kind is '
            f'{config.model.kind!r}: set model.kind = "sparse_autoencoder" or use another strategy'
        )
    px, py = config.model_parallel.grid
    return px * py


def train_model_parallel(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    """Train on a grid of Ray actors: embedded Ray by default, a cluster with `run.address`."""
    num_workers = _check(config)
    device = resolve_device(config.run.device)
    with session(config.run.address):
        cpus = ray.cluster_resources().get("CPU", 1.0)
        group = ProcessGroup.create(
            ModelParallelWorker,
            num_workers,
            args=(config.model_dump(mode="json"),),
            num_cpus=min(1.0, cpus / num_workers),
            num_gpus=1.0 if device.type == "cuda" else 0.0,
            backend=config.model_parallel.backend,
            device=str(device),
            timeout_s=config.model_parallel.timeout_s,
        )

        def where() -> str:
            latest = run.checkpoints.latest()
            return (
                f"(the last checkpoint is {latest}: continue with --resume)"
                if latest
                else "(no checkpoint was written yet: start the run again)"
            )

        def call(method: str, *args: Any) -> Any:  # noqa: ANN401 - rank 0's result
            shared = [ray.put(a) if isinstance(a, dict) else a for a in args]
            futures = [w.call.remote(method, *shared) for w in group.actors]
            doing = DOING.get(method, method)
            result = group.get(futures, doing, "model-parallel worker", where)
            return result[0]

        try:
            group.get(
                [w.start.remote() for w in group.actors], "starting", "model-parallel worker", where
            )
            result = drive_greedy(config, run, resume, call, "model_parallel")
        except BaseException:
            group.close(timeout_s=0.0)  # survivors may hang in a collective: kill them
            raise
        group.close()
        result.summary.update(grid=list(config.model_parallel.grid))
        return result
