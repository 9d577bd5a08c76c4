"""Metrics as JSON lines, and the plots and summary drawn from them.

Every strategy writes `runs/<name>/metrics.jsonl`: one JSON object per logged step with at
least `time_s` (wall seconds since the run started, continued across resumes), `step`,
`examples`, `loss` and `lr`, plus `test_accuracy` / `test_loss` on evaluation steps.
Strategies add their own keys (staleness, bytes sent, ...). A line is flushed as soon as it
is written, so a killed run keeps everything up to its last step.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, TextIO

from scaleout.checkpoint import atomic_write
from scaleout.errors import ConfigError, DiskError

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Append-only JSONL writer, flushed per line; with `tensorboard`, every numeric field is
    also written as a TensorBoard scalar at the record's step (`test_*` under `test/`, the
    rest under `train/`)."""

    def __init__(self, path: Path, tensorboard: Path | None = None) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise DiskError.writing("metrics", path, err) from None
        self._writer = tensorboard_writer(tensorboard) if tensorboard is not None else None
        try:
            self._file: TextIO = open(path, "a")  # noqa: SIM115 - closed by close()
        except OSError as err:
            if self._writer is not None:
                self._writer.close()
            raise DiskError.writing("metrics", path, err) from None

    def log(self, record: dict[str, Any]) -> None:
        """Append one line; a full disk raises a one-line `DiskError` (the lines before stay:
        a torn last line is skipped when read)."""
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:
            raise DiskError.writing("metrics", self.path, err) from None
        if self._writer is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if key != "step" and _finite(value) and not isinstance(value, bool):
                    tag = f"test/{key[5:]}" if key.startswith("test_") else f"train/{key}"
                    self._writer.add_scalar(tag, value, step)
            self._writer.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a flush that fails again (full disk): said already
            self._file.close()
        if self._writer is not None:
            self._writer.close()

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
    """Drop records after `last_step`: a resumed run re-does those steps and logs them again.
    The file is replaced atomically, so a crash here never loses the records kept."""
    if not path.exists():
        return
    kept = "".join(
        json.dumps(r) + "\n" for r in read_metrics(path) if r.get("step", 0) <= last_step
    )
    try:
        atomic_write(path, lambda tmp: tmp.write_text(kept))
    except OSError as err:
        raise DiskError.writing("metrics", path, err, f"{path} is as it was") from None


def tensorboard_writer(directory: Path) -> Any:  # noqa: ANN401 - a SummaryWriter
    """A TensorBoard `SummaryWriter` for `directory`; a clear error when the optional
    dependency is missing."""
    summary_writer = _summary_writer()
    directory.mkdir(parents=True, exist_ok=True)
    return summary_writer(log_dir=str(directory))


def check_tensorboard() -> None:
    """Fail before a run starts when `run.tensorboard = true` cannot be honoured."""
    _summary_writer()


def _summary_writer() -> Any:  # noqa: ANN401 - the SummaryWriter class
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "run.tensorboard = true needs the tensorboard package: pip install "
            "'scaleout[tensorboard]' (or pip install tensorboard), or set run.tensorboard = false"
        ) from None
    return SummaryWriter


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
    tested = [r for r in records if _finite(r.get("test_loss"))]
    if tested:  # the last evaluation's loss, perplexity and the user's own metrics
        for key, value in tested[-1].items():
            if key.startswith("test_") and key != "test_accuracy" and _finite(value):
                summary[f"final_{key}"] = value
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


def plot_terms(
    records: list[dict[str, Any]], terms: list[str], phase_steps: int, out: Path
) -> Path | None:
    """An objective's terms (train, and the test objective where evaluated) against steps,
    one panel per phase of layer-wise training (phase k: steps k * phase_steps + 1 ..)."""
    rows = [r for r in records if all(_finite(r.get(t)) for t in terms)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def phase(record: dict[str, Any]) -> int:
        return (record["step"] - 1) // phase_steps + 1

    phases = sorted({phase(r) for r in rows})
    fig, axes = plt.subplots(1, len(phases), figsize=(4.5 * len(phases), 3.6), squeeze=False)
    for ax, k in zip(axes[0], phases, strict=True):
        mine = [r for r in rows if phase(r) == k]
        steps = [r["step"] for r in mine]
        for term in terms:
            ax.plot(steps, [r[term] for r in mine], label=term)
        tested = [r for r in mine if _finite(r.get("test_loss"))]
        if tested:
            ax.plot(
                [r["step"] for r in tested],
                [r["test_loss"] for r in tested],
                "o-",
                label="test objective",
            )
        ax.set_title(f"phase {k}")
        ax.set_xlabel("step")
        if all(r[t] > 0 for r in mine for t in terms):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("per example")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
