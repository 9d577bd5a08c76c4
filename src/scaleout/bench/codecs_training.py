"""Suite `codecs_training`: does compression change what is learnt? (8-bit paper, Figs 3, 4)

The paper's MNIST network (784-1024-1024-10, dropout 0.2/0.5/0.5, RMSProp) trained with each
codec, 3 seeds each, final test error beside fp32:

(a) data parallel: 2 processes (gloo), DDP with `ddp_hook(codec)`; fp32 is DDP's own
    all-reduce; 1-bit runs with error feedback;
(b) model parallel (simulated in one process): the activations sent from layer to layer and
    the deltas sent back pass through `compressed(x, codec)`, in training and at test time;
    1-bit without error feedback (activations differ from batch to batch).

Target: every 8-bit codec within 0.2 percentage points of fp32 (the paper: no difference);
1-bit converges in (a) (within 1 point of fp32); in (b) it is shown as it is.
Kept short to fit the benchmark's time: `SCALEOUT_BENCH_CODECS_STEPS` steps (default 200,
25,600 examples, under half an epoch) with RMSProp lr 3e-4 and global batch 128, as
`configs/mnist_single.toml`; the paper trained to convergence, so our errors are higher and
differences between codecs of a few tenths of a point are within the seed-to-seed spread.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from scaleout.bench import Row, SuiteResult, register_suite
from scaleout.compress import compressed, ddp_hook, get, kernels
from scaleout.data import load_image_idx, make_loader
from scaleout.nn import MLP

CODECS = ["fp32", "fp16", "bf16", "dynamic8", "dynamic8_bnb", "static8", "mantissa8", "linear8"]
CODECS += ["onebit"]
STEPS = int(os.environ.get("SCALEOUT_BENCH_CODECS_STEPS", 200))
SEEDS = list(range(int(os.environ.get("SCALEOUT_BENCH_CODECS_SEEDS", 3))))
BATCH = 128
LR = 3e-4


def network(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP([784, 1024, 1024, 10], dropout=[0.2, 0.5, 0.5])


def batches(
    train: Dataset, seed: int, part: int = 0, num_parts: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`STEPS` shuffled batches (this worker's `part` of each), over as many epochs as needed."""
    step, epoch = 0, 0
    while True:
        for batch in make_loader(
            train, BATCH, seed=seed, epoch=epoch, part=part, num_parts=num_parts
        ):
            if step == STEPS:
                return
            step += 1
            yield batch
        epoch += 1


@torch.no_grad()
def test_error(forward: Callable[[torch.Tensor], torch.Tensor], test: Dataset) -> float:
    """Percentage of misclassified test images."""
    wrong = 0
    for x, y in make_loader(test, 1000, shuffle=False):
        wrong += int((forward(x).argmax(1) != y).sum())
    return 100 * wrong / len(test)


# --- (a) data parallel --------------------------------------------------------------------


def _ddp_worker(rank: int, port: int, out: Path) -> None:
    with kernels.compiling("always"):  # DDP's first bucket (1 MB) is below "auto"'s size
        _train_ddp(rank, port, out)


def _train_ddp(rank: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        train, test = load_image_idx("mnist", "train"), load_image_idx("mnist", "test")
        results: dict[str, list[float]] = {}
        for codec in CODECS:
            for seed in SEEDS:
                model = network(seed)
                ddp = DistributedDataParallel(model)
                if codec != "fp32":
                    ddp.register_comm_hook(None, ddp_hook(codec))  # onebit: error feedback
                optimizer = torch.optim.RMSprop(ddp.parameters(), lr=LR)
                torch.manual_seed(1000 * seed + rank)  # each rank its own dropout masks
                start = time.perf_counter()
                for x, y in batches(train, seed, part=rank, num_parts=2):
                    optimizer.zero_grad(set_to_none=True)
                    F.cross_entropy(ddp(x), y).backward()
                    optimizer.step()
                elapsed = time.perf_counter() - start
                error = test_error(model.eval(), test)
                results.setdefault(codec, []).append(error)
                results.setdefault(f"{codec} seconds", []).append(elapsed)
        if rank == 0:
            out.write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_parallel() -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "a.json"
        mp.spawn(_ddp_worker, args=(free_port(), out), nprocs=2, join=True)
        return json.loads(out.read_text())


# --- (b) model parallel -------------------------------------------------------------------


class Exchanged(nn.Module):
    """The MLP with every activation that would cross to the next worker (and its delta
    on the way back) passed through the codec."""

    def __init__(self, model: MLP, codec: str) -> None:
        super().__init__()
        self.model, self.codec = model, get(codec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.flatten(1)  # (N, 784)
        for name, layer in self.model.layers.named_children():
            h = layer(h)
            if name.startswith("act"):  # the output of a hidden layer: sent onwards
                h = compressed(h, self.codec, key=name)
        return h


def model_parallel() -> dict[str, list[float]]:
    with kernels.compiling("always"):  # activations of 128 x 1024 values
        return _train_model_parallel()


def _train_model_parallel() -> dict[str, list[float]]:
    train, test = load_image_idx("mnist", "train"), load_image_idx("mnist", "test")
    results: dict[str, list[float]] = {}
    for codec in CODECS:
        for seed in SEEDS:
            net = Exchanged(network(seed), codec)
            optimizer = torch.optim.RMSprop(net.parameters(), lr=LR)
            start = time.perf_counter()
            for x, y in batches(train, seed):
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(net(x), y).backward()
                optimizer.step()
            elapsed = time.perf_counter() - start
            results.setdefault(codec, []).append(test_error(net.eval(), test))
            results.setdefault(f"{codec} seconds", []).append(elapsed)
    return results


# --- rows ---------------------------------------------------------------------------------


def rows_for(kind: str, results: dict[str, list[float]]) -> list[Row]:
    reference = statistics.mean(results["fp32"])
    rows = []
    for codec in CODECS:
        mean = statistics.mean(results[codec])
        if codec == "fp32":
            target = None
        elif codec == "onebit":
            target = reference + 1.0 if kind.startswith("(a)") else None
        else:
            target = reference + 0.2
        rows.append(
            Row(f"training {kind} {codec} test error", mean, "% error", "lower", target=target)
        )
    return rows


def notes_for(kind: str, results: dict[str, list[float]]) -> list[str]:
    per_seed = "; ".join(
        f"{codec} " + "/".join(f"{e:.2f}" for e in results[codec])
        + f" ({statistics.mean(results[f'{codec} seconds']):.0f} s)"
        for codec in CODECS
    )  # fmt: skip
    return [f"training {kind}: test error % per seed (mean training time per run): {per_seed}"]


def plot(results: dict[str, dict[str, list[float]]], ax) -> None:  # noqa: ANN001 - an axis
    width = 0.4
    for offset, (kind, values) in enumerate(results.items()):
        xs = [i + (offset - 0.5) * width for i in range(len(CODECS))]
        means = [statistics.mean(values[c]) for c in CODECS]
        spread = [statistics.pstdev(values[c]) for c in CODECS]
        ax.bar(xs, means, width=width, yerr=spread, label=kind)
    ax.set_xticks(range(len(CODECS)), CODECS, rotation=45, fontsize=7)
    ax.set_ylabel("MNIST test error % (mean of seeds)")
    ax.set_title(f"Figures 3/4: training with compression ({STEPS} steps)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)


def measure() -> tuple[list[Row], list[str], dict]:
    results = {"(a) data parallel": data_parallel(), "(b) model parallel": model_parallel()}
    rows = [row for kind, values in results.items() for row in rows_for(kind, values)]
    notes = [
        f"MNIST MLP 784-1024-1024-10, dropout 0.2/0.5/0.5, RMSProp lr {LR}, batch {BATCH} "
        f"(a: 64 per worker), {STEPS} steps, seeds {SEEDS}; codecs per tensor/bucket, "
        "nearest rounding, exponent offset 10^1 for the static types; compiled kernels "
        "for every size (SCALEOUT_COMPRESS_COMPILE=always).",
        *[note for kind, values in results.items() for note in notes_for(kind, values)],
    ]
    return rows, notes, results


@register_suite("codecs_training", "8-bit paper Figures 3/4: MNIST test error per codec")
def run() -> SuiteResult:
    rows, notes, results = measure()

    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        plot(results, ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    return SuiteResult(rows, plot=draw, notes=notes)
