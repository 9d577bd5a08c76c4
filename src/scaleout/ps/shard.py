"""One parameter-server shard: a slice of the flat parameter vector and its optimizer.

The shard applies every pushed gradient itself, with the same torch.optim optimizer the
single-worker strategy uses (SGD, momentum, Adagrad, RMSProp, Adam are element-wise, so S
shards stepping their slices equal one optimizer stepping the whole vector). Versions count
applied updates; the staleness of a push is the shard's version when it arrives minus the
version the replica had fetched.

A shard checkpoints its slice and optimizer state every `checkpoint_every` updates or
`checkpoint_seconds` seconds (safetensors + verified JSON sidecar, atomic). When Ray
restarts a shard after its process dies, the constructor runs again and resumes from the
latest checkpoint; the updates applied since that checkpoint are lost, and `info()` says how
many versions it went back to.

Runs as a Ray actor (`ray.remote(ParameterShard)`), one call at a time, so pulls and pushes
see a consistent slice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from scaleout.checkpoint import (
    CheckpointDir,
    load_checkpoint,
    load_optimizer_state,
    optimizer_state,
)
from scaleout.compress import CompressSection
from scaleout.errors import CheckpointError
from scaleout.nn.optim import OptimizerOptions, build_optimizer
from scaleout.ps.wire import Payload, Wire


class ParameterShard:
    def __init__(
        self,
        shard_id: int,
        numel: int,
        optimizer: OptimizerOptions,
        compress: CompressSection | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        checkpoint_seconds: float | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.shard_id = shard_id
        self.wire = Wire(compress)  # gradients arrive compressed as configured
        self.pull_wire = Wire()  # parameters leave in fp32: 8 bits would drop small updates
        self.param = nn.Parameter(torch.zeros(numel))  # (n,) set by initialize() or a checkpoint
        self.param.grad = torch.zeros_like(self.param)
        self.optimizer = build_optimizer([self.param], optimizer)
        self.version = 0
        self.checkpoints = CheckpointDir(Path(checkpoint_dir)) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.checkpoint_seconds = checkpoint_seconds
        self.restored_version: int | None = None
        self.stats = {"pushes": 0, "pulls": 0, "bytes_in": 0, "bytes_out": 0, "staleness_sum": 0}
        if self.checkpoints is not None and self.checkpoints.latest() is not None:
            self._restore(self.checkpoints.latest())
        self._saved_version = self.version
        self._saved_at = time.monotonic()

    def initialize(self, values: np.ndarray) -> int:
        """Set the initial slice unless a checkpoint was restored; return the version.

        The initial state is checkpointed at once, so a shard Ray restarts before its first
        periodic checkpoint still comes back with its values (Ray keeps no constructor
        arguments for it: they are small).
        """
        if self.restored_version is None:
            with torch.no_grad():
                self.param.copy_(torch.from_numpy(np.array(values, dtype=np.float32)))
            if self.checkpoints is not None:
                self.checkpoint()
        return self.version

    # --- the two calls of Downpour SGD ---------------------------------------------------

    def pull(self) -> tuple[Payload, int]:
        """The current slice and its version."""
        payload = self.pull_wire.encode(self.param.detach())
        self.stats["pulls"] += 1
        self.stats["bytes_out"] += Wire.nbytes(payload)
        return payload, self.version

    def push(self, payload: Payload, base_version: int) -> tuple[int, int]:
        """Apply one gradient; return (new version, staleness of this push)."""
        grad = self.wire.decode(payload)
        if grad.shape != self.param.shape:
            raise ValueError(
                f"shard {self.shard_id} holds {self.param.numel()} values, got a gradient of "
                f"{grad.numel()}"
            )
        staleness = self.version - base_version
        self.param.grad.copy_(grad)
        self.optimizer.step()
        self.version += 1
        self.stats["pushes"] += 1
        self.stats["bytes_in"] += Wire.nbytes(payload)
        self.stats["staleness_sum"] += staleness
        self._maybe_checkpoint()
        return self.version, staleness

    # --- state ---------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {
            "shard": self.shard_id,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "version": self.version,
            "numel": self.param.numel(),
            "restored_version": self.restored_version,
            "checkpoint_version": self._saved_version,
            **self.stats,
        }

    def values(self) -> np.ndarray:
        """The slice, uncompressed (evaluation, checkpoints of the whole model, tests)."""
        return self.param.detach().numpy()

    def checkpoint(self) -> str | None:
        if self.checkpoints is None:
            return None
        tensors, optim_meta = optimizer_state(self.optimizer)
        tensors["param"] = self.param.detach()
        meta = {"shard": self.shard_id, "version": self.version, "optimizer": optim_meta}
        path = self.checkpoints.save(self.version, tensors, meta)
        self._saved_version, self._saved_at = self.version, time.monotonic()
        return str(path)

    def _maybe_checkpoint(self) -> None:
        if self.checkpoints is None:
            return
        by_count = (
            self.checkpoint_every and self.version - self._saved_version >= self.checkpoint_every
        )
        by_time = (
            self.checkpoint_seconds and time.monotonic() - self._saved_at >= self.checkpoint_seconds
        )
        if by_count or by_time:
            self.checkpoint()

    def _restore(self, path: Path) -> None:
        tensors, meta = load_checkpoint(path)
        if tensors["param"].shape != self.param.shape:
            raise CheckpointError(
                f"shard checkpoint {path} holds {tensors['param'].numel()} values, this shard "
                f"{self.param.numel()}: the model or downpour.num_shards changed"
            )
        with torch.no_grad():
            self.param.copy_(tensors["param"])
        load_optimizer_state(self.optimizer, tensors, meta["optimizer"])
        self.version = self.restored_version = int(meta["version"])
