"""The live progress bar of a training run (rich), on stderr."""

from __future__ import annotations

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

console = Console(stderr=True, soft_wrap=True, highlight=False)


class TrainingProgress:
    """Steps done of total, with loss, accuracy and examples/s beside the bar."""

    def __init__(self, total: int, completed: int = 0, description: str = "train") -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task: TaskID = self._progress.add_task(
            description, total=total, completed=completed, status=""
        )
        self.fields: dict[str, str] = {}

    def update(self, completed: int, **fields: str) -> None:
        self.fields.update(fields)
        status = "  ".join(f"{k} {v}" for k, v in self.fields.items())
        self._progress.update(self._task, completed=completed, status=status)

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
