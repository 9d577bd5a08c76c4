"""Benchmark suites: `python -m benchmarks SUITE` (or `make bench SUITE=...`).

Each suite measures figures side by side in one run (this machine is shared and noisy, so
only ratios taken together mean anything), and returns rows that the runner prints as a
table beside the papers' numbers, writes to `results/<suite>.json` and plots as a PNG.
Suites register themselves with `@register_suite`; later strategies add theirs.

Every suite runs between two checks of the machine (`benchmarks.quiet`: two
independent single-thread processes against one). When either finds another load, the
results are `contended`: written as `<suite>.contended.json` / `.png` beside the published
`<suite>.json`, which they do not replace. `SCALEOUT_BENCH_CHECK=0` skips the checks (the
results are then marked `unchecked` and written as contended ones).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from scaleout.errors import UserError


@dataclass
class Row:
    """One measured figure. `meets` is decided from `target` and `better`."""

    name: str
    value: float
    unit: str
    better: Literal["lower", "higher"]
    paper: float | None = None
    target: float | None = None

    @property
    def meets(self) -> bool | None:
        if self.target is None:
            return None
        return self.value <= self.target if self.better == "lower" else self.value >= self.target

    @classmethod
    def median_of(
        cls,
        name: str,
        samples: list[float],
        unit: str,
        better: Literal["lower", "higher"],
        paper: float | None = None,
    ) -> Row:
        """The median of repeated `samples`, their spread ((max - min) / median) in the name."""
        median = statistics.median(samples)
        spread = (max(samples) - min(samples)) / median
        return cls(f"{name} (spread {spread:.0%})", median, unit, better, paper)


@dataclass
class SuiteResult:
    rows: list[Row]
    plot: Callable[[Path], None] | None = None  # draws the suite's own figure to a PNG path
    notes: list[str] = field(default_factory=list)
    # the suite's own measurements found another load (a calibration inside it): written
    # as contended even when the machine checks around it were quiet
    contended: bool = False


@dataclass
class Suite:
    name: str
    description: str
    run: Callable[[], SuiteResult]


SUITES: dict[str, Suite] = {}


def register_suite(
    name: str, description: str
) -> Callable[[Callable[[], SuiteResult]], Callable[[], SuiteResult]]:
    def add(run: Callable[[], SuiteResult]) -> Callable[[], SuiteResult]:
        assert name not in SUITES, f"benchmark suite {name!r} registered twice"
        SUITES[name] = Suite(name, description, run)
        return run

    return add


def available_suites() -> dict[str, Suite]:
    """Every suite: each module of this package registers its own, imported on first use so
    that `--help` stays fast."""
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("_") or module.name == "tests":
            continue
        importlib.import_module(f"{__name__}.{module.name}")
    return SUITES


def machine() -> dict[str, object]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def _check() -> dict:
    """One machine check's record (`benchmarks.quiet`), taken once the machine is idle:
    a check right after a run would otherwise measure that run's processes still exiting
    (Ray's daemons, a large process freeing its memory), and report another load where
    there is none."""
    from benchmarks.quiet import check, wait_idle

    wait_idle()
    return check().record()


def find_suite(name: str) -> Suite:
    """Suite `name`, importing its own module first: a suite runs where only what it
    imports is installed (`gpu` on a GPU machine without Ray)."""
    try:
        importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
    suites = SUITES if name in SUITES else available_suites()  # a module of another name
    if name not in suites:
        raise UserError(f"no benchmark suite {name!r}; available: {', '.join(sorted(suites))}")
    return suites[name]


def run_suite(name: str, out_dir: Path) -> tuple[dict, Path, Path]:
    """Run suite `name` between two machine checks; write `<out_dir>/<name>.json` and
    `.png` (`<name>.contended.*` when a check found another load); return the document."""
    suite = find_suite(name)
    checked = os.environ.get("SCALEOUT_BENCH_CHECK", "1") != "0"
    before = _check() if checked else None
    result = suite.run()
    checks = [before, _check()] if checked else None
    quiet = checks is not None and all(c["quiet"] for c in checks) and not result.contended
    notes = list(result.notes)
    if checks is None:
        notes.insert(0, "unchecked: the machine was not checked (SCALEOUT_BENCH_CHECK=0)")
    elif not quiet and not result.contended:
        from benchmarks.quiet import QUIET_RATIO

        ratios = ", ".join(f"{c['ratio']:.2f}x" for c in checks)
        notes.insert(
            0,
            f"contended: 2 independent 1-thread processes ran {ratios} the work of one "
            f"(before, after; a quiet machine gives >= {QUIET_RATIO}x): another load was "
            "running, so these results are not published as ours",
        )
    document = {
        "suite": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "checks": checks},
        "contended": not quiet,
        "rows": [{**asdict(row), "meets": row.meets} for row in result.rows],
        "notes": notes,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = name if quiet else f"{name}.contended"
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    (result.plot or (lambda path: plot_rows(result.rows, path, name)))(png_path)
    return document, json_path, png_path


def one_axis(
    plot: Callable[[Any, Any], None],
    results: Any,  # noqa: ANN401 - each suite's own results
    size: tuple[float, float] = (8, 5),
) -> Callable[[Path], None]:
    """A suite's figure of one axis: `plot(results, ax)`, saved where `SuiteResult.plot`
    is asked to draw."""

    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=size)
        plot(results, ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    return draw


LABEL_WIDTH = 60  # characters of a row's name on one line of a figure


def plot_rows(rows: list[Row], out: Path, title: str) -> None:
    """Default figure: one horizontal bar per row, grouped by unit, paper values beside.
    Long row names wrap (a name wider than the figure would squeeze the bars to nothing)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = sorted({row.unit for row in rows})
    labels = {id(row): textwrap.fill(row.name, LABEL_WIDTH) for row in rows}
    lines = sum(label.count("\n") + 1 for label in labels.values())
    height = 1.2 + 0.3 * len(rows) + 0.2 * lines
    fig, axes = plt.subplots(len(units), 1, figsize=(9, height), squeeze=False)
    for ax, unit in zip(axes[:, 0], units, strict=True):
        group = [row for row in rows if row.unit == unit]
        ys = range(len(group))
        ax.barh(ys, [row.value for row in group], height=0.4, label="measured")
        papers = [(y, row.paper) for y, row in zip(ys, group, strict=True) if row.paper is not None]
        if papers:
            ax.barh([y + 0.4 for y, _ in papers], [p for _, p in papers], height=0.4, label="paper")
            ax.legend()
        ax.set_yticks(list(ys), [labels[id(row)] for row in group], fontsize=8)
        ax.set_xlabel(unit)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
