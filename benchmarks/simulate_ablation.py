"""The simulator's correction terms, each removed in turn (suite `simulate`'s ablation).

Beyond processor sharing of cores and links, the engine charges calibrated corrections:
each is a cost the simple model missed on a real run. A term earns its place when pricing
the held-out runs without it raises the suite's mean absolute error by at least `KEEP_PP`
percentage points; the others are candidates for deletion, decided by backward elimination
(`eliminate`) so that terms covering one effect are not all deleted for covering it
together. Removing a term means pricing with its neutral value in a copy of the
calibration, so the engine and the cases stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from scaleout.sim.calibration import Calibration

KEEP_PP = 1.0  # a term that moves the mean error by less is not worth its code
MEAN_TARGET, WORST_TARGET = 7.0, 20.0  # the suite's % absolute error of examples/s


def _models(update: dict[str, object]) -> Callable[[Calibration], Calibration]:
    def remove(calibration: Calibration) -> Calibration:
        models = {k: m.model_copy(update=update) for k, m in calibration.models.items()}
        return calibration.model_copy(update={"models": models})

    return remove


def _lockstep(update: dict[str, object]) -> Callable[[Calibration], Calibration]:
    def remove(calibration: Calibration) -> Calibration:
        lockstep = {k: c.model_copy(update=update) for k, c in calibration.lockstep.items()}
        return calibration.model_copy(update={"lockstep": lockstep})

    return remove


def _no_extra(calibration: Calibration) -> Calibration:
    lockstep = {
        kind: cost.model_copy(
            update={"extra_s": [[0.0] * len(cost.gaps_s) for _ in cost.measured_bytes]}
            | {"extra_core_s": []}
        )
        for kind, cost in calibration.lockstep.items()
    }
    return calibration.model_copy(update={"lockstep": lockstep})


# term -> the calibration without it (its neutral value)
TERMS: dict[str, Callable[[Calibration], Calibration]] = {
    # processes computing at once slow each other beyond sharing the cores
    "slowdown": _models({"concurrent_s": {}}),
    # a step needs more CPU while calls to a shard run beside it
    "beside calls": _models({"beside_calls": 1.0}),
    # computing jobs lose wall time when a call starts, with a core idle
    "call wait": _models({"call_wait_s": 0.0}),
    # ... and with every core computing (None: the idle-core wait stands)
    "busy-call wait": _models({"call_wait_busy_s": None}),
    # a collective or a shard call costs more after compute than back to back
    "after-compute extra": _no_extra,
    # each hop of a call waits for a core when every core is busy
    "hop wait": _lockstep({"hop_wait_s": []}),
    # cores the machine's own background keeps busy
    "idle cores": lambda c: c.model_copy(update={"idle_cores": 0.0}),
}


def without(terms: str | Sequence[str], path: Path, out_dir: Path) -> Path:
    """The calibration at `path` without `terms` (one, or several together), saved beside
    the others in `out_dir`."""
    names = [terms] if isinstance(terms, str) else list(terms)
    removed = Calibration.load(path)
    for name in names:
        removed = TERMS[name](removed)
    out = out_dir / f"{path.stem}.without_{'+'.join(n.replace(' ', '_') for n in names)}.json"
    return removed.save(out)


def verdict(full_error: float, without_error: float) -> str:
    """'keep' when removing the term raises the mean error by at least `KEEP_PP`; a term
    whose removal lowers it does harm, and goes too."""
    return "keep" if without_error - full_error >= KEEP_PP else "delete"


@dataclass(frozen=True)
class Elimination:
    """One step of `eliminate`: `term` removed, the mean error before and after."""

    term: str
    before: float
    after: float


def eliminate(
    terms: Sequence[str], mean_without: Callable[[list[str]], float]
) -> list[Elimination]:
    """Backward elimination: remove the term whose removal raises the mean error least (given
    those removed before it), while that rise is under `KEEP_PP`. Terms that model one
    effect each look redundant alone (removing one, the others still cover it); removed
    one at a time, the last of them shows what the effect is worth. `mean_without(removed)`
    prices the suite with `removed` taken out."""
    removed: list[str] = []
    current = mean_without([])
    steps: list[Elimination] = []
    while len(removed) < len(terms):
        means = {t: mean_without([*removed, t]) for t in terms if t not in removed}
        term = min(means, key=lambda t: means[t])
        if verdict(current, means[term]) == "keep":
            break
        steps.append(Elimination(term, current, means[term]))
        removed.append(term)
        current = means[term]
    return steps
