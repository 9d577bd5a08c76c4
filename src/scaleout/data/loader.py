"""Deterministic, resumable batching.

A run that is stopped mid-epoch and resumed from a checkpoint must see exactly the batches
the uninterrupted run would have seen, or resuming changes the result. So the order of an
epoch is a permutation drawn from a generator seeded by (seed, epoch) only — never by
global RNG state — and a resumed run skips to its batch with `start_batch` instead of
replaying the loader. Worker processes are seeded from (seed, epoch, worker_id) so that any
randomness inside a dataset is reproducible too.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

__all__ = ["ShuffledBatchSampler", "derive_seed", "make_loader", "num_batches"]

_MASK64 = (1 << 64) - 1
_LOADER = 0x4C4F4144  # stream tag of the loader's own generator


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from a tuple of integers.

    Seeding generators with `seed + epoch` or similar makes neighbouring streams overlap
    (seed 1 epoch 0 == seed 0 epoch 1); hashing the whole tuple keeps them independent.
    """
    h = 0x2545F4914F6CDD1D
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1  # fits torch.Generator.manual_seed and numpy in every context


def num_batches(num_examples: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches in one epoch: the trainer uses this to turn a step count into (epoch, batch)."""
    if batch_size < 1:
        raise ValueError(f"train.batch_size must be >= 1, got {batch_size}")
    if drop_last:
        return num_examples // batch_size
    return math.ceil(num_examples / batch_size)


class ShuffledBatchSampler(Sampler[list[int]]):
    """Yields lists of indices: batch `start_batch`, `start_batch + 1`, ... of one epoch.

    The epoch's order depends on (seed, epoch) alone, so `start_batch=b` yields exactly the
    tail of the sequence an uninterrupted run produces. With `num_parts > 1` it yields only
    slice `part` of each (global) batch: data-parallel workers together see exactly the
    batches one worker would.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        seed: int,
        epoch: int = 0,
        start_batch: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        part: int = 0,
        num_parts: int = 1,
    ) -> None:
        if not 0 <= part < num_parts:
            raise ValueError(f"part must be in [0, num_parts = {num_parts}), got {part}")
        if num_examples < 0:
            raise ValueError(f"num_examples must be >= 0, got {num_examples}")
        total = num_batches(num_examples, batch_size, drop_last)
        if not 0 <= start_batch <= total:
            raise ValueError(
                f"start_batch must be between 0 and {total} (batches per epoch), got {start_batch}"
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = epoch
        self.start_batch = start_batch
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.total_batches = total
        self.part, self.num_parts = part, num_parts

    def order(self) -> torch.Tensor:
        """The full index order of this epoch, (num_examples,) int64."""
        if not self.shuffle:
            return torch.arange(self.num_examples)
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch))
        return torch.randperm(self.num_examples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for b in range(self.start_batch, self.total_batches):
            batch = order[b * self.batch_size : (b + 1) * self.batch_size]
            if self.num_parts > 1:  # this worker's slice of the global batch
                batch = torch.tensor_split(batch, self.num_parts)[self.part]
            yield batch.tolist()

    def __len__(self) -> int:
        return self.total_batches - self.start_batch


def _seed_worker(seed: int, epoch: int, worker_id: int) -> None:
    """Seed every global RNG a dataset might use inside worker `worker_id`."""
    s = derive_seed(seed, epoch, worker_id)
    torch.manual_seed(s)
    np.random.seed(s % (1 << 32))
    random.seed(s)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    start_batch: int = 0,
    workers: int = 0,
    pin_memory: bool = False,
    drop_last: bool = False,
    prefetch_factor: int = 2,
    part: int = 0,
    num_parts: int = 1,
) -> DataLoader:
    """A DataLoader over one epoch (from `start_batch` on) with a deterministic order.

    Datasets with `__getitems__` and `collate` (ArrayDataset, SyntheticDataset) build a
    whole batch by one tensor index, which is much faster than collating single examples.
    `workers > 0` prepares batches in that many processes, `prefetch_factor` batches each
    ahead, handed over in shared memory (see `scaleout.data.prefetch`). `part` of
    `num_parts`: this data-parallel worker's slice of every batch. A dataset with
    `set_epoch` is told the epoch first (its random crops and flips depend on it).
    """
    if batch_size < 1:
        raise ValueError(f"train.batch_size must be >= 1, got {batch_size}")
    if workers < 0:
        raise ValueError(f"loader.workers must be >= 0, got {workers}")
    sampler = ShuffledBatchSampler(
        len(dataset),  # type: ignore[arg-type]
        batch_size,
        seed,
        epoch=epoch,
        start_batch=start_batch,
        shuffle=shuffle,
        drop_last=drop_last,
        part=part,
        num_parts=num_parts,
    )
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    has_batched = hasattr(dataset, "__getitems__") and hasattr(dataset, "collate")
    collate = dataset.collate if has_batched else default_collate  # type: ignore[attr-defined]
    extra: dict[str, Any] = {}
    if workers > 0:
        extra = {
            "worker_init_fn": functools.partial(_seed_worker, seed, epoch),
            "persistent_workers": False,
            "prefetch_factor": prefetch_factor,
        }
    # DataLoader draws a base seed per iterator; from its own generator, not the global RNG,
    # so creating a loader mid-epoch on resume leaves the model's dropout stream unchanged.
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch, _LOADER))
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        pin_memory=pin_memory,
        generator=generator,
        **extra,
    )
