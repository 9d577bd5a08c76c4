"""A Sandblaster shard: named float64 vectors over one slice, and commands on them.

The L-BFGS coordinator keeps no parameter vector: x, the gradient g, the search direction,
temporaries and the history pairs s_k / y_k (a ring of m slots) all live here, sliced like
the parameters. The coordinator sends small commands — `dot`, `axpy`, `scale`, `copy`,
`zero`, `norm2`, `mul`, `max_abs`, `push_history` — batched in one call, and only scalars
come back. With S shards, a dot product is the sum of the S partial results.

Gradients arrive from replicas as partial sums, kept apart per replica *incarnation* (a
replica restarted after a failure is a new incarnation) until the coordinator finalises the
batch with the incarnations whose portions it accepted. Pushes of a replica that died
mid-batch are thus dropped whole, and its portions recomputed by others: every example
counts exactly once however replicas fail.

Runs as a Ray actor; checkpoints every vector plus the coordinator's small state as numbered
snapshots (one per L-BFGS iteration, the coordinator's number), so a restarted coordinator
resumes from the newest snapshot every shard holds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaleout.checkpoint import CheckpointDir, load_checkpoint
from scaleout.errors import CheckpointError
from scaleout.ps.wire import Payload, Wire

Command = tuple[Any, ...]


class VectorShard:
    def __init__(self, shard_id: int, numel: int, checkpoint_dir: str | None = None) -> None:
        torch.set_num_threads(1)
        self.shard_id = shard_id
        self.numel = numel
        self.vectors: dict[str, torch.Tensor] = {"x": torch.zeros(numel, dtype=torch.float64)}
        self.sums: dict[str, torch.Tensor] = {}  # incarnation -> gradient sum of its portions
        self.state: dict[str, Any] = {}  # the coordinator's scalars, saved with checkpoints
        self.wire = Wire()
        self.checkpoints = CheckpointDir(Path(checkpoint_dir)) if checkpoint_dir else None

    def initialize(self, vectors: dict[str, np.ndarray]) -> None:
        """Set initial vectors (x, masks)."""
        for name, values in vectors.items():
            self.vectors[name] = torch.from_numpy(np.array(values, dtype=np.float64))

    # --- commands ------------------------------------------------------------------------

    def execute(self, commands: list[Command]) -> list[float | None]:
        """Run commands in order; return one partial scalar (or None) per command."""
        return [self._run(*command) for command in commands]

    def _vector(self, name: str) -> torch.Tensor:
        if name not in self.vectors:
            self.vectors[name] = torch.zeros(self.numel, dtype=torch.float64)
        return self.vectors[name]

    def _run(self, op: str, *args: Any) -> float | None:  # noqa: ANN401
        v = self._vector
        match op:
            case "dot":  # a . b
                return float(torch.dot(v(args[0]), v(args[1])))
            case "norm2":  # a . a
                return float(torch.dot(v(args[0]), v(args[0])))
            case "max_abs":  # max |a_i|
                return float(v(args[0]).abs().max()) if self.numel else 0.0
            case "axpy":  # b += alpha * a
                v(args[2]).add_(v(args[1]), alpha=float(args[0]))
            case "scale":  # a *= alpha
                v(args[1]).mul_(float(args[0]))
            case "copy":  # b = a
                v(args[1]).copy_(v(args[0]))
            case "zero":
                v(args[0]).zero_()
            case "mul":  # out = a * b, element-wise
                torch.mul(v(args[0]), v(args[1]), out=v(args[2]))
            case "push_history":  # slot k of the ring: s_k = a, y_k = b
                slot = int(args[2])
                v(f"s{slot}").copy_(v(args[0]))
                v(f"y{slot}").copy_(v(args[1]))
            case _:
                raise ValueError(f"unknown shard command {op!r}")
        return None

    # --- gradients from replicas ---------------------------------------------------------

    def pull(self, name: str = "x") -> Payload:
        """A vector's slice (float64 array) for replicas."""
        return self._vector(name).numpy()

    def accumulate(self, incarnation: str, payload: Payload) -> None:
        grad = self.wire.decode(payload).to(torch.float64)
        assert grad.numel() == self.numel, "a gradient slice of the wrong size"
        if incarnation in self.sums:
            self.sums[incarnation].add_(grad)
        else:
            self.sums[incarnation] = grad.clone()

    def finalize(self, incarnations: list[str], out: str = "g") -> None:
        """`out` = the sum of the accepted incarnations' gradients; drop every other sum."""
        target = self._vector(out)
        target.zero_()
        for incarnation in incarnations:
            if incarnation in self.sums:
                target.add_(self.sums[incarnation])
        self.sums.clear()

    # --- state ---------------------------------------------------------------------------

    def checkpoint(self, state: dict[str, Any], snapshot: int) -> str | None:
        """Save every vector and the coordinator's `state` as snapshot `snapshot` (the
        coordinator numbers them, so every shard's snapshot k is the same iteration)."""
        self.state = dict(state)
        if self.checkpoints is None:
            return None
        tensors = {f"v.{name}": t for name, t in self.vectors.items()}
        meta = {"shard": self.shard_id, "numel": self.numel, "state": self.state}
        return str(self.checkpoints.save(snapshot, tensors, meta))

    def snapshots(self) -> list[int]:
        """The snapshots on disk (the newest `keep`); a resume picks the newest that every
        shard holds, so a shard killed while saving one does not strand the others."""
        return self.checkpoints.steps() if self.checkpoints is not None else []

    def restore(self, snapshot: int) -> dict[str, Any]:
        """Load snapshot `snapshot`; return the coordinator's state saved with it."""
        assert self.checkpoints is not None
        path = self.checkpoints.path(snapshot)
        tensors, meta = load_checkpoint(path)
        if meta["numel"] != self.numel:
            raise CheckpointError(
                f"shard checkpoint {path} holds {meta['numel']} values, this shard {self.numel}: "
                "the model or sandblaster.num_shards changed"
            )
        self.vectors = {k.removeprefix("v."): t.clone() for k, t in tensors.items()}
        self.state = meta["state"]
        return self.state

    def info(self) -> dict[str, Any]:
        return {"shard": self.shard_id, "pid": os.getpid(), "numel": self.numel}
