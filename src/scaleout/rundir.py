"""The directory of one run: `runs/<name>/` with its metrics, plot, config and checkpoints.

A run directory that already holds a run is never written over by accident: training into
it needs `--resume` (continue from the last checkpoint) or `--overwrite` (start again,
deleting only the files a run writes).

Two runs never write one directory at once: `RunDir.prepare` takes `<run>/.lock` (an OS
file lock, which dies with the process that held it, however it ended) and holds it until
the run is closed; a second run fails at once, naming the first one's process.

`--overwrite` deletes nothing until the new run has started. `prepare` moves what earlier
runs wrote aside into `<run>/.previous/` (for a run that does not resume; without
`--overwrite` that can only be the leftovers of runs that never trained); the driver calls
`commit()` once the strategy has started, just before the first metrics line or checkpoint,
and only then is the aside copy deleted. `close()` before a commit (a bad value found at
start-up, a worker that cannot start, Ctrl-C, a `Run` never trained) removes the new run's
few files (its config.json, its shards' first checkpoints) and puts the previous ones back:
a run that never started leaves the directory as it found it. A `.previous/` left behind by
a process killed in between is put back by the next run into the directory: the killed run
had written no metrics and no checkpoint of its own, as it had not committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import weakref
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from scaleout.checkpoint import CheckpointDir, atomic_write
from scaleout.errors import DiskError, UserError
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
LOCK_FILE = ".lock"  # held by the run writing the directory
OWNER_FILE = ".lock.owner"  # its pid and host, for the message a second run gets
ASIDE_DIR = ".previous"  # the previous run's files while an --overwrite starts
_MOVING = ".previous.moving"  # files on their way aside or back: all go back
_DISCARD = ".previous.discard"  # a committed aside copy being deleted


class RunDir:
    """The paths of one run. `RunDir(path)` only names them; `RunDir.prepare` also locks
    the directory for a run, until `close()`."""

    def __init__(self, path: Path, keep_checkpoints: int = 2) -> None:
        self.path = Path(path)
        self.metrics = self.path / METRICS_FILE
        self.plot = self.path / PLOT_FILE
        self.config = self.path / CONFIG_FILE
        self.shards = self.path / SHARD_DIR
        self.tensorboard = self.path / TENSORBOARD_DIR
        self.checkpoints = CheckpointDir(self.path / CHECKPOINT_DIR, keep_checkpoints)
        self.recovered = False  # prepare put back a previous run a killed --overwrite left
        self._hold: _Hold | None = None
        self._release: weakref.finalize | None = None

    @classmethod
    def prepare(
        cls,
        path: Path,
        record: dict[str, Any],
        keep_checkpoints: int = 2,
        resume: bool = False,
        overwrite: bool = False,
    ) -> RunDir:
        """Lock the run directory `path` (created if need be) for a run, check that it may be
        written (a directory holding a run needs `resume` or `overwrite`), set the previous
        run aside unless resuming, and write the run's config (`record`) to `config.json`.

        The lock and the aside copy are held until `commit()` / `close()`, or until this
        object is garbage-collected, so a `prepare` that is never trained blocks nothing."""
        run = cls(path, keep_checkpoints)
        created = not run.path.exists()
        try:
            run.path.mkdir(parents=True, exist_ok=True)
            lock = _acquire(run.path)
        except OSError as err:
            raise DiskError.writing("run directory", run.path, err) from None
        hold = run._hold = _Hold(run.path, lock, created)
        run._release = weakref.finalize(run, hold.release)
        try:
            try:
                run.recovered = _recover(run)
                run._check(resume, overwrite)
                if not resume:
                    hold.start_new()
            except OSError as err:
                raise DiskError.writing("run directory", run.path, err) from None
            text = json.dumps(record, indent=1)
            try:
                atomic_write(run.config, lambda tmp: tmp.write_text(text))
            except OSError as err:
                raise DiskError.writing("config", run.config, err) from None
        except BaseException:
            run.close()
            raise
        return run

    def _check(self, resume: bool, overwrite: bool) -> None:
        if resume and not self.checkpoints.steps():
            raise UserError(
                f"--resume: {self.path} has no checkpoint to resume from; "
                "run without --resume to start the run"
            )
        if self.holds_run() and not (resume or overwrite):
            raise UserError(
                f"{self.path} already holds a run; pass --resume to continue it, --overwrite "
                "to start again, or choose another run.name / --out"
            )

    def holds_run(self) -> bool:
        """Whether a run has trained here: it wrote metrics or a checkpoint."""
        return self.metrics.exists() or bool(self.checkpoints.steps())

    def commit(self) -> None:
        """The new run has started: delete the previous run that `prepare` set aside."""
        if self._hold is not None:
            self._hold.commit()

    def close(self) -> None:
        """The run is over, or never started: then its files go and the previous run's
        come back. Releases the directory's lock. Idempotent."""
        if self._release is not None:
            self._release()

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
            try:
                plot_metrics(records, self.plot, title=self.path.name)
            except OSError as err:
                raise DiskError.writing("plot", self.plot, err, "the run itself is saved") from None
        return summarize(records)


class _Hold:
    """What a prepared run holds: the directory's lock, and, until the run has started, the
    way back to the directory as it was. Apart from `RunDir` so that a finalizer can release
    it once the `RunDir` is gone."""

    def __init__(self, path: Path, lock: FileLock, created: bool) -> None:
        self.path = path
        self.lock: FileLock | None = lock
        self.created = created  # prepare made the directory: a run that never starts removes it
        self.pending = False  # a new run not started yet: its files go on release
        self.started = False

    def start_new(self) -> None:
        """A run that does not resume: set aside what earlier runs wrote here."""
        self.pending = True  # from the first move on: a failure half-way is put back too
        paths = _run_paths(self.path)
        if not paths:
            return
        moving = self.path / _MOVING
        for source in paths:
            target = moving / source.relative_to(self.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)
        moving.rename(self.path / ASIDE_DIR)

    def commit(self) -> None:
        self.started = True
        if self.pending:
            self.pending = False
            aside, discard = self.path / ASIDE_DIR, self.path / _DISCARD
            if aside.exists():
                aside.rename(discard)  # one rename: never a half-deleted .previous
                shutil.rmtree(discard, ignore_errors=True)

    def release(self) -> None:
        try:
            if self.pending:
                self.pending = False
                _put_back(self.path, clear=True)
        finally:
            if self.lock is not None:
                lock, self.lock = self.lock, None
                (self.path / OWNER_FILE).unlink(missing_ok=True)
                lock.release()
                if self.created and not self.started:  # leave no empty directory behind
                    with contextlib.suppress(OSError):
                        (self.path / LOCK_FILE).unlink(missing_ok=True)
                        self.path.rmdir()


def _acquire(path: Path) -> FileLock:
    """Lock `path` for this process, or fail at once naming the process that holds it."""
    lock = FileLock(path / LOCK_FILE, timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(
            f"{path} is being written by another run{_owner(path)}; wait for it or choose "
            "another run.name / --out"
        ) from None
    try:
        owner = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
        atomic_write(path / OWNER_FILE, lambda tmp: tmp.write_text(owner))
    except BaseException:
        lock.release()
        raise
    return lock


def in_training(path: Path) -> bool:
    """Whether a run holds `path` now (its lock is taken): `scaleout scale` asks live runs."""
    if not (path / LOCK_FILE).exists():
        return False
    lock = FileLock(path / LOCK_FILE, timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        return True
    lock.release()
    return False


def _owner(path: Path) -> str:
    """` (pid N)`, ` (pid N on host)`, or `` when the holder did not say."""
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
        pid, host = int(owner["pid"]), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if host != socket.gethostname():
        return f" (pid {pid} on {host})"
    if pid == os.getpid():
        return f" in this process (pid {pid}: train or close() the Run prepared before)"
    return f" (pid {pid})"


def _run_paths(path: Path) -> list[Path]:
    """The files and directories a run wrote into `path` (`RUN_FILES`, `RUN_DIRS`)."""
    found = [p for pattern in RUN_FILES for p in sorted(path.glob(pattern))]
    return found + [path / name for name in RUN_DIRS if (path / name).exists()]


def _clear(path: Path) -> None:
    """Delete what a run writes in `path` (`RUN_FILES`, `RUN_DIRS`), and nothing else."""
    for found in _run_paths(path):
        if found.is_dir() and not found.is_symlink():
            shutil.rmtree(found, ignore_errors=True)
        else:
            found.unlink(missing_ok=True)


def _put_back(path: Path, clear: bool) -> None:
    """Undo a set-aside: the new run's files out (with `clear`, or when `.previous` is
    whole), the previous run's back in. Safe to run again after a crash half-way: `_MOVING`
    only ever holds files that go back as they are, and none of a new run is beside it."""
    aside, moving = path / ASIDE_DIR, path / _MOVING
    if aside.exists() or (clear and not moving.exists()):
        _clear(path)  # the new run's config.json, its shards' checkpoints, ...
    if aside.exists():
        aside.rename(moving)
    if moving.exists():
        _move_into(moving, path)
        shutil.rmtree(moving, ignore_errors=True)


def _move_into(source: Path, target: Path) -> None:
    """Move the tree `source` into `target`, merging directories (each move is a rename)."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in list(source.iterdir()):
        dest = target / entry.name
        if entry.is_dir() and not entry.is_symlink() and dest.is_dir():
            _move_into(entry, dest)
            entry.rmdir()
        else:
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(entry, dest)


def _recover(run: RunDir) -> bool:
    """Finish what a process killed during an `--overwrite` left (we hold the lock: no
    live run is using it). A committed aside copy is deleted; one not committed is put back,
    since the killed run had trained nothing yet. True if a previous run was put back."""
    shutil.rmtree(run.path / _DISCARD, ignore_errors=True)
    aside, moving = run.path / ASIDE_DIR, run.path / _MOVING
    if not (aside.exists() or moving.exists()):
        return False
    if aside.exists() and run.holds_run():
        raise UserError(
            f"{aside} holds the files of a previous run that an interrupted --overwrite set "
            f"aside, and {run.path} holds a run too: delete {aside} to keep the newer run, or "
            "move its files back over the newer run's to keep the previous one"
        )
    _put_back(run.path, clear=False)
    return True
