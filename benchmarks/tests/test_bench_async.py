"""Suite `async`: its figures from metrics lines (targets, equal examples, traffic,
staleness), medians with spreads, tables and the configurations it trains, on synthetic
records; and (slow) the whole suite end to end at a tiny length."""

import json
import math
from pathlib import Path

import pytest

from benchmarks import asynchrony
from benchmarks.asynchrony import (
    LM,
    MNIST,
    WORKLOADS,
    RunRecord,
    Settings,
    Spread,
    analyse,
    bytes_per_example,
    configurations,
    equal_examples,
    markdown,
    raw_config,
    reach,
    rows_of,
    selected,
    staleness,
    value_at,
    write,
)
from scaleout.api import config_from_dict

REPO = Path(__file__).resolve().parents[2]


def curve(losses, batch=32, every=50, seconds_per_eval=10.0, metric="test_loss", **extra):
    """Metrics lines: a training line half-way between evaluations, and an evaluation
    carrying `metric` every `every` steps."""
    records = []
    for i, value in enumerate(losses, start=1):
        step = i * every
        records.append(
            {"time_s": (i - 0.5) * seconds_per_eval, "step": step - every // 2,
             "examples": (step - every // 2) * batch, "loss": value + 0.1, **extra}
        )  # fmt: skip
        records.append(
            {"time_s": i * seconds_per_eval, "step": step, "examples": step * batch,
             "loss": value, metric: value, **extra}
        )  # fmt: skip
    return records


# --- figures of one run --------------------------------------------------------------------


def test_reach_is_the_first_evaluation_at_the_target_or_better():
    evals = [r for r in curve([2.0, 1.7, 1.55, 1.6, 1.4]) if "test_loss" in r]
    assert reach(evals, "test_loss", 1.6, "lower") == (30.0, 150 * 32)
    assert reach(evals, "test_loss", 1.55, "lower") == (30.0, 150 * 32)  # equal counts
    assert reach(evals, "test_loss", 1.0, "lower") is None
    accuracy = [{"time_s": t, "examples": e, "test_accuracy": a}
                for t, e, a in ((1.0, 10, 0.9), (2.0, 20, 0.971), (3.0, 30, 0.96))]  # fmt: skip
    assert reach(accuracy, "test_accuracy", 0.97, "higher") == (2.0, 20)
    assert reach(accuracy, "test_accuracy", 0.98, "higher") is None
    assert reach([], "test_loss", 1.6, "lower") is None


def test_value_at_equal_examples_exact_or_between_evaluations():
    evals = [r for r in curve([2.0, 1.8, 1.5]) if "test_loss" in r]  # 1600, 3200, 4800
    assert value_at(evals, "test_loss", 3200) == 1.8
    assert value_at(evals, "test_loss", 4800) == 1.5
    assert value_at(evals, "test_loss", 2400) == pytest.approx(1.9)
    assert value_at(evals, "test_loss", 100) is None  # before the first evaluation
    assert value_at(evals, "test_loss", 10_000) is None  # after the run
    assert value_at(evals[-1:], "test_loss", 4800) == 1.5


def test_bytes_per_example_sums_the_windows():
    records = curve([2.0, 1.8], bytes_sent=1000, bytes_received=3000)  # 4 windows, 3200 ex.
    assert bytes_per_example(records) == pytest.approx(4 * 4000 / 3200)
    assert bytes_per_example(curve([2.0, 1.8])) is None  # no parameter server


def test_staleness_is_weighted_by_the_windows_steps():
    records = [
        {"step": 10, "staleness_mean": 1.0, "staleness_max": 2},
        {"step": 40, "staleness_mean": 0.0, "staleness_max": 1},  # 30 steps
        {"step": 50, "staleness_mean": None, "staleness_max": 0},  # no push in the window
    ]
    mean, largest = staleness(records)
    assert mean == pytest.approx((1.0 * 10 + 0.0 * 30) / 40)
    assert largest == 2
    assert staleness(curve([2.0])) == (None, None)


# --- medians and spreads -------------------------------------------------------------------


def test_spread_median_and_range():
    spread = Spread.of([3.0, 1.0, 2.0])
    assert (spread.median, spread.low, spread.high, spread.runs) == (2.0, 1.0, 3.0, 3)
    assert spread.text("{:.1f}") == "2.0 (1.0–3.0)"
    assert Spread.of([1.0, 2.0]).median == 1.5
    assert Spread.of([1.5]).text() == "1.5"
    assert Spread.of([2.0, 2.0, 2.0]).text() == "2"
    # a figure the runs do not have (None, not censored) is left out, or absent
    assert Spread.of([None, 1.0, 3.0]).median == 2.0
    empty = Spread.of([None, None])
    assert not empty.applies and empty.text() == "–"


def test_spread_of_times_to_a_target_not_reached_by_some_runs():
    one_missed = Spread.of([10.0, None, 20.0], censored=True)
    assert one_missed.median == 20.0 and one_missed.low == 10.0 and one_missed.high is None
    assert one_missed.text("{:.0f}") == "20 (10–not reached)"
    most_missed = Spread.of([None, 5.0, None], censored=True)
    assert (
        most_missed.median is None and most_missed.text("{:.0f}") == "not reached (5–not reached)"
    )
    none_reached = Spread.of([None, None, None], censored=True)
    assert none_reached.applies and none_reached.text() == "not reached"
    assert Spread.of([4.0, None], censored=True).median is None  # even: the middle two


# --- configurations ------------------------------------------------------------------------


def test_every_workload_has_the_issues_configurations():
    for workload in WORKLOADS:
        confs = configurations(workload)
        labels = [c.label for c in confs]
        assert len(set(labels)) == len(labels) == 16
        assert labels[:3] == ["single 1 thread", "single 2 threads", "sync 2 workers"]
        for replicas in (1, 2):
            for rule in ("none", "inverse", "dc", "gap"):
                assert any(
                    label.startswith(f"downpour R={replicas} rule={rule}") for label in labels
                )
            assert f"downpour R={replicas} max_staleness=1" in labels
        diloco = [c for c in confs if c.label.startswith("diloco")]
        assert [c.sections["downpour"]["n_push"] for c in diloco] == [4, 8, 16]
        for conf in diloco:
            opts = conf.sections["downpour"]
            assert opts["mode"] == "diloco" and opts["n_fetch"] == opts["n_push"]
            expected = {"lm": "outer=sgd lr=1", "mnist": "outer=nesterov lr=0.7 momentum=0.9"}
            assert expected[workload.name] in conf.label


def test_diloco_outer_settings_per_h_are_named_in_the_row(monkeypatch):
    monkeypatch.setitem(asynchrony.DILOCO, "lm", {8: {"outer_lr": 0.5, "outer_optimizer": "sgd"}})
    (conf,) = [c for c in configurations(LM) if c.label.startswith("diloco")]
    assert conf.label == "diloco R=2 H=8 outer=sgd lr=0.5"
    assert conf.sections["downpour"]["outer_lr"] == 0.5


def test_selection_by_pattern_keeps_the_sync_reference():
    confs = [c for w in WORKLOADS for c in configurations(w)]
    assert selected(confs, []) == confs
    assert [c.name for c in selected(confs, ["lm"])] == [c.name for c in configurations(LM)]
    names = [c.name for c in selected(confs, ["*/diloco*H=4 *", "mnist/single 2 threads"])]
    assert names == [
        "lm/sync 2 workers",
        "lm/diloco R=2 H=4 outer=sgd lr=1",
        "mnist/single 2 threads",
        "mnist/sync 2 workers",
        "mnist/diloco R=2 H=4 outer=nesterov lr=0.7 momentum=0.9",
    ]
    assert selected(confs, ["nothing*"]) == []


def test_run_configs_are_valid_and_see_equal_examples(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    for workload in WORKLOADS:
        for settings in (Settings(repeats=1, only=[]), Settings(1, [], steps=8, eval_every=4)):
            points = set()
            for conf in configurations(workload):
                raw = raw_config(conf, settings, 2, tmp_path)
                config_from_dict(raw, source=conf.name)  # every key is the library's
                train = raw["train"]
                examples = train["steps"] * train["batch_size"]
                assert examples == (settings.steps or workload.steps) * workload.batch
                points.add(train["eval_every"] * train["batch_size"])
                assert train["checkpoint_every"] == train["steps"]
                assert train.get("warmup_steps") is None or train["warmup_steps"] < train["steps"]
                assert raw["run"]["seed"] == 2 and raw["run"]["out_dir"] == str(tmp_path)
                if conf.label.startswith("diloco"):
                    assert train["batch_size"] == workload.batch // 2  # sync's per worker
                    if workload is LM and settings.steps is None:
                        assert (train["steps"], train["warmup_steps"]) == (1200, 120)
            assert len(points) == 1  # evaluations at the same examples in every run
    # LM: 600 steps of 32; the comparison at the evaluation nearest half-way
    assert equal_examples(LM, Settings(1, [])) == 9600
    assert equal_examples(MNIST, Settings(1, [])) == 128 * 1200


# --- analysis, rows and tables -------------------------------------------------------------


def _runs():
    """Synthetic LM runs: sync (final 1.5 in each), single reaching sync's loss late, and a
    Downpour row with traffic and staleness that reaches 1.6 in only one of its runs."""
    runs = []
    for seed, shift in enumerate((0.0, 0.02, -0.02)):
        sync = curve([2.0, 1.7, 1.5 + shift, 1.5], seconds_per_eval=5.0)
        single = curve([2.1, 1.8, 1.6, 1.5 + shift], seconds_per_eval=8.0)
        down = curve([2.2, 1.9, 1.8, 1.65 + 5 * shift], seconds_per_eval=4.0,
                     bytes_sent=32_000, bytes_received=32_000, staleness_mean=1.0,
                     staleness_max=2 + seed)  # fmt: skip
        runs += [
            RunRecord("lm/sync 2 workers", seed, {}, sync),
            RunRecord("lm/single 1 thread", seed, {}, single),
            RunRecord("lm/downpour R=2 rule=gap", seed, {}, down),
        ]
    runs.append(RunRecord("lm/downpour R=2 rule=gap", 3, {}, [], error="RuntimeError: boom"))
    return runs


def test_analysis_rows_and_markdown_from_synthetic_runs(tmp_path):
    by_name = {c.name: c for c in configurations(LM)}
    confs = [by_name[n] for n in ("lm/single 1 thread", "lm/sync 2 workers",
                                  "lm/downpour R=2 rule=gap")]  # fmt: skip
    settings = Settings(repeats=3, only=[], steps=200, eval_every=50)
    (result,) = analyse(confs, _runs(), settings)
    assert [g.label for g in result.goals] == ["sync's final test loss", "test loss 1.6"]
    assert result.goals[0].value == 1.5 and not result.goals[0].fixed
    assert result.at == 3200  # step 100 of 32
    single = result.figures["lm/single 1 thread"]
    assert single["final"].median == 1.5 and single["final"].text("{:.2f}") == "1.50 (1.48–1.52)"
    assert single["at_equal"].median == 1.8
    assert single["time to sync's final test loss"].median == 32.0  # the last evaluation
    assert single["examples to test loss 1.6"].median == 150 * 32
    assert not single["bytes_per_example"].applies and not single["staleness_mean"].applies
    down = result.figures["lm/downpour R=2 rule=gap"]
    assert down["final"].runs == 3  # the failed run is left out
    assert down["bytes_per_example"].median == 80.0
    assert (down["staleness_mean"].median, down["staleness_max"].high) == (1.0, 4)
    reached = down["time to test loss 1.6"]  # only the run ending at 1.55 gets there
    assert reached.median is None and reached.low == 16.0 and reached.missing == 2
    assert result.median_runs["lm/sync 2 workers"][-1]["test_loss"] == 1.5

    rows = {row.name.split(" (median")[0]: row for row in rows_of(result)}
    assert rows["lm/single 1 thread: final test loss"].value == 1.5
    assert rows["lm/single 1 thread: final test loss"].better == "lower"
    assert math.isnan(rows["lm/downpour R=2 rule=gap: s to test loss 1.6"].value)
    assert "lm/single 1 thread: bytes sent+received / example" not in rows
    assert rows["lm/downpour R=2 rule=gap: staleness max"].unit == "updates"
    named = [r.name for r in rows_of(result) if "s to test loss 1.6" in r.name]
    assert (
        "lm/downpour R=2 rule=gap: s to test loss 1.6 (median of 3, range 16.0–not reached)"
        in named
    )

    table = markdown(result)
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| configuration"))
    assert "s to sync's final test loss (1.5000)" in header and "s to test loss 1.6" in header
    gap = next(line for line in lines if line.startswith("| downpour R=2 rule=gap"))
    assert "not reached (16.0–not reached)" in gap and "| 80 |" in gap  # bytes per example
    assert len({line.count("|") for line in lines if line.startswith("|")}) == 1

    png = tmp_path / "async.contended.png"
    write([result], _runs(), png)
    assert png.stat().st_size > 0
    assert (tmp_path / "async.contended.md").read_text() == table
    stored = json.loads((tmp_path / "async.contended.runs.json").read_text())
    assert len(stored) == 10 and stored[-1]["error"] == "RuntimeError: boom"


def test_mnist_targets_accuracy_and_a_configuration_without_runs():
    by_name = {c.name: c for c in configurations(MNIST)}
    confs = [by_name["mnist/sync 2 workers"], by_name["mnist/downpour R=1 rule=none"]]
    accuracy = curve([0.95, 0.972, 0.98], batch=128, every=100, metric="test_accuracy")
    runs = [RunRecord("mnist/sync 2 workers", 0, {}, accuracy)]
    (result,) = analyse(confs, runs, Settings(1, [], steps=300, eval_every=100))
    assert [g.label for g in result.goals] == ["test accuracy 0.97"]
    sync = result.figures["mnist/sync 2 workers"]
    assert sync["time to test accuracy 0.97"].median == 20.0
    assert sync["final"].text("{:.1%}") == "98.0%"
    table = markdown(result)
    assert "| downpour R=1 rule=none | failed |" in table
    rows = rows_of(result)
    assert rows and all(r.name.startswith("mnist/sync") for r in rows)
    final = next(r for r in rows if "final test accuracy" in r.name)
    assert final.better == "higher" and final.unit == "fraction"


# --- end to end ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_suite_end_to_end_at_a_tiny_length(monkeypatch, tmp_path):
    from benchmarks import run_suite

    monkeypatch.chdir(REPO)
    for name, value in {
        "SCALEOUT_BENCH_CHECK": "0",
        "SCALEOUT_BENCH_ASYNC_REPEATS": "1",
        "SCALEOUT_BENCH_ASYNC_STEPS": "8",
        "SCALEOUT_BENCH_ASYNC_EVAL_EVERY": "4",
        "SCALEOUT_BENCH_ASYNC_ONLY": "lm/downpour R=2 rule=gap,lm/diloco*H=4 *,"
        "mnist/downpour R=2 max_staleness=1",
    }.items():
        monkeypatch.setenv(name, value)
    document, json_path, png_path = run_suite("async", tmp_path)
    assert json_path == tmp_path / "async.contended.json"  # unchecked: never published
    assert not [note for note in document["notes"] if note.startswith("failed")]
    names = [row["name"] for row in document["rows"]]
    for conf in ("lm/sync 2 workers", "lm/downpour R=2 rule=gap", "lm/diloco R=2 H=4",
                 "mnist/sync 2 workers", "mnist/downpour R=2 max_staleness=1"):  # fmt: skip
        assert any(name.startswith(f"{conf}") and "final test" in name for name in names)
    by_name = {row["name"].split(" (median")[0]: row for row in document["rows"]}
    assert by_name["lm/downpour R=2 rule=gap: bytes sent+received / example"]["value"] > 0
    assert 0 < by_name["mnist/sync 2 workers: final test accuracy"]["value"] <= 1
    assert png_path.stat().st_size > 0
    table = (tmp_path / "async.contended.md").read_text()
    assert "### lm" in table and "### mnist" in table and "| diloco R=2 H=4" in table
    runs = json.loads((tmp_path / "async.contended.runs.json").read_text())
    assert len(runs) == 5 and all(run["records"] for run in runs)
