"""The simulator's ablation: each term's removal is its neutral value, and the verdict
follows the mean error it moves, computed here by hand."""

from pathlib import Path

import pytest

from benchmarks.simulate import Case, Outcome
from benchmarks.simulate_ablation import KEEP_PP, TERMS, eliminate, verdict, without
from benchmarks.simulate_pricing import ablation
from scaleout.sim.calibration import Calibration, LockstepCost, MessageCost, ModelCost


def _calibration() -> Calibration:
    calls = LockstepCost(
        measured_bytes=[1_000, 1_000_000],
        gaps_s=[0.005, 0.02],
        extra_s=[[1e-4, 2e-4], [3e-4, 4e-4]],
        extra_core_s=[[1e-4, 1e-4], [2e-4, 2e-4]],
        hop_wait_s=[1e-4, 5e-4],
    )
    model = ModelCost(
        num_parameters=1000,
        batch_size=32,
        train_s={1: 1e-3, 2: 6e-4},
        concurrent_s={1: 1e-3, 2: 1.2e-3},
        eval_s=1e-4,
        beside_calls=1.1,
        call_wait_s=2e-4,
        call_wait_busy_s=2e-3,
    )
    message = MessageCost(fixed_s=1e-4, bytes_per_s=1e9)
    return Calibration(
        cores=2,
        pull=message,
        push=message,
        models={"m": model},
        lockstep={"shard_calls": calls},
        idle_cores=0.1,
    )


def test_each_term_is_removed_and_nothing_else(tmp_path: Path):
    full = _calibration()
    path = full.save(tmp_path / "full.json")
    removed = {term: Calibration.load(without(term, path, tmp_path)) for term in TERMS}
    model = {term: c.models["m"] for term, c in removed.items()}
    calls = {term: c.lockstep["shard_calls"] for term, c in removed.items()}
    assert model["slowdown"].slowdown(2) == 1.0 < full.models["m"].slowdown(2)
    assert model["beside calls"].beside_calls == 1.0
    assert model["call wait"].call_wait_s == 0.0 and model["call wait"].call_wait_busy_s == 2e-3
    assert model["busy-call wait"].call_wait_busy_s is None
    assert calls["after-compute extra"].extra(0.01, 10_000) == 0.0
    assert calls["after-compute extra"].hop_wait(10_000) > 0  # the hops' wait stays
    assert calls["hop wait"].hop_wait(10_000) == 0.0 and calls["hop wait"].extra(0.01, 1e4) > 0
    assert removed["idle cores"].idle_cores == 0.0
    for term, calibration in removed.items():  # every other field as it was
        changed = {k for k, v in calibration.model_dump().items() if v != full.model_dump()[k]}
        assert changed, term
        assert changed <= {"models", "lockstep", "idle_cores"}, term


def test_verdict_keeps_what_moves_the_mean_by_a_point():
    assert verdict(5.0, 5.0 + KEEP_PP) == "keep"
    assert verdict(5.0, 5.0 + KEEP_PP / 2) == "delete"
    assert verdict(5.0, 5.0 - KEEP_PP) == "delete"  # the model is better without it


def test_ablation_rows_are_the_mean_error_without_each_term():
    case = Case("c", "mnist_downpour.toml")
    terms = list(TERMS)
    # measured 100 ex/s; with every term 104 and 96 (4% each); without the first term 90
    # and 110 (10% each): +6 pp, kept; without the others 104.5 and 96 (4.25%): deleted
    outcomes = [
        Outcome(case, [100.0] * 3, [p, p], p, ablated={t: q for t in terms})
        for p, q in ((104.0, 104.5), (96.0, 96.0))
    ]
    outcomes[0].ablated[terms[0]] = 90.0
    outcomes[1].ablated[terms[0]] = 110.0
    rows, notes = ablation(outcomes)
    assert [r.value for r in rows] == pytest.approx([10.0] + [4.25] * (len(terms) - 1))
    assert rows[0].name.endswith("(keep)") and all(r.name.endswith("(delete)") for r in rows[1:])
    assert "+6.0 pp" in notes[0]


def test_several_terms_are_removed_together(tmp_path: Path):
    path = _calibration().save(tmp_path / "full.json")
    both = Calibration.load(without(["slowdown", "idle cores"], path, tmp_path))
    assert both.models["m"].slowdown(2) == 1.0 and both.idle_cores == 0.0
    assert both.models["m"].beside_calls == 1.1  # a term not named stays


def test_elimination_keeps_one_of_two_terms_that_cover_one_effect():
    """a and b model one effect: either alone covers it (removing one costs 0.2 pp), both
    gone cost 2 pp; c does harm (its removal lowers the error); d is worth 3 pp. Removed one
    at a time, least costly first: c, then a; then b's removal would cost 1.8 pp: stop."""

    def mean_without(removed: list[str]) -> float:
        gone = set(removed)
        effect = 2.0 if {"a", "b"} <= gone else 0.2 if gone & {"a", "b"} else 0.0
        return 5.0 + effect - 0.5 * ("c" in gone) + 3.0 * ("d" in gone)

    steps = eliminate(["a", "b", "c", "d"], mean_without)
    assert [s.term for s in steps] == ["c", "a"]
    assert [(s.before, s.after) for s in steps] == [(5.0, 4.5), (4.5, 4.7)]


def test_kept_inputs_price_the_runs_again(tmp_path, monkeypatch):
    """A run's figures and calibrations, kept, give the same pricing again without a run."""
    from benchmarks import simulate as suite
    from benchmarks.simulate import CASES, reprice
    from benchmarks.simulate_pricing import keep_inputs

    before = _calibration().save(tmp_path / "0_before.json")
    after = _calibration().save(tmp_path / "0_after.json")
    outcome = Outcome(
        CASES[0], [100.0, 90.0, 110.0], [105.0, 105.0], 105.0, priced_by=[before, after]
    )
    keep_inputs([outcome], {}, tmp_path / "kept")
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [
        "0_after.json",
        "0_before.json",
        "inputs.json",
    ]
    priced = []

    def simulate_case(case, root, calibration, networks):
        priced.append(calibration.name)
        return {"examples_per_s": 105.0}

    monkeypatch.setattr(suite, "simulate_case", simulate_case)
    rows, notes = reprice(tmp_path / "kept")
    assert rows[0].name == "mean absolute error" and rows[0].value == pytest.approx(5.0)
    assert {"0_before.json", "0_after.json"} <= set(priced)  # the kept calibrations price it
    assert notes[-1].startswith("elimination keeps no term")  # no term moves anything here
