"""Suite `downpour_overlap`: is a Downpour replica's communication hidden behind its compute?

The demo's network and data (MNIST, 784-1024-1024-10 MLP with dropout, batch 128, Adagrad,
`n_fetch = n_push = 3`, one thread per replica and worker, no warm start) trained by
`scaleout.fit` for a fixed number of global steps, with evaluation and checkpoints only at
the end:

- one single-threaded worker (strategy "single"): the reference;
- Downpour with 1 and 2 replicas, `downpour.threads` off (fetch, compute and push in turn
  in one thread) and on (a fetch thread and a push thread beside the compute thread), and
  one replica with the default "auto" (2 replicas of one thread leave no core to spare on
  2 cores: "auto" is off there, the "off" rows).

Each rate is the median `examples_per_s` of a run's metrics lines after the first (the
warm-up), over `REPEATS` runs of each setting taken in turn (a drift in the machine's load
falls on every setting alike); the spread of the repeats is in the row's name.

Beside each rate, the time to a target: the first metrics line whose training loss (the
mean over its window, dropout on) is at most `TARGET_LOSS`, median over the repeats (NaN:
a run did not get there in its steps). A rate bought with staleness shows up there.

Targets (issue: overlap): one replica >= 0.9x the single worker's examples/s at the same
thread count; 2 replicas on this 2-core box >= 1.8x one single-threaded worker.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.downpour import fit_metrics

STEPS = 600  # global steps per run
LOG_EVERY = 50
REPEATS = 3
TARGET_LOSS = 0.35  # training loss (window mean) the time-to-target rows wait for
BASE: dict[str, Any] = {
    "run": {"seed": 0, "device": "cpu", "num_threads": 1},
    "data": {"dataset": "mnist"},
    "model": {"kind": "mlp", "sizes": [784, 1024, 1024, 10], "dropout": [0.2, 0.5, 0.5]},
    "train": {
        "steps": STEPS,
        "batch_size": 128,
        "optimizer": "adagrad",
        "lr": 0.01,
        "log_every": LOG_EVERY,
        "eval_every": STEPS + 1,
        "checkpoint_every": STEPS + 1,
    },
    "downpour": {
        "num_shards": 2,
        "n_fetch": 3,
        "n_push": 3,
        "warmstart_steps": 0,
        "shard_checkpoint_every": None,
        "shard_checkpoint_seconds": None,
    },
}
# name -> (strategy, downpour overrides)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "single worker, 1 thread": ("single", {}),
    "downpour R=1, threads off": ("downpour", {"num_replicas": 1, "threads": False}),
    "downpour R=1, threads on": ("downpour", {"num_replicas": 1, "threads": True}),
    "downpour R=1, threads auto": ("downpour", {"num_replicas": 1}),
    "downpour R=2, threads off": ("downpour", {"num_replicas": 2, "threads": False}),
    "downpour R=2, threads on": ("downpour", {"num_replicas": 2, "threads": True}),
}
REFERENCE = "single worker, 1 thread"


def rate(name: str, root: Path) -> tuple[float, float]:
    """Median examples/s of one run's metrics lines after the first, and the seconds to
    the first line at `TARGET_LOSS` (NaN: none)."""
    strategy, downpour = SETTINGS[name]
    raw = {k: dict(v) for k, v in BASE.items()}
    raw["run"] |= {
        "name": name.replace(" ", "_").replace(",", "").replace("=", ""),
        "out_dir": str(root),
    }
    raw["train"] |= {"strategy": strategy}
    raw["downpour"] |= downpour
    lines = [r for r in fit_metrics(raw) if "examples_per_s" in r]
    reached = next((r["time_s"] for r in lines if r["loss"] <= TARGET_LOSS), float("nan"))
    return statistics.median(r["examples_per_s"] for r in lines[1:] or lines), reached


def measure() -> tuple[list[Row], list[str]]:
    rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        for _ in range(REPEATS):
            for name in SETTINGS:
                examples_per_s, seconds = rate(name, Path(tmp))
                rates[name].append(examples_per_s)
                times[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    rows = [Row.median_of(name, values, "examples/s", "higher") for name, values in rates.items()]
    for name, values in times.items():
        label = f"{name}: time to training loss {TARGET_LOSS}"
        if any(math.isnan(v) for v in values):  # a run that never got there has no median
            rows.append(Row(f"{label} (a run did not get there)", float("nan"), "s", "lower"))
        else:
            rows.append(Row.median_of(label, values, "s", "lower"))
    reference = medians[REFERENCE]
    for name in SETTINGS:
        if name == REFERENCE:
            continue
        target = 0.9 if "R=1" in name else 1.8
        rows.append(
            Row(f"{name} / {REFERENCE}", medians[name] / reference, "x", "higher", target=target)
        )
    notes = [
        f"MNIST 784-1024-1024-10 MLP, dropout, batch 128, Adagrad lr 0.01, n_fetch = n_push = "
        f"3, 2 shards, no warm start, one thread per replica/worker, {STEPS} global steps per "
        f"run, metrics every {LOG_EVERY}; median of {REPEATS} runs of each setting, in turn.",
        "Downpour's rate counts every replica's steps (the driver's window), shards, driver "
        "and replicas sharing this machine's cores.",
    ]
    return rows, notes


@register_suite("downpour_overlap", "Downpour replica throughput vs one worker, threads off/on")
def run() -> SuiteResult:
    rows, notes = measure()
    return SuiteResult(rows, notes=notes)
