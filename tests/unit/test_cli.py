"""The `scaleout` verbs: info, report, --help."""

from pathlib import Path

import pytest

from scaleout.cli import main
from scaleout.metrics import MetricsLog

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("verb", [[], ["train"], ["info"], ["report"], ["calibrate"], ["simulate"]])
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
