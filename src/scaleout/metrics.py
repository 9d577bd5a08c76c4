"""Metrics as JSON lines, and the plots and summary drawn from them.

Every strategy writes `runs/<name>/metrics.jsonl`: one JSON object per logged step with at
least `time_s` (wall seconds since the run started, continued across resumes), `step`,
`examples`, `loss` and `lr`, plus `test_accuracy` / `test_loss` on evaluation steps.
Strategies add their own keys (staleness, bytes sent, ...). A line is flushed as soon as it
is written, so a killed run keeps everything up to its last step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


class MetricsLog:
    """Append-only JSONL writer, flushed per line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(path, "a")  # noqa: SIM115 - closed by close()

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete records; a torn last line (a process killed mid-write) is skipped."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after `last_step`: a resumed run re-does those steps and logs them again."""
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Final and best figures of a run, for the summary table."""
    if not records:
        return {}
    last = records[-1]
    evals = [r for r in records if r.get("test_accuracy") is not None]
    losses = [r["loss"] for r in records if _finite(r.get("loss"))]
    summary: dict[str, Any] = {
        "steps": last.get("step"),
        "examples": last.get("examples"),
        "time_s": last.get("time_s"),
        "final_loss": losses[-1] if losses else None,
    }
    if last.get("time_s"):
        summary["examples_per_s"] = last.get("examples", 0) / last["time_s"]
    if evals:
        best = max(evals, key=lambda r: r["test_accuracy"])
        summary["final_test_accuracy"] = evals[-1]["test_accuracy"]
        summary["best_test_accuracy"] = best["test_accuracy"]
        summary["best_at_step"] = best["step"]
    return summary


def _finite(value: Any) -> bool:  # noqa: ANN401
    return isinstance(value, int | float) and math.isfinite(value)


def plot_metrics(records: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Loss and test accuracy against wall time and against examples seen, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if _finite(r.get("loss"))]
    evals = [r for r in records if _finite(r.get("test_accuracy"))]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex="col")
    for column, (x_key, x_label) in enumerate(
        [("time_s", "wall time (s)"), ("examples", "examples")]
    ):
        loss_ax, acc_ax = axes[0][column], axes[1][column]
        loss_ax.plot([r[x_key] for r in train], [r["loss"] for r in train], label="train loss")
        if any(_finite(r.get("test_loss")) for r in evals):
            loss_ax.plot(
                [r[x_key] for r in evals], [r["test_loss"] for r in evals], "o-", label="test loss"
            )
        loss_ax.set_ylabel("loss")
        loss_ax.set_yscale("log" if train and min(r["loss"] for r in train) > 0 else "linear")
        loss_ax.legend(loc="upper right")
        acc_ax.plot(
            [r[x_key] for r in evals], [100 * r["test_accuracy"] for r in evals], "o-", color="C2"
        )
        acc_ax.set_ylabel("test accuracy (%)")
        acc_ax.set_xlabel(x_label)
        for ax in (loss_ax, acc_ax):
            ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
