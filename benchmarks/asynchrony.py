"""Suite `async`: which asynchrony to choose, on the LM example and on MNIST.

Two workloads, each trained by `scaleout.fit` under every configuration below:

- `lm`: the character-level GPT of `examples/char_lm.toml` (600 steps of 32 sequences,
  19,200 examples), target: sync's final test loss (the median of sync's runs in the same
  suite run) and a fixed test loss of `LM_TARGET`; evaluated every 50 steps.
- `mnist`: the demo, `configs/mnist_downpour.toml` (MLP, Adagrad, batch 128; its gradient
  pushes at n_fetch = n_push = 3, the paper's Downpour as the demo once ran it; its DiLoCo
  H = 8 is the row of that H), for 2,345 steps (its 5 epochs of 469 batches), target: 97%
  test accuracy; evaluated every 100 steps.

Configurations of each workload (the workload's config with these overrides): single with 1
and 2 threads; sync with 2 workers (the reference: it always runs when any of its
workload's configurations does); Downpour (gradients mode) with 1 and 2 replicas under each
`downpour.staleness_rule` and with `downpour.max_staleness = MAX_STALENESS`; DiLoCo with 2
replicas at H = 4, 8, 16 (`n_fetch = n_push = H`), the outer optimizer named in the row
(`DILOCO`: per workload and H, the library's defaults where empty). DiLoCo's replicas take
sync's per-worker batch (half the workload's) for twice the steps, evaluations and logging
intervals, and an explicit warm-up is doubled too: every run sees the same examples at the
same evaluations.

Each configuration runs `repeats` times with `run.seed = 0, 1, ...`, seed by seed (every
configuration once, then again), so a slow spell of the machine spreads over all of them;
all share one Ray session. Checkpoints are taken at the end only (shards: never). Figures
per configuration, each the median of its runs with the spread (min-max) in the row's name:
the final test metric (test loss; MNIST: test accuracy), that metric at equal examples (the
evaluation nearest half-way), wall time (metrics lines' `time_s`: training and evaluation,
not start-up), seconds and examples to each target (the first evaluation there; a run
that never gets there counts as later than any that does, so the median is "not reached"
when half the runs or more missed), bytes sent + received per example (the metrics
lines' windows; Downpour only) and the mean (over steps) and largest staleness of pushes.
A row's value is the median (NaN: not reached). A run that fails is left out of its
configuration's figures and named in the notes.

Writes, beside `<suite>.json` (where `run_suite` puts the rows): `<stem>.png` (per
workload, the test metric of each configuration's median run, by final metric, against wall
time and against examples), `<stem>.md` (a Markdown table per workload: medians and
spreads, for the docs) and `<stem>.runs.json` (each run's config overrides, seed and
metrics lines, to re-plot or re-tabulate without training again).

Environment: `SCALEOUT_BENCH_ASYNC_REPEATS` (runs per configuration, default 3);
`SCALEOUT_BENCH_ASYNC_ONLY` (comma-separated patterns, `fnmatch` on "workload/label" names
such as `lm/downpour R=2 rule=dc lambda=0.04`; a bare workload name selects all of it:
`lm`, `mnist/diloco*`, `*/downpour R=2*`); `SCALEOUT_BENCH_ASYNC_STEPS` (steps of each
workload's batch instead of its own, with warm-ups scaled alike: for a quick look) and
`SCALEOUT_BENCH_ASYNC_EVAL_EVERY` (steps between evaluations instead of the workload's).
Run from the repository root: the LM's factories are imported as `examples.char_lm`.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import statistics
import tempfile
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.downpour import fit_metrics
from scaleout.errors import UserError
from scaleout.nn.optim import DEFAULT_WARMUP
from scaleout.runtime import session
from scaleout.strategies.downpour import DownpourSection

Better = Literal["lower", "higher"]
Records = list[dict[str, Any]]

LM_TARGET = 1.6  # the LM's fixed target test loss (nats per character)
MNIST_TARGET = 0.97  # MNIST's target test accuracy
MAX_STALENESS = 1  # the bounded-staleness configuration's downpour.max_staleness
RULES = ("none", "inverse", "dc", "gap")  # downpour.staleness_rule
DC_LAMBDA = DownpourSection.model_fields["dc_lambda"].default
REPLICAS = (1, 2)  # Downpour's (gradients mode)
DILOCO_REPLICAS = 2
# DiLoCo's outer optimizer per workload and H (downpour.outer_optimizer, outer_lr,
# outer_momentum); what a dict leaves out is the library's default. Named in each row.
# On the LM (AdamW), outer Nesterov 0.7 / 0.9 ended far above outer SGD at 1.0 (model
# averaging): results/measurements.md.
_AVERAGING = {"outer_optimizer": "sgd", "outer_lr": 1.0}
DILOCO: dict[str, dict[int, dict[str, Any]]] = {
    "lm": {4: _AVERAGING, 8: _AVERAGING, 16: _AVERAGING},
    "mnist": {4: {}, 8: {}, 16: {}},
}
OUTER_KEYS = ("outer_optimizer", "outer_lr", "outer_momentum")


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(f"SCALEOUT_BENCH_ASYNC_{name}", "")
    return int(value) if value.strip() else default


def _env_only() -> list[str]:
    value = os.environ.get("SCALEOUT_BENCH_ASYNC_ONLY", "")
    return [p.strip() for p in value.split(",") if p.strip()]


@dataclass
class Settings:
    """What the suite runs; the defaults come from `SCALEOUT_BENCH_ASYNC_*` variables."""

    repeats: int = field(default_factory=lambda: _env_int("REPEATS", 3) or 3)
    only: list[str] = field(default_factory=_env_only)  # patterns; empty: everything
    steps: int | None = field(default_factory=lambda: _env_int("STEPS", None))
    eval_every: int | None = field(default_factory=lambda: _env_int("EVAL_EVERY", None))


@dataclass(frozen=True)
class Workload:
    """A config file and what its runs are measured by."""

    name: str
    config: Path
    steps: int  # of `batch` examples
    batch: int
    eval_every: int  # steps of `batch`
    metric: str  # the test metric compared: "test_loss" or "test_accuracy"
    better: Better
    unit: str
    fixed_target: float
    sync_target: bool  # sync's final metric (median of its runs) is a target too
    describe: str
    # gradient pushes' [downpour] settings where the config's own are DiLoCo's (the demo)
    gradients: tuple[tuple[str, Any], ...] = ()

    def format(self, value: float) -> str:
        return f"{value:.1%}" if self.metric == "test_accuracy" else f"{value:.4f}"


LM = Workload(
    "lm",
    Path("examples/char_lm.toml"),
    steps=600,
    batch=32,
    eval_every=50,
    metric="test_loss",
    better="lower",
    unit="nats",
    fixed_target=LM_TARGET,
    sync_target=True,
    describe="char_lm.toml: 1.26M-parameter GPT, AdamW + cosine, batch 32",
)
MNIST = Workload(
    "mnist",
    Path("configs/mnist_downpour.toml"),
    steps=2345,
    batch=128,
    eval_every=100,
    metric="test_accuracy",
    better="higher",
    unit="fraction",
    fixed_target=MNIST_TARGET,
    sync_target=False,
    describe="mnist_downpour.toml: MLP 784-1024-1024-10, Adagrad, batch 128",
    gradients=(("n_fetch", 3), ("n_push", 3)),  # the paper's Downpour as the demo ran it
)
WORKLOADS = (LM, MNIST)


@dataclass(frozen=True)
class Configuration:
    """One row of the table: overrides of a workload's config sections."""

    workload: Workload
    label: str
    sections: dict[str, dict[str, Any]]
    batch_divisor: int = 1  # each replica on batch / this, for this many times the steps

    @property
    def name(self) -> str:
        return f"{self.workload.name}/{self.label}"


def diloco_outer(workload: str, h: int) -> dict[str, Any]:
    """DiLoCo's outer settings at `h` for `workload`: `DILOCO`'s over the library's."""
    defaults = {key: DownpourSection.model_fields[key].default for key in OUTER_KEYS}
    return {**defaults, **DILOCO.get(workload, {}).get(h, {})}


def configurations(workload: Workload) -> list[Configuration]:
    """Every configuration of `workload`, in the table's order."""
    confs = [
        Configuration(workload, f"single {n} thread{'s' * (n > 1)}", _single(n)) for n in (1, 2)
    ]
    confs.append(
        Configuration(
            workload,
            "sync 2 workers",
            {"train": {"strategy": "sync"}, "run": {"num_threads": 1}, "sync": {"num_workers": 2}},
        )
    )
    for replicas in REPLICAS:
        for rule in RULES:
            label = f"downpour R={replicas} rule={rule}"
            downpour: dict[str, Any] = {**dict(workload.gradients), "staleness_rule": rule}
            if rule == "dc":
                label += f" lambda={DC_LAMBDA:g}"
                downpour["dc_lambda"] = DC_LAMBDA
            confs.append(Configuration(workload, label, _downpour(replicas, downpour)))
        confs.append(
            Configuration(
                workload,
                f"downpour R={replicas} max_staleness={MAX_STALENESS}",
                _downpour(replicas, {**dict(workload.gradients), "max_staleness": MAX_STALENESS}),
            )
        )
    for h in sorted(DILOCO.get(workload.name, {})):
        outer = diloco_outer(workload.name, h)
        label = f"diloco R={DILOCO_REPLICAS} H={h} outer={outer['outer_optimizer']} "
        label += f"lr={outer['outer_lr']:g}"
        if outer["outer_optimizer"] == "nesterov":
            label += f" momentum={outer['outer_momentum']:g}"
        downpour = {"mode": "diloco", "n_fetch": h, "n_push": h, **outer}
        confs.append(Configuration(workload, label, _downpour(DILOCO_REPLICAS, downpour), 2))
    return confs


def _single(threads: int) -> dict[str, dict[str, Any]]:
    return {"train": {"strategy": "single"}, "run": {"num_threads": threads}}


def _downpour(replicas: int, downpour: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        "train": {"strategy": "downpour"},
        "run": {"num_threads": 1},
        "downpour": {"num_replicas": replicas, "threads": False, "mode": "gradients", **downpour},
    }


def selected(confs: Iterable[Configuration], only: Sequence[str]) -> list[Configuration]:
    """The configurations `only` names (all when empty), and sync of each workload that
    has any (the reference): `fnmatch` patterns on names, a bare workload name for all."""
    confs = list(confs)
    if not only:
        return confs

    def wanted(conf: Configuration) -> bool:
        return any(
            fnmatch.fnmatchcase(conf.name, p) or fnmatch.fnmatchcase(conf.name, f"{p}/*")
            for p in only
        )

    workloads = {conf.workload.name for conf in confs if wanted(conf)}
    return [
        conf
        for conf in confs
        if wanted(conf) or (conf.workload.name in workloads and conf.label.startswith("sync"))
    ]


def _merge(raw: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def raw_config(conf: Configuration, settings: Settings, seed: int, root: Path) -> dict[str, Any]:
    """The config tables of one run of `conf`: the workload's file, `conf`'s overrides, the
    suite's length, batch, evaluation points and seed."""
    workload = conf.workload
    with workload.config.open("rb") as file:
        raw = _merge(tomllib.load(file), conf.sections)
    scale = conf.batch_divisor
    steps = (settings.steps or workload.steps) * scale
    eval_every = (settings.eval_every or workload.eval_every) * scale
    train = raw["train"]
    warmup = train.get("warmup_steps")
    if settings.steps is not None:  # a shorter run: its warm-up shrinks alike
        base = warmup if warmup is not None else DEFAULT_WARMUP.get(train["optimizer"], 0)
        warmup = base * scale * settings.steps // workload.steps
    elif warmup is not None:
        warmup *= scale
    train.update(
        steps=steps,
        batch_size=workload.batch // scale,
        eval_every=eval_every,
        log_every=max(1, eval_every // 2),
        checkpoint_every=steps,
        keep_checkpoints=1,
        target_accuracy=None,
    )
    train.pop("epochs", None)
    if warmup is not None:
        train["warmup_steps"] = warmup
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{conf.name}_seed{seed}")
    raw["run"].update(name=name, out_dir=str(root), seed=seed)
    if raw["train"]["strategy"] == "downpour":
        raw["downpour"].update(shard_checkpoint_every=None, shard_checkpoint_seconds=None)
    return raw


# --- figures of runs ------------------------------------------------------------------------


def evaluations(records: Records, metric: str) -> Records:
    """The metrics lines that carry `metric` (an evaluation's)."""
    return [r for r in records if r.get(metric) is not None]


def reach(evals: Records, metric: str, target: float, better: Better) -> tuple[float, int] | None:
    """(time_s, examples) of the first evaluation at `target` or better; None: never."""
    for record in evals:
        value = record[metric]
        if value <= target if better == "lower" else value >= target:
            return record["time_s"], record["examples"]
    return None


def value_at(evals: Records, metric: str, examples: float) -> float | None:
    """`metric` at `examples`: an evaluation's there, else linear between the two around
    it; None outside the evaluations."""
    points = sorted((r["examples"], r[metric]) for r in evals)
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= examples <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (examples - x0) / (x1 - x0)
    if points and points[-1][0] == examples:
        return points[-1][1]
    return None


def bytes_per_example(records: Records) -> float | None:
    """Bytes sent + received over the metrics lines' windows, per example trained; None
    where the lines carry none (a strategy without a parameter server)."""
    windows = [r for r in records if "bytes_sent" in r or "bytes_received" in r]
    examples = max((r.get("examples", 0) for r in records), default=0)
    if not windows or not examples:
        return None
    total = sum(r.get("bytes_sent", 0) + r.get("bytes_received", 0) for r in windows)
    return total / examples


def staleness(records: Records) -> tuple[float | None, float | None]:
    """The pushes' staleness: the windows' means weighted by their steps, and the largest;
    (None, None) where no line carries any."""
    total = weight = 0.0
    largest: float | None = None
    step = 0
    for record in records:
        steps, step = record["step"] - step, record["step"]
        if record.get("staleness_mean") is not None:
            total, weight = total + record["staleness_mean"] * steps, weight + steps
        if record.get("staleness_max") is not None:
            largest = max(largest or 0, record["staleness_max"])
    return (total / weight if weight else None), largest


@dataclass(frozen=True)
class Target:
    """A value of the workload's metric to reach; `fixed`: the label names the value."""

    label: str
    value: float
    fixed: bool = True


def targets(workload: Workload, finals: dict[str, list[float]]) -> list[Target]:
    """`workload`'s targets; `finals`: each configuration's final metrics (for sync's)."""
    metric = workload.metric.replace("_", " ")
    fixed = Target(f"{metric} {workload.fixed_target:g}", workload.fixed_target)
    sync = finals.get(f"{workload.name}/sync 2 workers")
    if not workload.sync_target or not sync:
        return [fixed]
    return [Target(f"sync's final {metric}", statistics.median(sync), fixed=False), fixed]


def target_keys(goal: Target) -> tuple[str, str]:
    """The figures' keys of `goal`: seconds and examples to it."""
    return f"time to {goal.label}", f"examples to {goal.label}"


def run_figures(
    records: Records, workload: Workload, goals: Sequence[Target], at: float
) -> dict[str, float | None]:
    """One run's figures: final metric, metric at `at` examples, wall time, bytes per
    example, staleness, and seconds and examples to each target (None: not reached)."""
    evals = evaluations(records, workload.metric)
    mean, largest = staleness(records)
    figures: dict[str, float | None] = {
        "final": evals[-1][workload.metric] if evals else None,
        "at_equal": value_at(evals, workload.metric, at),
        "wall_s": records[-1]["time_s"] if records else None,
        "bytes_per_example": bytes_per_example(records),
        "staleness_mean": mean,
        "staleness_max": largest,
    }
    for goal in goals:
        reached = reach(evals, workload.metric, goal.value, workload.better)
        time_key, examples_key = target_keys(goal)
        figures[time_key] = None if reached is None else reached[0]
        figures[examples_key] = None if reached is None else reached[1]
    return figures


def equal_examples(workload: Workload, settings: Settings) -> int:
    """The examples at which every run is compared: the evaluation nearest half-way."""
    steps = settings.steps or workload.steps
    every = settings.eval_every or workload.eval_every
    return workload.batch * every * max(1, round(steps / every / 2))


@dataclass(frozen=True)
class Spread:
    """The median of repeated figures with their min and max. `censored` (a time or
    examples to a target): None is "not reached", later than any number, so a median or
    max of None is "not reached"; otherwise None (a figure a run does not have) is left out.
    """

    median: float | None
    low: float | None
    high: float | None
    runs: int  # values counted
    missing: int = 0  # of them not reached
    censored: bool = False

    @classmethod
    def of(cls, values: Sequence[float | None], censored: bool = False) -> Spread:
        present = sorted(v for v in values if v is not None)
        missing = len(values) - len(present) if censored else 0
        ordered: list[float | None] = [*present, *[None] * missing]
        n = len(ordered)
        if n == 0:
            return cls(None, None, None, 0, censored=censored)
        if n % 2:
            median = ordered[n // 2]
        else:
            a, b = ordered[n // 2 - 1], ordered[n // 2]
            median = None if a is None or b is None else (a + b) / 2
        return cls(median, ordered[0], ordered[-1], n, missing, censored)

    @property
    def applies(self) -> bool:
        """Whether any run has this figure (a target that none reached still does)."""
        return self.runs > 0

    @staticmethod
    def _show(value: float | None, fmt: str) -> str:
        return "not reached" if value is None else fmt.format(value)

    def range_text(self, fmt: str = "{:.4g}") -> str:
        """The range, low–high; one value where the runs agree (or there is one)."""
        if self.low == self.high:  # one run, runs that agree, or none reached
            return self._show(self.low, fmt)
        return f"{self._show(self.low, fmt)}–{self._show(self.high, fmt)}"

    def text(self, fmt: str = "{:.4g}") -> str:
        """The median and range, median (low–high); a dash where no run has the figure."""
        if not self.applies:
            return "–"
        if self.low == self.high:
            return self._show(self.median, fmt)
        return f"{self._show(self.median, fmt)} ({self.range_text(fmt)})"


# --- the suite -----------------------------------------------------------------------------


@dataclass
class RunRecord:
    configuration: str
    seed: int
    overrides: dict[str, dict[str, Any]]
    records: Records
    error: str | None = None


@dataclass
class WorkloadResult:
    workload: Workload
    configurations: list[Configuration]
    goals: list[Target]
    at: int  # examples of the equal-examples comparison
    figures: dict[str, dict[str, Spread]]  # configuration name -> figure -> spread
    median_runs: dict[str, Records]  # configuration name -> the median run's evaluations
    steps: int  # of the workload's batch
    eval_every: int

    def caption(self) -> str:
        workload = self.workload
        goals = ", ".join(
            goal.label if goal.fixed else f"{goal.label} = {workload.format(goal.value)}"
            for goal in self.goals
        )
        return (
            f"{workload.describe}; {self.steps} steps of {workload.batch} "
            f"({self.steps * workload.batch:,} examples), evaluated every {self.eval_every} "
            f"steps; targets: {goals}"
        )


def train_all(confs: Sequence[Configuration], settings: Settings, root: Path) -> list[RunRecord]:
    """Every configuration `settings.repeats` times, seed by seed, in one Ray session."""
    runs = []
    with session():
        for seed in range(settings.repeats):
            for conf in confs:
                raw = raw_config(conf, settings, seed, root)
                run = RunRecord(conf.name, seed, conf.sections, [])
                try:
                    run.records = fit_metrics(raw)
                except Exception as error:  # a failed run is named in the notes, not fatal
                    run.error = f"{type(error).__name__}: {error}".splitlines()[0]
                runs.append(run)
    return runs


def analyse(
    confs: Sequence[Configuration], runs: Sequence[RunRecord], settings: Settings
) -> list[WorkloadResult]:
    """Each workload's targets, figures (median and spread per configuration) and the
    median run of each configuration (by final metric), from the runs' metrics lines."""
    results = []
    for workload in WORKLOADS:
        mine = [conf for conf in confs if conf.workload == workload]
        if not mine:
            continue
        evals = {
            conf.name: [
                evaluations(run.records, workload.metric)
                for run in runs
                if run.configuration == conf.name and not run.error
            ]
            for conf in mine
        }
        finals = {name: [e[-1][workload.metric] for e in es if e] for name, es in evals.items()}
        goals = targets(workload, finals)
        at = equal_examples(workload, settings)
        figures: dict[str, dict[str, Spread]] = {}
        medians: dict[str, Records] = {}
        for conf in mine:
            good = [r.records for r in runs if r.configuration == conf.name and not r.error]
            if not good:
                continue
            per_run = [run_figures(records, workload, goals, at) for records in good]
            censored = {key for goal in goals for key in target_keys(goal)}
            figures[conf.name] = {
                key: Spread.of([f[key] for f in per_run], censored=key in censored)
                for key in per_run[0]
            }
            ranked = sorted(
                (e for e in evals[conf.name] if e), key=lambda e: e[-1][workload.metric]
            )
            if ranked:
                medians[conf.name] = ranked[(len(ranked) - 1) // 2]
        steps = settings.steps or workload.steps
        every = settings.eval_every or workload.eval_every
        results.append(WorkloadResult(workload, mine, goals, at, figures, medians, steps, every))
    return results


def _columns(result: WorkloadResult) -> list[tuple[str, str, str, str, Better]]:
    """(key, name, unit, number format, better) of each figure of `result`'s workload."""
    workload = result.workload
    metric = workload.metric.replace("_", " ")
    fmt = "{:.2%}" if workload.metric == "test_accuracy" else "{:.4f}"
    columns: list[tuple[str, str, str, str, Better]] = [
        ("final", f"final {metric}", workload.unit, fmt, workload.better),
        ("at_equal", f"{metric} at {result.at:,} examples", workload.unit, fmt, workload.better),
    ]
    for goal in result.goals:
        shown = goal.label if goal.fixed else f"{goal.label} ({workload.format(goal.value)})"
        time_key, examples_key = target_keys(goal)
        columns += [
            (time_key, f"s to {shown}", "s", "{:.1f}", "lower"),
            (examples_key, f"examples to {shown}", "examples", "{:,.0f}", "lower"),
        ]
    columns += [
        ("wall_s", "wall s", "s", "{:.1f}", "lower"),
        ("bytes_per_example", "bytes sent+received / example", "bytes", "{:,.0f}", "lower"),
        ("staleness_mean", "staleness mean", "updates", "{:.2f}", "lower"),
        ("staleness_max", "staleness max", "updates", "{:.3g}", "lower"),
    ]
    return columns


def rows_of(result: WorkloadResult) -> list[Row]:
    """The suite's rows for one workload: each figure's median (NaN: not reached), the
    runs and their range in the name; figures no run has are left out."""
    rows = []
    for conf in result.configurations:
        figures = result.figures.get(conf.name, {})
        for key, name, unit, fmt, better in _columns(result):
            spread = figures.get(key)
            if spread is None or not spread.applies:
                continue
            value = float("nan") if spread.median is None else spread.median
            shown = fmt.replace("%", "").replace(",", "")  # plain numbers in a row's name
            label = f"median of {spread.runs}, range {spread.range_text(shown)}"
            rows.append(Row(f"{conf.name}: {name} ({label})", value, unit, better))
    return rows


def markdown(result: WorkloadResult) -> str:
    """A Markdown table of `result`: a line per configuration, each figure's median (min–max)."""
    columns = _columns(result)
    lines = [
        f"### {result.workload.name}",
        "",
        f'{result.caption()}. Each cell: the median of the runs (min–max); "not reached": '
        "by the run's end.",
        "",
        "| configuration | " + " | ".join(name for _, name, *_ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for conf in result.configurations:
        figures = result.figures.get(conf.name)
        if not figures:
            lines.append(f"| {conf.label} |" + " failed |" * len(columns))
            continue
        cells = [figures[key].text(fmt) if key in figures else "–" for key, _, _, fmt, _ in columns]
        lines.append(f"| {conf.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Sequence[WorkloadResult], out: Path) -> None:
    """Per workload, the median run of each configuration: its test metric against wall
    time (left) and against examples (right), the targets as grey lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        max(1, len(results)), 2, figsize=(16, 5.5 * max(1, len(results))), squeeze=False
    )
    styles = {"single": ":", "sync": "--", "downpour": "-", "diloco": "-."}
    for (left, right), result in zip(axes, results, strict=False):
        workload = result.workload
        colors = matplotlib.colormaps["tab20"]
        for i, conf in enumerate(result.configurations):
            evals = result.median_runs.get(conf.name)
            if not evals:
                continue
            style = styles.get(conf.label.split(" ")[0], "-")
            ys = [r[workload.metric] for r in evals]
            for ax, x in ((left, "time_s"), (right, "examples")):
                ax.plot([r[x] for r in evals], ys, style, color=colors(i % 20), label=conf.label)
        for ax, xlabel in ((left, "wall time (s)"), (right, "examples")):
            for goal, style in zip(result.goals, (":", "-."), strict=False):
                ax.axhline(
                    goal.value, color="gray", ls=style, lw=0.8, label=f"target: {goal.label}"
                )
            ax.set_xlabel(xlabel)
            ax.set_ylabel(workload.metric.replace("_", " "))
            ax.set_title(f"{workload.name}: median run of each configuration", fontsize=9)
            ax.grid(alpha=0.3)
        values = [r[workload.metric] for e in result.median_runs.values() for r in e]
        if workload.metric == "test_accuracy" and values and max(values) > 0.95:
            for ax in (left, right):  # the last points apart: from 90% up
                ax.set_ylim(max(0.9, min(values)), min(1.0, max(values) + 0.005))
        right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write(results: Sequence[WorkloadResult], runs: Sequence[RunRecord], png: Path) -> None:
    """The figure at `png`, the Markdown tables and the runs beside it (same stem)."""
    plot(results, png)
    stem = png.name.removesuffix(".png")  # "async" or "async.contended"
    tables = "\n".join(markdown(result) for result in results)
    png.with_name(f"{stem}.md").write_text(tables)
    document = [
        {
            "configuration": r.configuration,
            "seed": r.seed,
            "overrides": r.overrides,
            "error": r.error,
            "records": r.records,
        }
        for r in runs
    ]
    png.with_name(f"{stem}.runs.json").write_text(json.dumps(document) + "\n")


def measure(settings: Settings, root: Path) -> tuple[list[WorkloadResult], list[RunRecord]]:
    """Train the selected configurations and analyse their runs."""
    confs = selected([c for w in WORKLOADS for c in configurations(w)], settings.only)
    if not confs:
        names = ", ".join(c.name for w in WORKLOADS for c in configurations(w))
        raise UserError(
            f"SCALEOUT_BENCH_ASYNC_ONLY={','.join(settings.only)} selects none of: {names}"
        )
    for workload in {conf.workload for conf in confs}:
        if not workload.config.exists():
            raise FileNotFoundError(
                f"{workload.config} not found: "
                "run `python -m benchmarks async` from the repository root"
            )
    runs = train_all(confs, settings, root)
    return analyse(confs, runs, settings), runs


def notes_of(
    results: Sequence[WorkloadResult], runs: Sequence[RunRecord], settings: Settings
) -> list[str]:
    notes = [
        f"{settings.repeats} run(s) per configuration (seeds 0..{settings.repeats - 1}), "
        "seed by seed; figures are medians with (min–max) spreads; 'not reached' counts "
        "as later than any time.",
        "DiLoCo rows: each replica on sync's per-worker batch (half) for twice the steps, "
        "evaluations at the same examples; outer optimizer in the row's name (DILOCO).",
    ]
    if settings.only:
        notes.append(f"subset: SCALEOUT_BENCH_ASYNC_ONLY={','.join(settings.only)}")
    notes += [f"{result.workload.name}: {result.caption()}" for result in results]
    notes += [f"failed: {r.configuration} seed {r.seed}: {r.error}" for r in runs if r.error]
    return notes


def results(settings: Settings | None = None, root: Path | None = None) -> SuiteResult:
    """The suite's rows, notes and writer for `settings` (default: the environment's)."""
    settings = settings or Settings()
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        workloads, runs = measure(settings, root or Path(tmp))
    rows = [row for result in workloads for row in rows_of(result)]
    return SuiteResult(
        rows,
        plot=lambda png: write(workloads, runs, png),
        notes=notes_of(workloads, runs, settings),
    )


@register_suite("async", "which asynchrony: sync, Downpour rules, bounded staleness, DiLoCo")
def run() -> SuiteResult:
    return results()
