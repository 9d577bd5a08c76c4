"""A worker's training minibatches, read from where it stands.

The order depends only on (seed, epoch) and the worker's part of each batch, so a worker put
at any (epoch, batch) reads what an uninterrupted one would read there: a resumed run and a
restarted replica go on exactly where they stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from scaleout.data import make_loader, num_batches
from scaleout.data.config import LoaderSection
from scaleout.data.prefetch import DevicePrefetcher

Batch = tuple[Tensor, ...]


class Batches:
    """Minibatches of `batch_size` from `dataset`, shuffled by `seed` and the epoch; with
    `num_parts` > 1 this worker's `part` of each (sync's slices). A last partial batch is
    dropped when the set holds at least one whole batch. `finish` runs on each batch once
    it is on `device` (8-bit pixels made float there)."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        loader: LoaderSection,
        device: torch.device,
        finish: Callable[[Batch], Batch] | None = None,
        part: int = 0,
        num_parts: int = 1,
    ) -> None:
        assert isinstance(dataset, Sized)
        self.dataset, self.batch_size, self.loader = dataset, batch_size, loader
        self.device, self.finish, self.part, self.num_parts = device, finish, part, num_parts
        self.drop_last = len(dataset) >= batch_size
        self.per_epoch = num_batches(len(dataset), batch_size, self.drop_last)
        self.seed = 0
        self.epoch = self.batch = 0  # the next minibatch: batch `batch` of epoch `epoch`
        self._reading: Iterator[Batch] | None = None

    def seek(self, epoch: int = 0, batch: int = 0, seed: int | None = None) -> None:
        """Read from batch `batch` of epoch `epoch` on (with `seed`, a new order)."""
        self.epoch, self.batch = epoch, batch
        if seed is not None:
            self.seed = seed
        self._reading = None

    def next(self) -> Batch:
        """The next minibatch; the epoch turns after its last one."""
        if self._reading is None:
            self._reading = self._open()
        try:
            batch = next(self._reading)
        except StopIteration:
            self.epoch, self.batch = self.epoch + 1, 0
            self._reading = self._open()
            batch = next(self._reading)
        self.batch += 1
        return batch

    def peek(self) -> Batch:
        """The next minibatch, left to be read next."""
        batch = next(self._open())
        self._reading = None
        return batch

    def _open(self) -> Iterator[Batch]:
        loader = make_loader(
            self.dataset,
            self.batch_size,
            shuffle=True,
            seed=self.seed,
            epoch=self.epoch,
            start_batch=self.batch,
            workers=self.loader.workers,
            pin_memory=self.loader.pins(self.device),
            drop_last=self.drop_last,
            prefetch_factor=self.loader.prefetch_factor,
            part=self.part,
            num_parts=self.num_parts,
        )
        ahead = self.loader.device_prefetch
        return iter(DevicePrefetcher(loader, self.device, ahead, finish=self.finish))

    def position(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch}
