"""SIGTERM (what Kubernetes, Slurm and spot instances send before they take a node) as a
user's `scaleout train` meets it: each strategy stops at its next safe point, checkpoints the
step it reached (Downpour and Sandblaster: their shards too), exits with 143, and `--resume`
finishes the run (the handler's second signal and grace period: tests/unit/test_interrupt.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaleout.checkpoint import load_checkpoint
from scaleout.metrics import read_metrics
from scaleout.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
SHORT = ["train.log_every=5", "train.eval_every=100000", "train.checkpoint_every=100000"]
# per strategy: its config, the overrides of a short run, and its total steps
RUNS = {
    "single": (
        "mnist_single",
        ["model.sizes=[784, 64, 10]", "model.dropout=0.0", "train.steps=400"],
        400,
    ),
    "sync": (
        "mnist_sync",
        ["model.sizes=[784, 64, 10]", "model.dropout=0.0", "train.steps=300"],
        300,
    ),
    "downpour": (
        "mnist_downpour",
        ["model.sizes=[784, 64, 10]", "model.dropout=0.0", "train.steps=600"],
        600,
    ),
    "sandblaster": ("mnist_sandblaster", ["sandblaster.max_iterations=60"], 60),
}


def start(config: str, out: Path, *overrides: str, resume: bool = False) -> subprocess.Popen:
    flags = ["--resume"] if resume else []
    sets = [arg for o in [*SHORT, 'run.device="cpu"', *overrides] for arg in ("--set", o)]
    return subprocess.Popen(
        [sys.executable, "-m", "scaleout", "train", f"configs/{config}.toml", "--out", str(out)]
        + flags
        + sets,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_steps(run: RunDir, proc: subprocess.Popen, at_least: int) -> None:
    """Until the run has logged `at_least` steps (it is training, past its start)."""
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.communicate()
        lines = read_metrics(run.metrics) if run.metrics.exists() else []
        if lines and lines[-1]["step"] >= at_least:
            return
        assert time.monotonic() < deadline, "the run logged no step in 180 s"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.parametrize(
    "strategy",
    [
        "single",
        pytest.param("sync", marks=pytest.mark.slow),
        pytest.param("downpour", marks=pytest.mark.slow),
        pytest.param("sandblaster", marks=pytest.mark.slow),
    ],
)
def test_sigterm_checkpoints_the_step_it_stopped_at_and_resume_finishes(tmp_path, strategy):
    config, overrides, total = RUNS[strategy]
    run = RunDir(tmp_path / config)
    proc = start(config, tmp_path, *overrides)
    wait_for_steps(run, proc, 10)
    proc.send_signal(signal.SIGTERM)
    _, stderr = finish(proc)
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr
    stopped = int(stderr.split("stopped by SIGTERM at step ")[1].split(":")[0])
    assert 10 <= stopped < total  # stopped part-way, not at the end
    _, meta = load_checkpoint(run.checkpoints.latest())
    assert meta["step"] == stopped  # the step it stopped at, not an earlier periodic one
    assert read_metrics(run.metrics)[-1]["step"] == stopped

    resumed = start(config, tmp_path, *overrides, resume=True)
    _, stderr = finish(resumed)
    assert resumed.returncode == 0, stderr
    steps = [line["step"] for line in read_metrics(run.metrics)]
    assert steps == sorted(set(steps)) and steps[-1] == total
