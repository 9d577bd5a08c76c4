"""Suite `char_lm`: what users train today, under each strategy, in one run.

The character-level GPT of `examples/char_lm.toml` (1.26M parameters, tied embeddings,
AdamW, cosine schedule with warm-up, clipping at 1.0) on the Python standard library's
source: 600 steps of 32 sequences of 64 characters under strategy single, sync (2 workers,
DDP) and downpour (2 replicas, 2 shards, n_fetch = n_push = 1), and single again in bf16.
Every run evaluates the same 1,023 test sequences every 100 steps, so the losses compare at
equal examples.

Rows: each run's final test loss, perplexity and token accuracy; sync's test loss against
single's at every evaluation (target: within 1%, the same training on two workers); bf16's
final test loss against fp32's (target: within 2%) and its examples/s against fp32's on
this CPU (both on one thread). Run from the repository root: the factories are imported as
`examples.char_lm`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from benchmarks import Row, SuiteResult, one_axis, register_suite
from scaleout.api import fit
from scaleout.metrics import read_metrics

CONFIG = Path("examples/char_lm.toml")
RUNS = {  # name -> overrides of the example's config
    "single": ["train.strategy='single'"],
    "sync": ["train.strategy='sync'"],
    "downpour": ["train.strategy='downpour'"],
    "single_bf16": ["train.strategy='single'", "run.precision='bf16'"],
}
EVAL_EVERY = 100


def trained(config: Path, overrides: list[str], name: str, root: Path) -> dict[str, Any]:
    """`config` trained with `overrides` as run `name` under `root`: its summary, its
    evaluation lines, and the examples/s of its metrics lines after the first (start-up)."""
    result = fit(
        config,
        overrides=[*overrides, f"run.name='{name}'", f"run.out_dir='{root}'"],
        overwrite=True,
    )
    records = read_metrics(Path(result.run_dir) / "metrics.jsonl")
    return {
        "summary": result.summary,
        "evals": [r for r in records if "test_loss" in r],
        "rates": [r["examples_per_s"] for r in records[1:] if r.get("examples_per_s")],
    }


def _train(name: str, overrides: list[str], root: Path) -> dict[str, Any]:
    run = trained(CONFIG, [*overrides, f"train.eval_every={EVAL_EVERY}"], name, root)
    rates = run["rates"]
    run["rate"] = sorted(rates)[len(rates) // 2] if rates else run["summary"]["examples_per_s"]
    return run


def _plot(runs: dict[str, dict[str, Any]], ax: Any) -> None:  # noqa: ANN401 - an Axes
    for name, run in runs.items():
        evals = run["evals"]
        ax.plot([r["examples"] for r in evals], [r["test_loss"] for r in evals], "o-", label=name)
    ax.set_xlabel("examples")
    ax.set_ylabel("test loss (nats per character)")
    ax.set_title("char_lm: 1.26M-parameter GPT, AdamW + cosine + clipping")
    ax.legend()
    ax.grid(alpha=0.3)


@register_suite("char_lm", "a small GPT (tied weights, AdamW, cosine) under each strategy")
def run() -> SuiteResult:
    if not CONFIG.exists():
        raise FileNotFoundError(
            f"{CONFIG} not found: run `python -m benchmarks char_lm` from the repository root"
        )
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS.items():
            runs[name] = _train(name, overrides, Path(tmp))
    rows: list[Row] = []
    for name, run_ in runs.items():
        summary = run_["summary"]
        rows += [
            Row(f"{name}: final test loss", summary["final_test_loss"], "nats", "lower"),
            Row(f"{name}: test perplexity", summary["final_test_perplexity"], "x", "lower"),
            Row(f"{name}: token accuracy", summary["final_test_accuracy"], "fraction", "higher"),
            Row(f"{name}: training rate (median metrics line)", run_["rate"], "ex/s", "higher"),
            Row(f"{name}: wall time", summary["time_s"], "s", "lower"),
        ]
    single, sync, bf16 = (
        runs["single"]["evals"],
        runs["sync"]["evals"],
        runs["single_bf16"]["evals"],
    )
    gaps = [abs(b["test_loss"] / a["test_loss"] - 1) for a, b in zip(single, sync, strict=True)]
    rows.append(
        Row(
            "sync vs single: largest test-loss gap over evaluations",
            max(gaps),
            "fraction",
            "lower",
            target=0.01,
        )
    )
    downpour = runs["downpour"]["evals"]
    rows.append(
        Row(
            "downpour / single: final test loss",
            downpour[-1]["test_loss"] / single[-1]["test_loss"],
            "x",
            "lower",
        )
    )
    bf16_gap = abs(bf16[-1]["test_loss"] / single[-1]["test_loss"] - 1)
    rows.append(
        Row(
            "bf16 vs fp32 (single): final test-loss gap", bf16_gap, "fraction", "lower", target=0.02
        )
    )
    rows.append(
        Row(
            "bf16 / fp32 (single): examples/s",
            runs["single_bf16"]["rate"] / runs["single"]["rate"],
            "x",
            "higher",
        )
    )
    notes = [
        f"{len(single)} evaluations at steps {[r['step'] for r in single]}, equal examples in "
        "every run; sync's and single's test losses: "
        + ", ".join(
            f"{a['test_loss']:.4f}/{b['test_loss']:.4f}" for a, b in zip(single, sync, strict=True)
        ),
        "downpour's replicas push every step into AdamW on the shards; its gap to single is "
        "the staleness of two replicas (one push behind each other at least)",
    ]
    return SuiteResult(rows, plot=one_axis(_plot, runs), notes=notes)
