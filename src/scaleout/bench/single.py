"""Suite `single`: the single-worker baseline every distributed strategy is compared with.

Training-step throughput (forward, backward, optimizer step) of the 8-bit paper's MNIST MLP
with one thread and with all threads (the reference for "R replicas use R times the
resources"), of DistBelief's 42M-parameter speech DNN, and of the MNIST data path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from scaleout.bench import Row, SuiteResult, register_suite
from scaleout.data import load_image_idx, make_loader
from scaleout.nn import MLP, speech_dnn

BATCH = 128


def _rate(step: Callable[[], None], examples_per_call: int, min_seconds: float = 2.0) -> float:
    """Examples per second of `step` after warm-up, timed over at least `min_seconds`."""
    for _ in range(3):
        step()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls < 5:
        step()
        calls += 1
    return calls * examples_per_call / elapsed


def _train_rate(model: torch.nn.Module, num_inputs: int, num_classes: int) -> float:
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, num_inputs)  # (N, D)
    y = torch.randint(num_classes, (BATCH,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return _rate(step, BATCH)


@register_suite("single", "single-worker training throughput (MNIST MLP, speech DNN, data path)")
def run() -> SuiteResult:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    rows = []
    try:
        for num_threads in sorted({1, cores}):
            torch.set_num_threads(num_threads)
            mlp = MLP([784, 1024, 1024, 10], dropout=[0.2, 0.5, 0.5])
            rows.append(
                Row(
                    f"mlp 784-1024-1024-10 train, {num_threads} thread(s)",
                    _train_rate(mlp, 784, 10),
                    "examples/s",
                    "higher",
                )
            )
        speech = speech_dnn()
        rows.append(
            Row(
                f"speech dnn 42M train, {cores} thread(s)",
                _train_rate(speech, 440, 8192),
                "examples/s",
                "higher",
            )
        )
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
    return SuiteResult(rows, notes=[f"batch {BATCH}, RMSProp, fp32, device cpu"])
