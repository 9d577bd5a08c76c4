"""Suite `model_parallel`: COTS HPC figures 5 and 6 on this machine, and 8-bit exchanges.

(1) Scaling (the paper's section 5.1), a timing harness, not training: what is timed is one
update of *all* layers, as in full joint training: a forward pass through every stack with
autograd on, the objective (COTS HPC eq. 1) of every stack on its own input, their sum, one
backward pass from the top stack to the data (through every exchange),
`scaleout.parallel.parts.sync_grads` and an SGD-momentum step of every parameter. The
library trains greedily (`stack_objective`: the stacks below under no_grad) and has no joint
update, so it is built here (`joint_objective`) in two ways, both held to the single-process
network's gradients by the tests:

- one pass per stack (each stack's `objective_and_features`, the main rows): the codes of
  the fused `tied_autoencode` give the sparsity term and the features for the next stack,
  so W x is computed once per stack and the stack's input and codes are exchanged once;
- composed from the public `objective` and `forward` of each stack ("composed update", for
  context): W x twice per stack, the second time through the differentiable `encode`, whose
  weight-sized temporaries (normalised W, and its gradient) make the single process much
  slower on large networks, which flatters the speedup of the partitioned one.

Workers are processes with one thread each, brought up by `scaleout.comm.run_locally` (gloo
on loopback), so 2 workers use twice the cores of 1, as 2 GPUs did in the paper; grids 1x1,
1x2 and 2x2 for 1, 2 and 4 workers. The baseline is the plain `SparseAutoencoderNetwork` in
one process with one thread; the 1x1 partitioned network (its exchanges only copy locally)
and the plain network with 2 threads are shown beside it. This machine has 2 cores: 4
workers oversubscribe it and are shown without a target. Networks: the three-stack layout of
`configs/autoencoder_small.toml` on inputs of `SCALEOUT_BENCH_MP_SIZES` pixels (default 32,
64, 96, 128: 1.7M, 14M, 38M and 73M parameters), minibatch `SCALEOUT_BENCH_MP_BATCH` (32).
Targets: 2 workers >= 1.7x over 1 on the largest; at 96 and 128 px the 1x1 partitioned
network within 3% of the plain one and 1x2 >= 0.97x the machine's ceiling (below). Like the
paper's figure 6, the speedups are per network size (each size's own 1-worker time), with
the sizes' parameter counts in the row names.

All set-ups live in one group of 4 processes and take turns, one update each, round after
round (`SCALEOUT_BENCH_MP_WARMUP` rounds untimed, 2; then `SCALEOUT_BENCH_MP_TIMED` rounds,
9; medians are reported), so that load from other work on this shared machine falls on all
of them alike; each round runs them in an order drawn for it, so that no set-up always
follows the same one (what ran before leaves caches and memory in its own state). Ratios of
two set-ups of one process (1x1 partitioned / plain) are the median of their per-round
ratios, which drift in the machine's speed between rounds does not move; so is the 1x2
grid's share of the machine's ceiling (two independent processes' time over twice the
grid's, both 2-process set-ups: the 1-worker time cancels).
Before each update every process meets at a barrier; processes outside the set-up wait
there (blocked in gloo, not spinning). An update's time is its slowest worker's.
"2 independent 1-thread processes" runs the 1-worker update in two processes at once with no
communication: how much two processes slow each other here (shared memory bandwidth and
caches, other jobs); each of its processes touches the whole network, a 1x2 worker half.

Exchanges are measured in the workers by wrapping `scaleout.comm.darray.exchange` (all of
an exchange, forward and backward: cutting the pieces, codec, transfer, summing into the
buffer) and `torch.distributed.all_to_all_single` (the transfer; the bytes counted are the
payload sent to other workers). A transfer is a collective: it includes waiting until the
last worker arrives, measured from the start times of the same transfer on every worker
(perf_counter is one clock for all processes). Each share is that time over the update's,
averaged over the workers; "CPU time / wall time" (the worker's process time, gloo's threads
included, over the update's wall time) is below 1 when a worker is blocked or waits for a
core, so it shows whether each worker really had a core of its own.

(2) 8-bit exchange (the 8-bit paper's model-parallel use): the same 1x2 updates with codec
"dynamic8" on every exchanged activation and gradient (bytes and time beside fp32), and
greedy training by the library, `scaleout.fit`, as `scaleout train
configs/autoencoder_model_parallel.toml` does it (32x32 whitened natural-image patches,
minibatch 64, SGD momentum 0.9, lr 0.01, alpha fitted at each stack's start, one thread per
worker) for `SCALEOUT_BENCH_MP_TRAIN_STEPS` steps per stack (100) from the same weights:
strategy "model_parallel" on a 1x2 grid with fp32 and with `compress.codec = "dynamic8"`,
and strategy "single". Compared: each stack's objective on 512 held-out patches at the end
of its phase (the run's evaluation; the stacks below are frozen by then, so it is also the
objective at the end of the run). The run-to-run reference is the single process trained on
another data order (`run.seed = 1`; the model and data factories fix weights and patches);
the 8-bit target is to differ from fp32 by no more than that. The objective curves are the
runs' metrics.jsonl (a line per step); the bytes a grid worker sent in the last step of each
stack are measured inside the run by `MeteredNetwork`, beside `bytes_per_step`.
"""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.model_parallel_report import (
    plot,
    scaling_rows,
    spread_notes,
    summarize_scaling,
    training_notes,
    training_rows,
)
from benchmarks.model_parallel_update import (
    MOMENTUM,
    ExchangeMeter,
    Updater,
    joint_objective,
    network,
)
from scaleout.api import fit
from scaleout.comm import run_locally
from scaleout.compress import get
from scaleout.data import natural_image_patches
from scaleout.metrics import read_metrics
from scaleout.parallel import parallelize
from scaleout.runtime import session

__all__ = ["ExchangeMeter", "Settings", "Updater", "joint_objective", "network", "plot", "results"]

WORLD = 4  # processes of the suite's group (the 2x2 grid)
TRAIN_SIZE, TRAIN_BATCH, TRAIN_LR = 32, 64, 0.01
TIMING_LR = 1e-4  # the timed updates only need to stay finite


def _env(name: str, default: str) -> Callable[[], int]:
    return lambda: int(os.environ.get(f"SCALEOUT_BENCH_MP_{name}", default))


def _env_sizes() -> list[int]:
    sizes = os.environ.get("SCALEOUT_BENCH_MP_SIZES", "32,64,96,128")
    return [int(v) for v in sizes.split(",")]


@dataclass
class Settings:
    """What the suite runs; the defaults come from `SCALEOUT_BENCH_MP_*` variables (SIZES as
    a comma-separated list, BATCH, WARMUP, TIMED, TRAIN_STEPS)."""

    sizes: list[int] = field(default_factory=_env_sizes)
    batch: int = field(default_factory=_env("BATCH", "32"))
    warmup: int = field(default_factory=_env("WARMUP", "2"))
    timed: int = field(default_factory=_env("TIMED", "9"))
    train_steps: int = field(default_factory=_env("TRAIN_STEPS", "100"))  # per stack
    num_eval: int = 512

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 24:
            raise ValueError(f"SCALEOUT_BENCH_MP_SIZES must list sizes >= 24, got {self.sizes}")
        for name in ("batch", "timed", "train_steps", "num_eval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Setup:
    """A way to run the update: on ranks 0 .. num_ranks - 1, with `threads` threads each."""

    name: str
    num_ranks: int
    threads: int
    build: Callable[[], Updater]
    composed: bool = False  # time `joint_objective(composed=True)`


def setups(size: int, rank: int, groups: dict[int, Any]) -> list[Setup]:
    """The set-ups timed side by side; those of one network share it (and its optimizer)."""
    built: dict[tuple, Updater] = {}

    def once(key: tuple, build: Callable[[], Updater]) -> Callable[[], Updater]:
        def get_or_build() -> Updater:
            if key not in built:
                built[key] = build()
            return built[key]

        return get_or_build

    def plain() -> Updater:
        return Updater(network(size), TIMING_LR)

    def partitioned(grid: tuple[int, int], codec: str | None = None) -> Callable[[], Updater]:
        def build() -> Updater:
            codec_ = None if codec is None else get(codec)
            world = grid[0] * grid[1]
            model = parallelize(network(size), grid, rank, groups[world], codec=codec_)
            return Updater(model, TIMING_LR)

        return once((grid, codec), build)

    return [
        Setup("1 worker", 1, 1, once(("plain",), plain)),
        Setup("1 worker, 2 threads", 1, 2, once(("plain",), plain)),
        Setup("2 independent 1-thread processes", 2, 1, once(("plain",), plain)),
        Setup("1x1 partitioned", 1, 1, partitioned((1, 1))),
        Setup("1x2", 2, 1, partitioned((1, 2))),
        Setup("1x2 dynamic8", 2, 1, partitioned((1, 2), "dynamic8")),
        Setup("2x2", 4, 1, partitioned((2, 2))),
        Setup("1 worker, composed update", 1, 1, once(("plain",), plain), composed=True),
        Setup("1x2, composed update", 2, 1, partitioned((1, 2)), composed=True),
    ]


def time_updates(size: int, settings: Settings, rank: int, groups: dict[int, Any]) -> dict:
    """This worker's measurements of every timed update, by set-up."""
    x = torch.randn(settings.batch, 1, size, size, generator=torch.Generator().manual_seed(size))
    plans = setups(size, rank, groups)
    updaters = {s.name: s.build() for s in plans if rank < s.num_ranks}
    records: dict[str, list[dict]] = {name: [] for name in updaters}
    meter = ExchangeMeter()
    with meter.metering():
        for round_ in range(settings.warmup + settings.timed):
            # An order drawn per round, the same on every rank (the barriers match): no
            # set-up always follows the same one (what ran before leaves caches and memory
            # in its own state; a fixed rotation put "1x1 partitioned" after "2 independent
            # processes" in every round but one).
            for setup in random.Random(round_).sample(plans, len(plans)):
                dist.barrier()
                if rank >= setup.num_ranks:
                    continue
                torch.set_num_threads(setup.threads)
                meter.reset()
                started, cpu_started = time.perf_counter(), time.process_time()
                updaters[setup.name].step(x, setup.composed)
                elapsed = time.perf_counter() - started
                cpu = time.process_time() - cpu_started
                torch.set_num_threads(1)
                if round_ >= settings.warmup:
                    records[setup.name].append(
                        {
                            "seconds": elapsed,
                            "cpu_s": cpu,
                            "exchange_s": meter.exchange_s,
                            "transfer_s": meter.transfer_s,
                            "bytes": meter.bytes_sent,
                            "transfer_starts": meter.transfer_starts,
                        }
                    )
    dist.barrier()
    parameters = sum(p.numel() for p in network(size).parameters())
    return {"size": size, "parameters": parameters, "records": records}


# --- (2) greedy training with and without 8-bit exchanges, by scaleout.fit ---------------


def patches(num_eval: int) -> tuple[Dataset, Dataset]:
    """The training runs' data (`fit`'s `data=`): the same patches whatever `run.seed`."""
    train = natural_image_patches(TRAIN_SIZE, 16 * 1024, seed=0)
    return train, natural_image_patches(TRAIN_SIZE, num_eval, seed=1)


def greedy_fit(
    name: str, strategy: str, seed: int, codec: str, settings: Settings, root: Path
) -> dict:
    """One greedy training run by `scaleout.fit`: the objective of every step, each stack's
    held-out objective at its end, and per stack the bytes a grid worker sent in its last
    step beside `bytes_per_step` (0 in one process)."""
    steps = settings.train_steps
    never = 3 * steps + 1  # evaluations and checkpoints at the stacks' ends only
    config = {
        "run": {
            "name": name,
            "out_dir": str(root),
            "seed": seed,
            "device": "cpu",
            "num_threads": 1,
        },
        "train": {
            "strategy": strategy,
            "steps": steps,  # per stack
            "batch_size": TRAIN_BATCH,
            "optimizer": "momentum",
            "lr": TRAIN_LR,
            "momentum": MOMENTUM,
            "log_every": 1,
            "eval_every": never,
            "checkpoint_every": never,
            "eval_batch_size": settings.num_eval,
            "keep_checkpoints": 1,
        },
        "model_parallel": {"grid": [1, 2]},
        "compress": {"codec": codec},
    }
    model = functools.partial(network, TRAIN_SIZE, metered=True)
    data = functools.partial(patches, settings.num_eval)
    threads = torch.get_num_threads()
    try:
        result = fit(config, model=model, data=data, overwrite=True)
    finally:
        torch.set_num_threads(threads)
    assert result.run_dir is not None
    lines = read_metrics(result.run_dir / "metrics.jsonl")
    ends = [r for r in lines if "test_loss" in r]  # one per stack
    return {
        "curve": [r["loss"] for r in lines],
        "objective": [r["test_loss"] for r in ends],
        "bytes_measured": [r.get("bytes_sent", 0) for r in ends],
        "bytes_per_step": [r.get("bytes_per_step", 0) for r in ends],
    }


def train_runs(settings: Settings) -> dict:
    """The single process on data orders 0 and 1, then fp32 and dynamic8 on the 1x2 grid
    (data order 0), in one Ray session. Every run starts from the same weights."""
    plan = {
        "single, data order 0": ("single", 0, "fp32"),
        "single, data order 1": ("single", 1, "fp32"),
        "1x2 fp32": ("model_parallel", 0, "fp32"),
        "1x2 dynamic8": ("model_parallel", 0, "dynamic8"),
    }
    with session(), tempfile.TemporaryDirectory(prefix="bench-mp-") as tmp:
        return {
            name: greedy_fit(f"run{i}", strategy, seed, codec, settings, Path(tmp))
            for i, (name, (strategy, seed, codec)) in enumerate(plan.items())
        }


# --- processes of the timing harness ------------------------------------------------------


def _worker(rank: int, world: int, settings: Settings, out: Path) -> None:
    torch.set_num_threads(1)
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 4: None}
    scaling = [time_updates(size, settings, rank, groups) for size in settings.sizes]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"scaling": scaling})
    if rank == 0:
        out.write_text(json.dumps({"settings": asdict(settings), "ranks": gathered}))


def measure(settings: Settings | None = None) -> dict:
    """Time every update in a group of `WORLD` processes; the raw records of all ranks."""
    settings = settings or Settings()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model_parallel.json"
        run_locally(_worker, WORLD, settings, out)
        return json.loads(out.read_text())


def results(settings: Settings | None = None) -> tuple[list[Row], list[str], list[dict], dict]:
    """Measure, then the rows, notes, per-size summaries and training runs."""
    raw = measure(settings)
    settings = Settings(**raw["settings"])
    ranks = raw["ranks"]
    scaling, rows = [], []
    for i, size in enumerate(settings.sizes):
        per_rank = [r["scaling"][i] for r in ranks]
        summary = summarize_scaling(per_rank)
        parameters = per_rank[0]["parameters"]
        scaling.append({"size": size, "parameters": parameters, "summary": summary})
        rows += scaling_rows(size, parameters, summary, largest=size == max(settings.sizes))
    runs = train_runs(settings)
    rows += training_rows(runs, settings.train_steps)
    notes = [
        f"update of all layers (joint: forward, every stack's objective, full backward, "
        f"sync_grads, SGD momentum), minibatch {settings.batch}, median of {settings.timed} "
        f"rounds after {settings.warmup}; one thread per worker, gloo on loopback; "
        f"{os.cpu_count()} cores: the 2x2 grid's 4 workers oversubscribe them.",
        "exchange share: time in darray.exchange (forward and backward, codec included) over "
        "the update's time; transfer share: in all_to_all_single alone, waiting for the "
        "partner included.",
        f"training: scaleout.fit, strategies single and model_parallel (1x2 grid), "
        f"{settings.train_steps} greedy steps per stack on 32x32 patches, minibatch "
        f"{TRAIN_BATCH}, SGD momentum, lr {TRAIN_LR}, one thread per worker; objective on "
        f"{settings.num_eval} held-out patches at the end of each stack's phase.",
        *training_notes(runs, settings.train_steps),
        *spread_notes(scaling),
    ]
    return rows, notes, scaling, runs


@register_suite("model_parallel", "COTS HPC Figs 5/6: model-parallel scaling; 8-bit exchanges")
def run() -> SuiteResult:
    rows, notes, scaling, runs = results()
    return SuiteResult(rows, plot=lambda path: plot(scaling, runs, path), notes=notes)
