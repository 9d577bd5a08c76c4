"""The live progress bar of a training run (rich), on stderr."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Logs and pipes get 120 columns, where rich would assume 80 and cut the bar's fields. No
# markup: messages carry error texts and paths with brackets ("[/path/file.cc:78]").
console = Console(
    stderr=True,
    soft_wrap=True,
    highlight=False,
    markup=False,
    width=None if sys.stderr.isatty() else 120,
)


class TrainingProgress:
    """Steps done of total, with loss, accuracy and examples/s beside the bar.

    Where stderr is not a terminal (CI, a log file) the bar is drawn once at the end, so
    `log` lines (one per evaluation) are printed there instead.
    """

    def __init__(self, total: int, completed: int = 0, description: str = "train") -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        self._task: TaskID = self._progress.add_task(
            description, total=total, completed=completed, status=""
        )
        self.fields: dict[str, str] = {}

    def update(self, completed: int, **fields: str) -> None:
        self.fields.update(fields)
        status = " ".join(self.fields.values())
        self._progress.update(self._task, completed=completed, status=status)

    def log(self, message: str) -> None:
        """A line for logs; on a terminal the live bar already shows it."""
        if not console.is_terminal:
            console.print(message)

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
