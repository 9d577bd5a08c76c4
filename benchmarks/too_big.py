"""Suite `too_big`: sharded data parallelism and pipeline stages against what a user would
run instead, in time to quality, with the simulator's prediction beside each.

- The LM example (`examples/char_lm.toml`, 600 steps of 32, evaluated every `EVAL_EVERY`):
  one process at 1 thread, one process at 2 threads (the box's ceiling: every core in one
  process, nothing exchanged), sync on 2 workers with DDP (`allreduce`), sync with `fsdp`,
  and 2 pipeline stages (1F1B, 4 micro-batches; the tied embedding held at both ends),
  with fp32 and 8-bit activations. The target is the test loss `LM_TARGET`.
- The Fashion-MNIST CNN (`examples/fashion_cnn.toml`, batch 32, `CNN_STEPS` steps): one
  process at 1 and 2 threads, DDP on 2 workers, and 2 pipeline stages (GPipe and 1F1B, 4
  micro-batches; 1F1B also with 8-bit activations). The target is the test accuracy
  `CNN_TARGET`.

Each run's examples/s is the median of its metrics lines after the first (start-up); its
time to target is the first evaluation at or past the target (seconds since the run began,
and examples). First `scaleout calibrate` measures both models on this machine (sync, so
that DDP's and FSDP's own costs are measured too); each distributed run is then simulated
with `--machines 1` and its prediction is a row beside it. Run from the repository root on
a quiet machine (about 35 minutes).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Literal

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.asynchrony import evaluations, reach
from benchmarks.char_lm import trained
from scaleout.api import load_config

LM, CNN = Path("examples/char_lm.toml"), Path("examples/fashion_cnn.toml")
EVAL_EVERY = 50
LM_TARGET = 1.6  # test loss, nats per character
CNN_TARGET = 0.85  # test accuracy
CNN_STEPS = 600
CNN_COMMON = ["train.batch_size=32", f"train.steps={CNN_STEPS}"]
STAGES = ["train.strategy='model_parallel'", "model_parallel.stages=2"]
RUNS: dict[str, tuple[Path, list[str], bool]] = {  # name -> config, overrides, simulated
    "LM, one process, 1 thread": (LM, ["train.strategy='single'"], False),
    "LM, one process, 2 threads (ceiling)": (
        LM,
        ["train.strategy='single'", "run.num_threads=2"],
        False,
    ),
    "LM, DDP, 2 workers": (LM, ["train.strategy='sync'"], True),
    "LM, FSDP, 2 workers": (LM, ["train.strategy='sync'", "sync.mode='fsdp'"], True),
    "LM, 2 stages, 1F1B": (LM, [*STAGES, "model_parallel.schedule='1f1b'"], True),
    "LM, 2 stages, 1F1B, 8-bit activations": (
        LM,
        [*STAGES, "model_parallel.schedule='1f1b'", "compress.codec='dynamic8'"],
        True,
    ),
    "CNN, one process, 1 thread": (CNN, [*CNN_COMMON, "train.strategy='single'"], False),
    "CNN, one process, 2 threads (ceiling)": (
        CNN,
        [*CNN_COMMON, "train.strategy='single'", "run.num_threads=2"],
        False,
    ),
    "CNN, DDP, 2 workers": (CNN, [*CNN_COMMON, "train.strategy='sync'"], True),
    "CNN, 2 stages, GPipe": (
        CNN,
        [*CNN_COMMON, *STAGES, "model_parallel.schedule='gpipe'"],
        True,
    ),
    "CNN, 2 stages, 1F1B": (
        CNN,
        [*CNN_COMMON, *STAGES, "model_parallel.schedule='1f1b'"],
        True,
    ),
    "CNN, 2 stages, 1F1B, 8-bit activations": (
        CNN,
        [*CNN_COMMON, *STAGES, "model_parallel.schedule='1f1b'", "compress.codec='dynamic8'"],
        True,
    ),
}


def _train(name: str, config: Path, overrides: list[str], root: Path) -> dict[str, Any]:
    slug = "".join(c if c.isalnum() else "_" for c in name.lower())
    every = [f"train.eval_every={EVAL_EVERY}", "train.log_every=25"]
    run = trained(config, [*overrides, *every], slug, root)
    rates = run["rates"]
    run["rate"] = statistics.median(rates) if rates else run["summary"]["examples_per_s"]
    return run


def _predicted(config: Path, overrides: list[str], calibration: Path) -> float:
    from scaleout.sim.simulate import Request, simulate

    every = [f"train.eval_every={EVAL_EVERY}", "train.log_every=25"]
    request = Request(config, [1], calibration=calibration, overrides=[*overrides, *every])
    row = simulate(request)[0]
    return row["steady_examples_per_s"] or row["examples_per_s"]


@register_suite("too_big", "FSDP and pipeline stages against DDP and one process, to a target")
def run() -> SuiteResult:
    from scaleout.sim.calibrate import calibrate

    for path in (LM, CNN):
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: run `python -m benchmarks too_big` from the root"
            )
    rows: list[Row] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        configs = [
            load_config(p, ["train.strategy='sync'", "train.batch_size=32"]) for p in (LM, CNN)
        ]
        calibration = calibrate(configs, say=lambda _: None).save(root / "calibration.json")
        runs = {name: _train(name, c, o, root) for name, (c, o, _) in RUNS.items()}
        for name, (config, overrides, simulated) in RUNS.items():
            run_, lm = runs[name], config == LM
            rows.append(Row(f"{name}: examples/s", run_["rate"], "ex/s", "higher"))
            if simulated:
                predicted = _predicted(config, overrides, calibration)
                rows.append(Row(f"{name}: simulated examples/s", predicted, "ex/s", "higher"))
                rows.append(
                    Row(
                        f"{name}: prediction error",
                        100 * (predicted / run_["rate"] - 1),
                        "%",
                        "lower",
                    )
                )
            metric = "test_loss" if lm else "test_accuracy"
            better: Literal["lower", "higher"] = "lower" if lm else "higher"
            goal = LM_TARGET if lm else CNN_TARGET
            reached = reach(evaluations(run_["evals"], metric), metric, goal, better)
            target = f"test loss {LM_TARGET}" if lm else f"test accuracy {CNN_TARGET:.0%}"
            if reached is None:
                notes.append(f"{name} did not reach {target}")
            else:
                rows.append(Row(f"{name}: seconds to {target}", reached[0], "s", "lower"))
                rows.append(Row(f"{name}: examples to {target}", reached[1], "", "lower"))
            final = run_["evals"][-1][metric]
            rows.append(Row(f"{name}: final {metric.replace('_', ' ')}", final, "", better))
            held = run_["summary"].get("parameter_bytes")
            if held is not None:
                state = held + run_["summary"].get("optimizer_bytes", 0)
                rows.append(
                    Row(f"{name}: parameter + optimizer bytes per worker", state, "B", "lower")
                )
    notes.append(
        "examples/s: median of the metrics lines after the first; time to target: the first "
        f"evaluation (every {EVAL_EVERY} steps) at or past it, seconds since the run began; "
        "simulated: `scaleout simulate --machines 1` with a calibration taken in this run"
    )
    return SuiteResult(rows, notes=notes)
