"""The directory of one run: `runs/<name>/` with its metrics, plot, config and checkpoints.

A run directory that already holds a run is never written over by accident: training into
it needs `--resume` (continue from the last checkpoint) or `--overwrite` (start again,
deleting only the files a run writes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scaleout.checkpoint import CheckpointDir
from scaleout.config import RunConfig
from scaleout.errors import UserError
from scaleout.metrics import METRICS_FILE, PLOT_FILE, plot_metrics, read_metrics, summarize

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
# Everything a run writes into its directory, relative to it: `--overwrite` deletes these.
RUN_FILES = (
    "metrics.jsonl",
    "metrics.png",
    "config.json",
    "pushes.jsonl",
    "checkpoints/step_*",
    "shards/shard_*/step_*",
)


class RunDir:
    def __init__(self, path: Path, keep_checkpoints: int = 2) -> None:
        self.path = path
        self.metrics = path / METRICS_FILE
        self.plot = path / PLOT_FILE
        self.config = path / CONFIG_FILE
        self.checkpoints = CheckpointDir(path / CHECKPOINT_DIR, keep_checkpoints)

    @classmethod
    def prepare(cls, config: RunConfig, resume: bool = False, overwrite: bool = False) -> RunDir:
        """Create (or reuse, with `resume`/`overwrite`) the run directory of `config`."""
        run = cls(config.run_dir, config.train.keep_checkpoints)
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
        run.config.write_text(json.dumps(config.model_dump(mode="json"), indent=1))
        return run

    def clear(self) -> None:
        """Delete what a run writes here (`RUN_FILES`), and nothing else."""
        for pattern in RUN_FILES:
            for path in self.path.glob(pattern):
                path.unlink(missing_ok=True)

    def finish(self) -> dict[str, Any]:
        """Draw the plot from the metrics and return the run's summary."""
        records = read_metrics(self.metrics)
        if records:
            plot_metrics(records, self.plot, title=self.path.name)
        return summarize(records)
