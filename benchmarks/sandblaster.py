"""Suite `sandblaster`: Sandblaster L-BFGS against one-process L-BFGS, stragglers, and the
MLP beside Downpour (DistBelief section 4.2 and figure 4).

Convex problem: L2-regularised softmax regression on the 60k MNIST training images in
[0, 1] (penalty 1e-4 * ||W||^2, biases free), objective against wall time for Sandblaster
with 1, 2 and 4 replicas, scipy's L-BFGS-B and torch.optim.LBFGS, all in one run. Every
Sandblaster and Downpour run is the library's training (`scaleout.fit`); scipy's L-BFGS-B
and torch.optim.LBFGS (`_scipy`, `_torch_lbfgs`, with their own objective and backward)
are independent references that the library is compared with, not scaleout's training.

Stragglers: 4 replicas, one of them 4x slower; time per objective evaluation (one pass over
the batch) with and without backup tasks, against no straggler.

MLP: test accuracy against wall time of Sandblaster (batches of 10k, no dropout) beside
Downpour SGD with Adagrad (2 replicas), one thread per replica.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import Row, SuiteResult, register_suite
from scaleout.api import fit
from scaleout.data import load_image_idx
from scaleout.metrics import read_metrics

L2 = 1e-4
CONVEX: dict[str, Any] = {
    "run": {"seed": 0, "device": "cpu", "num_threads": 1},
    "data": {"dataset": "mnist", "normalize": False},
    "model": {"kind": "mlp", "sizes": [784, 10]},
    "train": {
        "strategy": "sandblaster",
        "eval_every": 1000,
        "log_every": 1,  # the objective at every iteration: the curve the suite plots
        "checkpoint_every": 100_000,
    },
    "sandblaster": {
        "num_shards": 2,
        "portion_size": 2000,
        "max_iterations": 300,
        "l2": L2,
        "dtype": "float64",
        "tolerance_grad": 1e-6,
        "tolerance_change": 1e-10,
    },
}


def _run(raw: dict[str, Any], name: str, root: Path) -> list[dict[str, Any]]:
    raw = {k: dict(v) for k, v in raw.items()}
    raw["run"] |= {"name": name, "out_dir": str(root)}
    threads = torch.get_num_threads()
    try:
        fit(raw, overwrite=True)
    finally:
        torch.set_num_threads(threads)
    return read_metrics(root / name / "metrics.jsonl")


def _convex_data() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_image_idx("mnist", "train", normalize=False)
    return data.x.reshape(len(data.x), -1).double(), data.y  # (60000, 784), (60000,)


def _objective(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    weights, bias = w[:7840].view(10, 784), w[7840:]
    return F.cross_entropy(x @ weights.T + bias, y) + L2 * (weights**2).sum()


def _scipy(x: torch.Tensor, y: torch.Tensor) -> list[tuple[float, float]]:
    import scipy.optimize

    curve, start = [], time.perf_counter()

    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        wt = torch.from_numpy(w).requires_grad_(True)
        f = _objective(wt, x, y)
        f.backward()
        return f.item(), wt.grad.numpy()

    def record(w: np.ndarray) -> None:
        curve.append((time.perf_counter() - start, fun(w)[0]))

    scipy.optimize.minimize(
        fun, np.zeros(7850), jac=True, method="L-BFGS-B", callback=record, options={"maxiter": 300}
    )
    return curve


def _torch_lbfgs(x: torch.Tensor, y: torch.Tensor) -> list[tuple[float, float]]:
    """torch.optim.LBFGS, one `step` of up to 300 iterations; one point per evaluation."""
    w = torch.zeros(7850, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [w],
        lr=1,
        max_iter=300,
        max_eval=400,
        history_size=10,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )
    curve, start = [], time.perf_counter()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        f = _objective(w, x, y)
        f.backward()
        curve.append((time.perf_counter() - start, f.item()))
        return f

    optimizer.step(closure)
    return curve


def _time_to(curve: list[tuple[float, float]], level: float) -> float:
    return next((t for t, f in curve if f <= level), float("nan"))


@register_suite(
    "sandblaster", "Sandblaster L-BFGS vs scipy/torch L-BFGS, stragglers, MLP vs Downpour"
)
def run() -> SuiteResult:
    torch.set_num_threads(1)
    rows: list[Row] = []
    curves: dict[str, list[tuple[float, float]]] = {}
    x, y = _convex_data()
    curves["scipy L-BFGS-B, 1 process"] = _scipy(x, y)
    curves["torch.optim.LBFGS, 1 process"] = _torch_lbfgs(x, y)
    best = min(f for curve in curves.values() for _, f in curve)
    with tempfile.TemporaryDirectory(prefix="bench-sandblaster-") as tmp:
        root = Path(tmp)
        for replicas in (1, 2, 4):
            raw = {**CONVEX, "sandblaster": {**CONVEX["sandblaster"], "num_replicas": replicas}}
            records = _run(raw, f"convex_r{replicas}", root)
            curves[f"sandblaster R={replicas}"] = [(r["time_s"], r["loss"]) for r in records]
        reference = curves["scipy L-BFGS-B, 1 process"][-1][1]
        for name, curve in curves.items():
            rows.append(
                Row(
                    f"convex: final objective, {name}",
                    curve[-1][1],
                    "objective",
                    "lower",
                    target=reference * (1 + 1e-6) if "sandblaster" in name else None,
                )
            )
            rows.append(
                Row(
                    f"convex: time to objective within 1e-4 of best, {name}",
                    _time_to(curve, best * (1 + 1e-4)),
                    "s",
                    "lower",
                )
            )

        per_batch: dict[str, float] = {}
        for label, extra in (
            ("no straggler", {}),
            ("straggler 4x, backup tasks", {"straggler_replica": 3}),
            ("straggler 4x, no backup tasks", {"straggler_replica": 3, "backup_tasks": False}),
        ):
            raw = {
                **CONVEX,
                "sandblaster": {
                    **CONVEX["sandblaster"],
                    "num_replicas": 4,
                    "max_iterations": 5,
                    **extra,
                },
            }
            last = _run(raw, label.replace(" ", "_").replace(",", ""), root)[-1]
            per_batch[label] = last["time_s"] / last["evaluations"]
            rows.append(
                Row(f"stragglers: seconds per batch, {label}", per_batch[label], "s", "lower")
            )
        base = per_batch["no straggler"]
        rows.append(
            Row(
                "stragglers: with backup tasks / no straggler",
                per_batch["straggler 4x, backup tasks"] / base,
                "x",
                "lower",
                target=1.25,
            )
        )
        rows.append(
            Row(
                "stragglers: without backup tasks / no straggler",
                per_batch["straggler 4x, no backup tasks"] / base,
                "x",
                "lower",
            )
        )

        mlp = {
            "run": {"seed": 0, "device": "cpu", "num_threads": 1},
            "data": {"dataset": "mnist"},
            "model": {"kind": "mlp", "sizes": [784, 1024, 1024, 10]},
            "train": {"strategy": "sandblaster", "eval_every": 2, "checkpoint_every": 100_000},
            "sandblaster": {
                "num_replicas": 2,
                "num_shards": 2,
                "portion_size": 1000,
                "batch_size": 10_000,
                "max_iterations": 30,
                "l2": 1e-5,
            },
        }
        accuracy: dict[str, list[tuple[float, float]]] = {}
        records = _run(mlp, "mlp_sandblaster", root)
        accuracy["sandblaster R=2, batch 10k"] = [
            (r["time_s"], r["test_accuracy"]) for r in records if "test_accuracy" in r
        ]
        downpour = {
            "run": {"seed": 0, "device": "cpu", "num_threads": 1},
            "data": {"dataset": "mnist"},
            "model": {"kind": "mlp", "sizes": [784, 1024, 1024, 10], "dropout": [0.2, 0.5, 0.5]},
            "train": {
                "strategy": "downpour",
                "epochs": 3,
                "batch_size": 128,
                "optimizer": "adagrad",
                "lr": 0.01,
                "eval_every": 100,
                "checkpoint_every": 100_000,
            },
            "downpour": {
                "num_replicas": 2,
                "num_shards": 2,
                "n_fetch": 3,
                "n_push": 3,
                "warmstart_steps": 200,
                "shard_checkpoint_every": None,
                "shard_checkpoint_seconds": None,
            },
        }
        records = _run(downpour, "mlp_downpour", root)
        accuracy["downpour R=2, adagrad"] = [
            (r["time_s"], r["test_accuracy"]) for r in records if "test_accuracy" in r
        ]
        for name, curve in accuracy.items():
            rows.append(
                Row(f"mlp: best test accuracy, {name}", max(a for _, a in curve), "", "higher")
            )
            rows.append(
                Row(
                    f"mlp: time to 95%, {name}",
                    next((t for t, a in curve if a >= 0.95), float("nan")),
                    "s",
                    "lower",
                )
            )
    notes = [
        "Convex: 60k MNIST images in [0,1], mean cross-entropy + 1e-4 ||W||^2 (biases free), "
        "float64, portions of 2000 examples, 2 shards, history 10; scipy and torch run in this "
        "process with one thread. The issue's reference: scipy reaches 0.2751117 in ~300 "
        "iterations.",
        "Stragglers: 4 replicas on this 2-core machine (oversubscribed), replica 3 sleeps 3x its "
        "compute time per portion; 5 iterations each.",
        "MLP: Sandblaster uses batches of 10k examples (a full 60k pass costs ~15 s on one "
        "thread), no dropout; Downpour as in configs/mnist_downpour.toml for 3 epochs.",
    ]
    return SuiteResult(rows, plot=lambda path: _plot(curves, accuracy, path), notes=notes)


def _plot(
    curves: dict[str, list[tuple[float, float]]],
    accuracy: dict[str, list[tuple[float, float]]],
    out: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    best = min(f for curve in curves.values() for _, f in curve)
    for name, curve in curves.items():
        left.plot([t for t, _ in curve], [f - best + 1e-9 for _, f in curve], label=name)
    left.set_yscale("log")
    left.set_xlabel("wall time (s)")
    left.set_ylabel("objective - best")
    left.set_title("L2-regularised softmax regression, MNIST")
    left.legend(fontsize=8)
    for name, curve in accuracy.items():
        right.plot([t for t, _ in curve], [100 * a for _, a in curve], "o-", label=name)
    right.set_xlabel("wall time (s)")
    right.set_ylabel("test accuracy (%)")
    right.set_title("MNIST MLP")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
