"""The simulate suite's correction terms priced away: each alone (`ablation`), then by
backward elimination (`elimination`) over the same held-out runs, re-simulated with the
calibrations that priced them. A run keeps those calibrations and its measured figures
(`keep_inputs`), so the pricing can be done again without running anything:

    python -m benchmarks.simulate [results/simulate_inputs]
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import Row
from benchmarks.simulate_ablation import (
    MEAN_TARGET,
    TERMS,
    WORST_TARGET,
    eliminate,
    verdict,
    without,
)

if TYPE_CHECKING:
    from benchmarks.simulate import Outcome

INPUTS_FILE = "inputs.json"  # in a run's kept inputs: each case's figures and calibrations
# prices a case's run with one calibration: (outcome, calibration file) -> examples/s
Price = Callable[["Outcome", Path], float]


def ablation(outcomes: list[Outcome]) -> tuple[list[Row], list[str]]:
    """Per correction term, the suite's mean absolute error with the term removed, and
    whether it moves the mean enough to keep."""
    full = statistics.mean(abs(o.error()) for o in outcomes)
    rows, notes = [], []
    for term in TERMS:
        if not all(term in o.ablated for o in outcomes):
            continue
        mean = statistics.mean(abs(o.error(o.ablated[term])) for o in outcomes)
        worst = max(abs(o.error(o.ablated[term])) for o in outcomes)
        decision = verdict(full, mean)
        rows.append(Row(f"mean absolute error without {term} ({decision})", mean, "%", "lower"))
        notes.append(
            f"without {term}: mean |error| {mean:.1f}% ({mean - full:+.1f} pp against "
            f"{full:.1f}% with every term), worst {worst:.1f}%: {decision}"
        )
    return rows, notes


class Pricing:
    """The outcomes simulated again with sets of terms removed, each set priced once."""

    def __init__(self, outcomes: list[Outcome], price: Price) -> None:
        self.outcomes, self.price = outcomes, price
        self.cache: dict[frozenset[str], list[float]] = {
            frozenset(): [o.simulated for o in outcomes]
        }
        for term in TERMS:
            if all(term in o.ablated for o in outcomes):
                self.cache[frozenset([term])] = [o.ablated[term] for o in outcomes]
        self._scratch = Path(tempfile.mkdtemp(prefix="pricing-"))

    def simulated(self, removed: list[str]) -> list[float]:
        key = frozenset(removed)
        if key not in self.cache:
            self.cache[key] = [
                statistics.mean(
                    self.price(o, without(sorted(key), path, self._scratch)) for path in o.priced_by
                )
                for o in self.outcomes
            ]
        return self.cache[key]

    def errors(self, removed: list[str]) -> list[float]:
        return [
            abs(o.error(v)) for o, v in zip(self.outcomes, self.simulated(removed), strict=True)
        ]

    def mean(self, removed: list[str]) -> float:
        return statistics.mean(self.errors(removed))


def elimination(pricing: Pricing) -> tuple[list[Row], list[str]]:
    """Backward elimination of the terms (`simulate_ablation.eliminate`): a row per term
    deleted, then the suite's mean and worst error with all of them removed (the simulator
    as it is after their deletion, on the same runs)."""
    steps = eliminate(list(TERMS), pricing.mean)
    rows, notes = [], []
    for step in steps:
        rows.append(
            Row(f"mean absolute error, {step.term} deleted in turn", step.after, "%", "lower")
        )
        notes.append(
            f"elimination: without {step.term} as well, mean |error| {step.after:.1f}% "
            f"({step.after - step.before:+.1f} pp)"
        )
    deleted = [step.term for step in steps]
    kept = [t for t in TERMS if t not in deleted]
    if deleted:
        errors = pricing.errors(deleted)
        what = ", ".join(deleted)
        rows += [
            Row(
                f"mean absolute error without {what}",
                statistics.mean(errors),
                "%",
                "lower",
                target=MEAN_TARGET,
            ),
            Row(
                f"worst absolute error without {what}",
                max(errors),
                "%",
                "lower",
                target=WORST_TARGET,
            ),
        ]
    notes.append(
        f"elimination keeps {', '.join(kept) or 'no term'}; deletes {', '.join(deleted) or 'none'}"
    )
    return rows, notes


def keep_inputs(outcomes: list[Outcome], networks: dict[str, dict[str, Any]], out: Path) -> None:
    """The runs' figures and the calibrations that priced them, in `out`: the pricing can
    be done again without running anything (`python -m benchmarks.simulate DIR`, `reprice`)."""
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for o in outcomes:
        names = []
        for path in o.priced_by:
            shutil.copy(path, out / path.name)
            names.append(path.name)
        cases.append({"name": o.case.name, "measured": o.measured, "priced_by": names})
    document = {"cases": cases, "networks": networks}
    (out / INPUTS_FILE).write_text(json.dumps(document, indent=1))
