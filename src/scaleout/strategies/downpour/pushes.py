"""Downpour's push records: `pushes.jsonl` in the run directory (one line per push: wall
time, replica (and grid worker), steps, loss, staleness, bytes sent and received, seconds
spent fetching, computing and pushing, the gradient's norm before clipping), and the
statistics of a metrics line's window."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from scaleout.metrics import MetricsLog

PUSHES_FILE = "pushes.jsonl"


class Pushes:
    """The push log, and the window of pushes and steps since the last metrics line."""

    def __init__(self, path: Path, wall_start: float) -> None:
        self.file = MetricsLog(path)
        self.wall_start = wall_start
        self.steps = 0
        self._window = _Window()

    def log(
        self, records: list[dict[str, Any]], step: int, examples: int, lr: float | None
    ) -> None:
        """Write the records of pushes the shards applied (`t`: wall time of the push)."""
        for push in records:
            push["time_s"] = round(push.pop("t") - self.wall_start, 4)
            push.update(step=step, examples=examples, lr=lr)
            self.file.log(push)
            self._window.add(push)

    def window(self, batch_size: int) -> dict[str, Any]:
        """The window's statistics for a metrics line; a new window starts."""
        fields = self._window.fields(self.steps, batch_size)
        self._window, self.steps = _Window(), 0
        return fields

    def close(self) -> None:
        self.file.close()


class _Window:
    """Push records and steps between two metrics lines."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.staleness: list[float] = []
        self.staleness_max = 0
        self.bytes_sent = self.bytes_received = 0
        self.grad_norms: list[float] = []

    def add(self, push: dict[str, Any]) -> None:
        if push.get("staleness") is not None:
            self.staleness.append(push["staleness"])
            self.staleness_max = max(self.staleness_max, push["staleness_max"])
        self.bytes_sent += push.get("bytes_sent", 0)
        self.bytes_received += push.get("bytes_received", 0)
        if push.get("grad_norm") is not None:
            self.grad_norms.append(push["grad_norm"])

    def fields(self, steps: int, batch_size: int) -> dict[str, Any]:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        updates = steps / seconds
        fields: dict[str, Any] = {
            "updates_per_s": updates,
            "examples_per_s": updates * batch_size,
            "staleness_mean": sum(self.staleness) / len(self.staleness) if self.staleness else None,
            "staleness_max": self.staleness_max,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }
        if self.grad_norms:  # the pushes' gradient norms before clipping, their mean
            fields["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return fields
