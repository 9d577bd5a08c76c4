"""The `scaleout` verbs: info, report, bench, --help."""

import json
from pathlib import Path

import pytest

from scaleout import bench
from scaleout.bench import Row, SuiteResult, quiet, register_suite
from scaleout.cli import main
from scaleout.metrics import MetricsLog

REPO = Path(__file__).resolve().parents[1]


def test_info_mlp_exact_count(capsys):
    assert main(["info", str(REPO / "configs" / "mnist_single.toml")]) == 0
    out = capsys.readouterr().out
    assert "parameters: 1,863,690 (1.86M)" in out
    assert "803,840" in out and "1,049,600" in out and "10,250" in out  # per layer
    assert "FLOPs per example: forward 3.72M" in out  # 2 * 1,861,632 multiply-adds
    assert "memory for optimizer state: 7.11 MiB" in out  # RMSProp: one buffer


def test_info_speech_dnn_is_42m(capsys):
    assert main(["info", str(REPO / "configs" / "speech_dnn.toml")]) == 0
    out = capsys.readouterr().out
    assert "parameters: 41,777,152 (41.8M)" in out


@pytest.mark.parametrize("verb", [[], ["train"], ["info"], ["report"], ["bench"]])
def test_help_everywhere(verb, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*verb, "--help"])
    assert exit_info.value.code == 0
    assert "usage: scaleout" in capsys.readouterr().out


def test_report_draws_plot_and_summary(tmp_path, capsys):
    run_dir = tmp_path / "r"
    with MetricsLog(run_dir / "metrics.jsonl") as log:
        for step in range(1, 5):
            record = {
                "time_s": step * 0.5,
                "step": step,
                "examples": 10 * step,
                "loss": 1.0 / step,
                "lr": 0.1,
            }
            if step % 2 == 0:
                record["test_accuracy"] = 0.5 + step / 10
            log.log(record)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "final test accuracy │ 90.00%" in out and "best at step        │ 4" in out
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_bench_writes_result_schema(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(quiet, "check", lambda: quiet.MachineCheck(2.0, 0.2, 0.2, (2.0,)))

    @register_suite("toy", "a suite for this test")
    def toy():
        return SuiteResult(
            [
                Row("latency", 2.0, "ms", "lower", paper=3.0, target=2.5),
                Row("throughput", 10.0, "items/s", "higher", target=20.0),
                Row("ratio", 1.5, "x", "higher"),
            ]
        )

    try:
        assert main(["bench", "toy", "--out", str(tmp_path)]) == 0
    finally:
        bench.SUITES.pop("toy")
    document = json.loads((tmp_path / "toy.json").read_text())
    assert document["suite"] == "toy"
    assert set(document["machine"]) == {"cpu", "cores", "torch", "checks"}
    assert not document["contended"] and len(document["machine"]["checks"]) == 2
    assert [r["meets"] for r in document["rows"]] == [True, False, None]
    assert set(document["rows"][0]) == {
        "name",
        "value",
        "unit",
        "paper",
        "target",
        "better",
        "meets",
    }
    assert (tmp_path / "toy.png").stat().st_size > 5_000
    assert "<= 2.5" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    assert "single" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_single_runs(tmp_path):
    assert main(["bench", "single", "--out", str(tmp_path)]) == 0
    # A busy CI machine makes the run contended: it is then written beside, not as, single.json.
    (written,) = [p for p in tmp_path.glob("single*.json")]
    rows = json.loads(written.read_text())["rows"]
    assert all(row["value"] > 0 for row in rows)
