"""The examples as a user runs them: the Fashion-MNIST CNN with BatchNorm through
`scaleout.fit` with single, downpour (2 replicas, 2 shards) and sync (2 workers), and through
TOML factory keys; a user's own Ray-actor loop on the parameter server. One epoch each (the
full runs, 3 epochs, reach 89-90%; see the README)."""

import subprocess
import sys
from pathlib import Path

import pytest

import scaleout
from examples import fashion_cnn
from scaleout.cli import main
from scaleout.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]

SHORT = ["train.epochs=1", "train.eval_every=469", "train.checkpoint_every=100000"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "downpour", "sync"])
def test_fashion_cnn_reaches_85_percent_in_one_epoch(tmp_path, monkeypatch, strategy):
    monkeypatch.chdir(REPO)  # Ray's workers import `examples` from the working directory
    result = scaleout.fit(
        fashion_cnn.CONFIG,
        model=fashion_cnn.build_model,
        data=fashion_cnn.build_data,
        overrides=[*SHORT, f'train.strategy="{strategy}"', f'run.out_dir="{tmp_path}"'],
    )
    assert result.final_test_accuracy >= 0.85, result.summary
    assert result.steps == 60_000 // 64  # one pass; a last partial batch is dropped


@pytest.mark.slow
def test_fashion_cnn_from_toml_factories(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    overrides = [*SHORT, 'train.strategy="downpour"', f'run.out_dir="{tmp_path}"']
    argv = ["train", "examples/fashion_cnn.toml"] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 0
    evals = [r for r in read_metrics(tmp_path / "fashion_cnn_toml" / "metrics.jsonl")]
    assert evals[-1]["test_accuracy"] >= 0.85


@pytest.mark.slow
def test_own_loop_on_the_parameter_server(tmp_path):
    """examples/own_loop_downpour.py: the user's loop in Ray actors, scaleout's shards and
    client; it trains (the script checks its own accuracy and prints it)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "own_loop_downpour.py"), "--steps", "150"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(proc.stdout.split("test accuracy")[-1].split("%")[0])
    assert accuracy >= 85.0, proc.stdout


def test_char_lm_from_toml_reports_token_accuracy_and_perplexity(tmp_path, monkeypatch):
    """examples/char_lm.toml as a user runs it (shortened): AdamW, cosine schedule,
    clipping and two micro-batches a step; the run logs the lr it scheduled, the gradient
    norm, token accuracy and perplexity."""
    monkeypatch.chdir(REPO)
    overrides = [
        f'run.out_dir="{tmp_path}"',
        "train.steps=30",
        "train.warmup_steps=5",
        "train.eval_every=15",
        "train.log_every=5",
        "train.accumulate_steps=2",
        "data.kwargs={block = 64, max_chars = 200000}",
    ]
    argv = ["train", "examples/char_lm.toml"] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 0
    records = read_metrics(tmp_path / "char_lm_toml" / "metrics.jsonl")
    assert {"lr", "grad_norm"} <= records[0].keys()
    assert records[-1]["lr"] < records[0]["lr"] <= 3e-3
    last = records[-1]
    assert last["test_loss"] < records[2]["test_loss"] < 4.85  # below chance (ln 128)
    assert 0.1 < last["test_accuracy"] < 1
    assert last["test_perplexity"] == pytest.approx(2.718281828 ** last["test_loss"], rel=1e-6)
