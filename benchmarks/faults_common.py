"""What the `faults` suite's faults share: the runs they are injected into, the fault-free
runs they are read against, and the five rows of one fault's outcome."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import Row
from scaleout.api import Run, prepare
from scaleout.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


KILL_AT = 700  # steps (Downpour, sync), after the checkpoints at 500 (Downpour), 600 (sync)


# Two asynchronous Downpour runs differ a little (the order of the replicas' pushes): the
# faulted runs are compared with the mean of this many fault-free ones, whose spread is shown.
NUM_REFERENCES = 3


DOWNPOUR = (
    "configs/mnist_downpour.toml",
    [
        "downpour.mode=gradients",  # the demo's config runs DiLoCo; these runs push gradients
        "downpour.n_fetch=3",
        "downpour.n_push=3",
        "model.sizes=[784, 256, 10]",
        "model.dropout=0.0",
        "train.steps=2000",
        "train.batch_size=128",
        "train.lr=0.05",
        "train.eval_every=500",
        "train.checkpoint_every=500",
        "downpour.warmstart_steps=0",
        "downpour.shard_backups=1",
        "downpour.shard_checkpoint_every=100",
    ],
)


SYNC = (
    "configs/mnist_sync.toml",
    [
        "data.num_train=16384",
        "model.sizes=[784, 256, 10]",
        "model.dropout=0.0",
        "train.steps=900",
        "train.eval_every=300",
        "train.checkpoint_every=300",
    ],
)


SANDBLASTER = (
    "configs/mnist_sandblaster.toml",
    ["data.num_train=8192", "sandblaster.max_iterations=40", "sandblaster.num_replicas=3"],
)


MODEL_PARALLEL = (
    "configs/autoencoder_model_parallel.toml",
    ["train.steps=60", "train.checkpoint_every=20", "train.eval_every=20"],
)


COMMON = ["data.num_test=10000", "run.num_threads=1"]


@dataclass
class Outcome:
    """What one fault did to its run, beside the fault-free run."""

    fault: str
    survived: bool
    updates_lost: int
    steps_redone: int
    extra_s: float
    quality: float  # accuracy (pp) or test loss (%) against the fault-free run
    quality_unit: str
    note: str = ""
    join_s: float | None = None  # a replica joining: from what asked for it to its first push
    dip: float | None = None  # examples/s while it joined over before it was asked for
    join_target: float | None = None  # the most seconds `join_s` may take, where one is set

    def rows(self) -> list[Row]:
        f = self.fault
        better = "higher" if self.quality_unit == "pp" else "lower"
        target = -0.3 if self.quality_unit == "pp" else 1.0
        rows = [
            Row(f"{f}: survived", float(self.survived), "yes (1) / no (0)", "higher", target=1),
            Row(f"{f}: updates lost", self.updates_lost, "updates or steps", "lower", target=0),
            Row(f"{f}: steps redone", self.steps_redone, "steps", "lower"),
            Row(f"{f}: extra wall time", self.extra_s, "s", "lower"),
            Row(f"{f}: vs fault-free", self.quality, self.quality_unit, better, target=target),
        ]
        if self.join_s is not None:
            target = self.join_target
            rows.append(Row(f"{f}: time to join", self.join_s, "s", "lower", target=target))
        if self.dip is not None:
            rows.append(Row(f"{f}: examples/s while joining", self.dip, "x before", "higher"))
        return rows


@dataclass
class Done:
    """A finished run: its summary (the last checkpoint's and the driver's) and its time."""

    summary: dict[str, Any]
    seconds: float
    steps: int
    planned: int
    rate: float = 0.0  # the median of the logged examples/s (start-up and evaluations aside)


def run_overrides(setup: tuple[str, list[str]], root: Path, name: str, *more: str) -> list[str]:
    return [*setup[1], *COMMON, f"run.out_dir='{root}'", f"run.name='{name}'", *more]


def train(run: Run, fault: Callable[[Run], None] | None = None) -> Done:
    """Train `run`; `fault(run)` runs in a thread beside it (it waits for its moment)."""
    if fault is not None:
        threading.Thread(target=fault, args=(run,), daemon=True).start()
    started = time.perf_counter()
    result = run.train()
    seconds = time.perf_counter() - started
    planned = run.strategy.plan().total_steps
    rates = [
        r["examples_per_s"] for r in read_metrics(run.run_dir.metrics) if "examples_per_s" in r
    ]
    return Done(result.summary, seconds, result.step, planned, statistics.median(rates or [0.0]))


def mean(references: list[Done]) -> Done:
    """The fault-free runs as one: mean final accuracy, median seconds and examples/s."""
    accuracy = statistics.mean(r.summary["final_test_accuracy"] for r in references)
    return Done(
        {**references[0].summary, "final_test_accuracy": accuracy},
        statistics.median(r.seconds for r in references),
        references[0].steps,
        references[0].planned,
        statistics.median(r.rate for r in references),
    )


def spread_row(name: str, accuracies: list[float]) -> Row:
    """How far apart the fault-free runs ended: the noise the faulted runs are read against."""
    return Row(
        f"{name}: fault-free spread", 100 * (max(accuracies) - min(accuracies)), "pp", "lower"
    )


def quality_against(done: Done, reference: Done) -> tuple[float, str]:
    mine, theirs = done.summary.get("final_test_accuracy"), reference.summary
    if mine is not None and theirs.get("final_test_accuracy") is not None:
        return 100 * (mine - theirs["final_test_accuracy"]), "pp"
    loss, expected = done.summary["final_test_loss"], theirs["final_test_loss"]
    return 100 * (loss - expected) / expected, "% test loss"


def outcome(fault: str, done: Done, reference: Done, redone: int, note: str = "") -> Outcome:
    quality, unit = quality_against(done, reference)
    lost = done.summary.get("shard_updates_lost", 0) + (done.planned - done.steps)
    survived = done.steps == done.planned
    extra = done.seconds - reference.seconds
    return Outcome(fault, survived, lost, redone, extra, quality, unit, note)


def when(condition: Callable[[], bool], action: Callable[[], None]) -> Callable[[Run], None]:
    def wait_then_act(run: Run) -> None:
        deadline = time.monotonic() + 600
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        action()

    return wait_then_act


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def downpour(root: Path, name: str, *more: str) -> Run:
    overrides = run_overrides(DOWNPOUR, root, name, *more)
    return prepare(REPO / DOWNPOUR[0], overrides=overrides, overwrite=True)


def cli(setup: tuple[str, list[str]], root: Path, name: str, *flags: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "scaleout", "train", setup[0], *flags]
    for override in run_overrides(setup, root, name):
        args += ["--set", override]
    return subprocess.Popen(
        args,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a kill takes its Ray processes too
    )


def summary_of(run_dir: Path) -> dict[str, Any]:
    """A finished run's figures from its files: the last metrics line and checkpoint."""
    from scaleout.checkpoint import CheckpointDir, load_checkpoint

    records = read_metrics(run_dir / "metrics.jsonl")
    evaluated = [r for r in records if "test_accuracy" in r]
    _, meta = load_checkpoint(CheckpointDir(run_dir / "checkpoints").latest())
    return {
        "final_test_accuracy": evaluated[-1]["test_accuracy"],
        "shard_updates_lost": meta.get("shard_updates_lost", 0),
        "step": meta["step"],
    }


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, what: str) -> None:
    """Until the CLI run `proc` writing `run_dir` has logged `step`; `what` comes next."""
    while not any(r.get("step", 0) >= step for r in records(run_dir)):
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before {what}: {proc.stderr.read()[-500:]}")
        time.sleep(0.1)


def resume_to_end(root: Path, name: str, reference: Done, started: float) -> tuple[Done, int]:
    """`--resume` the CLI run `name` to its end: the finished run, its seconds counted from
    `started` (its first process's start), and the step it resumed at."""
    second = cli(DOWNPOUR, root, name, "--resume")
    _, stderr = second.communicate()
    seconds = time.perf_counter() - started
    if second.returncode != 0:
        raise RuntimeError(f"--resume failed: {stderr[-500:]}")
    resumed_at = int(stderr.split(" at step ")[1].split()[0])
    summary = summary_of(root / name)
    return Done(summary, seconds, summary["step"], reference.planned), resumed_at
