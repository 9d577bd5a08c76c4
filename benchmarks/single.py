"""Suite `single`: the single-worker baseline every distributed strategy is compared with.

Training throughput of the library's own training (`scaleout.fit`, strategy "single": its
loader, forward, backward and optimizer step) for the 8-bit paper's MNIST MLP with one
thread and with all threads (the reference for "R replicas use R times the resources"),
and for DistBelief's 42M-parameter speech DNN; and the MNIST data path (`make_loader`).

Each training row is one run on synthetic data of the model's input shape (class means plus
noise, drawn on demand) with evaluation and checkpoints only at the end; the rate is the
median `examples_per_s` of its metrics lines after the first (warm-up). That rate leaves
evaluation and checkpoints out but includes the time the step waited for its minibatch:
drawing the synthetic examples (the notes give that share).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import Row, SuiteResult, register_suite
from scaleout.api import fit
from scaleout.data import load_image_idx, make_loader
from scaleout.metrics import read_metrics

BATCH = 128
LR = 1e-3
STEPS = {"mlp": 100, "speech_dnn": 20}  # training steps per run, by model kind
LINES = 10  # metrics lines per run: the first is warm-up, the median of the others is reported
MLP: dict[str, Any] = {"kind": "mlp", "sizes": [784, 1024, 1024, 10], "dropout": [0.2, 0.5, 0.5]}
SPEECH: dict[str, Any] = {"kind": "speech_dnn"}  # 11 x 40 inputs, 4 x 2560, 8192 classes


def _rate(step: Callable[[], None], examples_per_call: int, min_seconds: float = 2.0) -> float:
    """Examples per second of `step` after warm-up, timed over at least `min_seconds`."""
    for _ in range(3):
        step()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 5:
        step()
        calls += 1
    return calls * examples_per_call / elapsed


def train_rate(
    model: dict[str, Any], input_size: int, num_classes: int, threads: int, root: Path
) -> tuple[float, float]:
    """`scaleout.fit` of `model` (strategy single, RMSProp, batch `BATCH`, `threads` threads)
    on synthetic data: the median examples/s after the first metrics line, and the median
    share of a step spent waiting for its minibatch."""
    steps = STEPS[model["kind"]]
    config = {
        "run": {
            "name": f"{model['kind']}_{threads}_threads",
            "out_dir": str(root),
            "seed": 0,
            "device": "cpu",
            "num_threads": threads,
        },
        "data": {
            "dataset": "synthetic",
            "input_shape": [input_size],
            "num_classes": num_classes,
            "num_train": BATCH * steps,
            "num_test": BATCH,
        },
        "model": model,
        "train": {
            "strategy": "single",
            "steps": steps,
            "batch_size": BATCH,
            "optimizer": "rmsprop",
            "lr": LR,
            "log_every": max(1, steps // LINES),
            "eval_every": steps + 1,  # only the final evaluation and checkpoint
            "checkpoint_every": steps + 1,
            "eval_batch_size": BATCH,
            "keep_checkpoints": 1,
        },
    }
    result = fit(config, overwrite=True)
    assert result.run_dir is not None
    lines = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "examples_per_s" in r]
    timed = lines[1:] or lines
    rate = statistics.median(r["examples_per_s"] for r in timed)
    wait = statistics.median(r["data_wait_s"] * r["examples_per_s"] / BATCH for r in timed)
    return rate, wait


@register_suite("single", "single-worker training throughput (MNIST MLP, speech DNN, data path)")
def run() -> SuiteResult:
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    rows, waits = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-single-") as tmp:
            for num_threads in sorted({1, cores}):
                rate, wait = train_rate(MLP, 784, 10, num_threads, Path(tmp))
                name = f"mlp 784-1024-1024-10 train, {num_threads} thread(s)"
                rows.append(Row(name, rate, "examples/s", "higher"))
                waits.append(f"{name} {100 * wait:.0f}%")
            rate, wait = train_rate(SPEECH, 440, 8192, cores, Path(tmp))
            name = f"speech dnn 42M train, {cores} thread(s)"
            rows.append(Row(name, rate, "examples/s", "higher"))
            waits.append(f"{name} {100 * wait:.0f}%")
    finally:
        torch.set_num_threads(threads)
    if len(rows) == 3:
        rows.append(
            Row(
                "mlp train speed-up, all threads vs 1", rows[1].value / rows[0].value, "x", "higher"
            )
        )

    train = load_image_idx("mnist", "train")
    batches = iter(())

    def next_batch() -> None:
        nonlocal batches
        try:
            next(batches)
        except StopIteration:
            batches = iter(make_loader(train, BATCH, shuffle=True, seed=0))
            next(batches)

    rows.append(
        Row(
            "mnist loader, shuffled batches of 128",
            _rate(next_batch, BATCH),
            "examples/s",
            "higher",
        )
    )
    notes = [
        f"batch {BATCH}, RMSProp lr {LR}, fp32, device cpu; training rows: scaleout.fit "
        f"(strategy single) on synthetic data, steps per run {STEPS}, median examples_per_s of "
        f"the metrics lines after the first ({LINES} lines per run)",
        "share of a training step spent waiting for the minibatch (synthetic examples drawn "
        "in the training process): " + "; ".join(waits),
    ]
    return SuiteResult(rows, notes=notes)
