"""Parallel training over groups of workers: synchronous data parallelism (and, later,
model parallelism). Imports Ray and torch.distributed; `scaleout.optim` loads it lazily."""

from scaleout.parallel.data_parallel import (
    SyncTrainer,
    SyncWorker,
    WorkerDied,
    average_tensors,
    train_sync,
)

__all__ = ["SyncTrainer", "SyncWorker", "WorkerDied", "average_tensors", "train_sync"]
