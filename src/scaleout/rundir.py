"""The directory of one run: `runs/<name>/` with its metrics, plot, config and checkpoints.

A run directory that already holds a run is never written over by accident: training into
it needs `--resume` (continue from the last checkpoint) or `--overwrite` (start again,
deleting only the files a run writes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from scaleout.checkpoint import CheckpointDir, atomic_write
from scaleout.errors import UserError
from scaleout.metrics import (
    METRICS_FILE,
    PLOT_FILE,
    TENSORBOARD_DIR,
    plot_metrics,
    read_metrics,
    summarize,
)

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
SHARD_DIR = "shards"
# Everything a run writes into its directory, relative to it: `--overwrite` deletes these.
RUN_FILES = (
    "metrics.jsonl",
    "metrics.png",
    "config.json",
    "pushes.jsonl",
    "filters.png",
    "objective.png",
    "checkpoints/step_*",
)
RUN_DIRS = (SHARD_DIR, TENSORBOARD_DIR)  # written only by runs: deleted whole


class RunDir:
    def __init__(self, path: Path, keep_checkpoints: int = 2) -> None:
        self.path = Path(path)
        self.metrics = self.path / METRICS_FILE
        self.plot = self.path / PLOT_FILE
        self.config = self.path / CONFIG_FILE
        self.shards = self.path / SHARD_DIR
        self.tensorboard = self.path / TENSORBOARD_DIR
        self.checkpoints = CheckpointDir(self.path / CHECKPOINT_DIR, keep_checkpoints)

    @classmethod
    def prepare(
        cls,
        path: Path,
        record: dict[str, Any],
        keep_checkpoints: int = 2,
        resume: bool = False,
        overwrite: bool = False,
    ) -> RunDir:
        """Create (or reuse, with `resume`/`overwrite`) the run directory `path`, and write
        the run's config (`record`) to `config.json`."""
        run = cls(path, keep_checkpoints)
        holds_run = run.metrics.exists() or bool(run.checkpoints.steps())
        if resume and not run.checkpoints.steps():
            raise UserError(
                f"--resume: {run.path} has no checkpoint to resume from; "
                "run without --resume to start the run"
            )
        if holds_run and not (resume or overwrite):
            raise UserError(
                f"{run.path} already holds a run; pass --resume to continue it, --overwrite to "
                "start again, or choose another run.name / --out"
            )
        if overwrite and not resume:
            run.clear()
        run.path.mkdir(parents=True, exist_ok=True)
        text = json.dumps(record, indent=1)
        atomic_write(run.config, lambda tmp: tmp.write_text(text))
        return run

    def clear(self) -> None:
        """Delete what a run writes here (`RUN_FILES`, `RUN_DIRS`), and nothing else."""
        for pattern in RUN_FILES:
            for path in self.path.glob(pattern):
                path.unlink(missing_ok=True)
        for name in RUN_DIRS:
            shutil.rmtree(self.path / name, ignore_errors=True)

    def stopped_at(self, step: int) -> str:
        """Where a run that could not go on stopped: the step, and what resumes it."""
        latest = self.checkpoints.latest()
        return f"at step {step}; " + (
            f"the last checkpoint is {latest} (continue with --resume)"
            if latest
            else "no checkpoint was written yet (start the run again)"
        )

    def finish(self) -> dict[str, Any]:
        """Draw the plot from the metrics and return the run's summary."""
        records = read_metrics(self.metrics)
        if records:
            plot_metrics(records, self.plot, title=self.path.name)
        return summarize(records)
