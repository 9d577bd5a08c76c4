"""The client side of the sharded parameter server.

`ParameterServer` holds the shard actors and their ranges of the flat parameter vector.
Pulls and pushes go to all shards at once (one Ray call per shard, in parallel): a pull
waits for every slice and writes it into the caller's flat buffer; a push returns at once
with one future per shard, so the caller can go on computing while the shards apply it.
The object is small and serialisable, so the driver hands it to every replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError

from scaleout.compress import CompressSection
from scaleout.nn.optim import OptimizerOptions
from scaleout.ps.layout import shard_ranges
from scaleout.ps.shard import ParameterShard
from scaleout.ps.wire import Wire
from scaleout.runtime import kill, spawn

# A shard restarted by Ray takes a few seconds to come back; callers retry this long.
RETRY_SECONDS = 120.0


class ParameterServer:
    """The client side of S shards holding one flat vector (`ranges[i]` on shard i)."""

    def __init__(
        self, shards: list[Any], ranges: list[tuple[int, int]], compress: CompressSection | None
    ) -> None:
        self.shards = shards
        self.ranges = ranges
        self.compress = compress
        self.wire = Wire(compress)  # pushes (gradients), as configured
        self.pull_wire = Wire()  # pulls (parameters) in fp32
        self._initial: torch.Tensor | None = None  # until every shard holds its slice
        self._pending: list[Any] = []

    @classmethod
    def create(
        cls,
        initial: torch.Tensor,
        num_shards: int,
        optimizer: OptimizerOptions,
        compress: CompressSection | None = None,
        checkpoint_root: Path | None = None,
        checkpoint_every: int | None = None,
        checkpoint_seconds: float | None = None,
        max_restarts: int = 10,
        resource: str | None = None,
        wait: bool = True,
    ) -> ParameterServer:
        """Start `num_shards` shard actors holding `initial` (P,), or their checkpoints in
        `checkpoint_root/shard_<i>` when they have some; each applies pushed gradients with
        the optimizer `optimizer` names.

        With `resource`, shards run only on nodes that offer that custom Ray resource.
        """
        ranges = shard_ranges(initial.numel(), num_shards)
        shards = [
            spawn(
                ParameterShard,
                i,
                stop - start,
                optimizer,
                compress,
                str(checkpoint_root / f"shard_{i}") if checkpoint_root else None,
                checkpoint_every,
                checkpoint_seconds,
                num_cpus=0,
                max_restarts=max_restarts,
                resource=resource,
            )
            for i, (start, stop) in enumerate(ranges)
        ]
        flat = initial.detach().to("cpu", torch.float32)
        server = cls(shards, ranges, compress)
        server._initial = flat
        server._pending = [
            shard.initialize.remote(flat[start:stop].numpy())
            for shard, (start, stop) in zip(shards, ranges, strict=True)
        ]
        if wait:
            server.wait()
        return server

    def wait(self) -> None:
        """Wait until every shard holds its initial slice (or its checkpoint): `create(...,
        wait=False)` lets several servers start their processes at once."""
        if not self._pending:
            return
        flat = self._initial
        try:
            ray.get(self._pending)
        except RayActorError:  # a shard died while starting: Ray restarts it, ask again
            ranges = self.ranges
            _get_with_retry(
                lambda i: self.shards[i].initialize.remote(
                    flat[ranges[i][0] : ranges[i][1]].numpy()  # type: ignore[index]
                ),
                len(self.shards),
            )
        self._pending, self._initial = [], None

    def __reduce__(self) -> tuple[type[ParameterServer], tuple[Any, ...]]:  # shards and ranges
        return ParameterServer, (self.shards, self.ranges, self.compress)

    @property
    def numel(self) -> int:
        return self.ranges[-1][1]

    def pull_into(self, out: torch.Tensor) -> tuple[list[int], int]:
        """Fetch every shard's slice into `out` (P,); return (versions, bytes received)."""
        results = _get_with_retry(lambda i: self.shards[i].pull.remote(), len(self.shards))
        versions, received = [], 0
        for (start, stop), (payload, version) in zip(self.ranges, results, strict=True):
            out[start:stop].copy_(self.pull_wire.decode(payload))
            versions.append(version)
            received += Wire.nbytes(payload)
        return versions, received

    def push(self, grads: torch.Tensor, base_versions: list[int]) -> tuple[list[Any], int]:
        """Send each shard its slice of `grads` (P,); return (futures, bytes sent) at once."""
        futures, sent = [], 0
        for shard, (start, stop), version in zip(
            self.shards, self.ranges, base_versions, strict=True
        ):
            payload = self.wire.encode(grads[start:stop], key=len(futures))  # key: the shard
            futures.append(shard.push.remote(payload, version))
            sent += Wire.nbytes(payload)
        return futures, sent

    def values(self) -> torch.Tensor:
        """The whole parameter vector, uncompressed (P,)."""
        slices = _get_with_retry(lambda i: self.shards[i].values.remote(), len(self.shards))
        return torch.from_numpy(np.concatenate(slices))  # a writable copy of the slices

    def checkpoint(self) -> list[str | None]:
        return _get_with_retry(lambda i: self.shards[i].checkpoint.remote(), len(self.shards))

    def info(self) -> list[dict[str, Any]]:
        return _get_with_retry(lambda i: self.shards[i].info.remote(), len(self.shards))

    def kill(self) -> None:
        kill(self.shards)


def _get_with_retry(call: Callable[[int], Any], num_shards: int) -> list[Any]:
    """Call every shard in parallel; re-issue calls to shards that are restarting."""
    futures = [call(i) for i in range(num_shards)]
    results: list[Any] = [None] * num_shards
    deadline = time.monotonic() + RETRY_SECONDS
    pending = set(range(num_shards))
    while pending:
        for i in sorted(pending):
            try:
                results[i] = ray.get(futures[i])
                pending.discard(i)
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                futures[i] = call(i)
    return results
