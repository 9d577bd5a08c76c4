"""Parallel loading (Ding et al. 2015, section 2.1): batch k+1 is prepared while batch k trains.

The pipeline, from disk to the device:

1. loader processes (`loader.workers` of them, `make_loader`) read, decode and preprocess
   whole batches, `prefetch_factor` batches each ahead of training; each batch is built in
   shared memory (`ImageDataset.__getitems__`), so the training process receives a handle,
   not a copy of the pixels;
2. on CUDA, the DataLoader's pin thread moves the batch into page-locked memory
   (`loader.pin_memory`), the one copy an asynchronous host-to-device transfer needs;
3. `DevicePrefetcher` starts the non-blocking transfer of batch k+1 on a side stream as soon
   as batch k is handed to the training step, and makes the compute stream wait for it only
   when k+1 is used. On the CPU the transfer is a no-op and batches pass through untouched;
4. with `loader.uint8`, `finish` (`scaleout.data.uint8.FinishOnDevice`) turns the 8-bit
   pixels into the float batch on the device, on the same side stream.

`loader.workers = 0` turns steps 1 and 2 off (the training process loads each batch itself,
between steps), which is the comparison the benchmark makes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["DevicePrefetcher"]

Batch = tuple[torch.Tensor, ...]


class DevicePrefetcher:
    """Iterate over `batches` with every tensor already on `device`, one batch ahead, each
    passed through `finish` there when given."""

    def __init__(
        self,
        batches: Iterable[Batch],
        device: torch.device,
        ahead: bool = True,
        finish: Callable[[Batch], Batch] | None = None,
    ) -> None:
        self.batches, self.device, self.finish = batches, torch.device(device), finish
        self.ahead = ahead and self.device.type != "cpu"
        self.stream: Any = None
        if self.ahead and self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)

    def _moved(self, batch: Batch) -> Batch:
        batch = tuple(t.to(self.device, non_blocking=True) for t in batch)
        return batch if self.finish is None else self.finish(batch)

    def _transfer(self, batch: Batch) -> Batch:
        if self.stream is None:
            return self._moved(batch)
        with torch.cuda.stream(self.stream):
            return self._moved(batch)

    def _hand_over(self, batch: Batch) -> Batch:
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for tensor in batch:  # the side stream's memory is now used by the compute stream
                tensor.record_stream(current)
        return batch

    def __iter__(self) -> Iterator[Batch]:
        if not self.ahead:
            for batch in self.batches:
                yield self._moved(batch)
            return
        source = iter(self.batches)
        try:
            pending = self._transfer(next(source))
        except StopIteration:
            return
        for batch in source:
            following = self._transfer(batch)  # starts while the caller trains on `pending`
            yield self._hand_over(pending)
            pending = following
        yield self._hand_over(pending)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]
