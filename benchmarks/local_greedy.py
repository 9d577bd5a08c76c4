"""Suite `local`, part 4: greedy training of the 1.8-billion-parameter network by the
library (`scaleout.fit`, strategy "single"), stack by stack, with the memory checked first
(see `benchmarks.local`'s docstring for what is measured and how)."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import torch

from benchmarks import Row
from scaleout.api import fit, load_config
from scaleout.metrics import read_metrics

GREEDY_CONFIG = Path(
    os.environ.get(
        "SCALEOUT_BENCH_LOCAL_CONFIG",
        Path(__file__).resolve().parents[1] / "configs" / "autoencoder_1.8b.toml",
    )
)
# minibatches per stack and thread count: one warm-up, then the timed ones
GREEDY_STEPS = int(os.environ.get("SCALEOUT_BENCH_LOCAL_STEPS", 3))


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); a large number elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50


def reset_peak_memory() -> bool:
    """Reset the process's peak resident size (Linux: /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory() -> int:
    """Peak resident size of this process since the last reset, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def greedy_rows(rows: list[Row], notes: list[str], timings: dict) -> None:
    """Greedy training of the 1.8B network by `scaleout.fit`, once per thread count, with
    memory checked first; seconds per minibatch of each stack and the run's peak memory."""
    config = load_config(GREEDY_CONFIG)
    name, batch = config.run.name, config.train.batch_size
    with torch.device("meta"):
        shapes = config.model.build()
    per_stack = [sum(p.numel() for p in s.parameters()) * 4 for s in shapes.stacks]
    weights, largest = sum(per_stack), max(per_stack)
    margin = 3 << 30  # activations, gathered fields, data, the interpreter
    if available_bytes() < weights + largest + margin:  # + the largest stack's gradient
        notes.append(
            f"greedy {name}: skipped, {available_bytes() / 2**30:.1f} GiB available, the "
            f"weights and one stack's gradient need {(weights + largest) / 2**30:.1f} GiB"
        )
        return
    optimizer = config.train.optimizer
    if optimizer == "momentum" and available_bytes() < weights + 2 * largest + margin:
        optimizer = "sgd"
        notes.append(
            f"greedy {name}: fp32 momentum of the largest stack ({largest / 2**30:.1f} GiB) "
            f"does not fit beside the weights in the {available_bytes() / 2**30:.1f} GiB "
            "available: trained by SGD without momentum (train.optimizer = sgd)"
        )
    all_threads = torch.get_num_threads()
    # One thread as well: on a machine whose two cores other work shares, every parallel
    # region can wait a scheduler tick for its second thread, and one thread is then faster.
    seconds: dict[int, dict[int, float]] = {}  # threads -> stack -> s per minibatch
    last: dict[int, dict] = {}  # stack -> its last metrics line
    peak = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-local-") as tmp:
        for threads in sorted({1, all_threads}):
            never = GREEDY_STEPS * shapes.num_stacks + 1  # evaluations, checkpoints: phase ends
            overrides = [
                f"run.out_dir={tmp}",
                f"run.name={name}_{threads}_threads",
                "run.device=cpu",
                f"run.num_threads={threads}",
                f"data.num_train={batch}",  # one minibatch, as good as any for speed
                "train.strategy=single",
                f"train.optimizer={optimizer}",
                f"train.steps={GREEDY_STEPS}",
                "train.log_every=1",
                f"train.eval_every={never}",
                f"train.checkpoint_every={never}",
                "train.keep_checkpoints=1",
            ]
            gc.collect()
            reset_peak_memory()
            try:
                result = fit(GREEDY_CONFIG, overrides=overrides, overwrite=True)
            finally:
                torch.set_num_threads(all_threads)
            peak = max(peak, peak_memory() / 2**30)
            assert result.run_dir is not None
            lines = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "stack" in r]
            seconds[threads] = {}
            for k in range(1, shapes.num_stacks + 1):
                stack = [r for r in lines if r["stack"] == k]
                timed = stack[1:] or stack  # the first also fits alpha and warms up
                seconds[threads][k] = min(batch / r["examples_per_s"] for r in timed)
                last[k] = stack[-1]
            del result
    notes.append(
        f"greedy {name}: {weights // 4:,} parameters, scaleout.fit (strategy single) once per "
        f"thread count, {GREEDY_STEPS} minibatches of {batch} per stack: the first warms up "
        "(and fits alpha), the fastest of the others is reported; speed only (a few steps do "
        "not train it); evaluation and a checkpoint at each stack's end, left out of the "
        "times. Peak memory: the whole run's (the process's peak over the runs), not each "
        "stack's: the same value in each stack's row"
    )
    for k in range(1, shapes.num_stacks + 1):
        per_step = min(times[k] for times in seconds.values())
        timings[k] = (per_step, peak)
        label = f"greedy {name}, stack {k}"
        rows += [
            Row(f"{label}: seconds per minibatch of {batch}", per_step, "s", "lower"),
            Row(f"{label}: peak memory", peak, "GiB", "lower", target=24.0),
        ]
        by_threads = ", ".join(f"{t} thread(s) {v[k]:.3g} s" for t, v in seconds.items())
        notes.append(
            f"stack {k}: {by_threads} per minibatch (the faster is reported); objective "
            f"{last[k]['reconstruction']:.4g} + {last[k]['sparsity']:.4g}; optimizer "
            f"{optimizer}; load average {os.getloadavg()[0]:.1f}"
        )
