"""Single-worker training: against a hand-written loop, convergence, resume, kill and Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scaleout.checkpoint import load_checkpoint
from scaleout.metrics import read_metrics
from scaleout.rundir import RunDir
from tests.unit.test_train import final_tensors, train, write_config


def start(path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "scaleout", "train", str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_checkpoint(run: RunDir, proc: subprocess.Popen, at_least: int) -> None:
    deadline = time.monotonic() + 120
    while not any(step >= at_least for step in run.checkpoints.steps()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


LONG = dict(num_train=4096, sizes=[784, 512, 10], steps=2000, checkpoint_every=50, eval_every=500)


@pytest.mark.slow
def test_sigkill_then_resume_continues_from_last_checkpoint(tmp_path):
    path = write_config(tmp_path, **LONG)
    run = RunDir(tmp_path / "runs" / "t")
    proc = start(path)
    try:
        wait_for_checkpoint(run, proc, 100)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    killed_at = run.checkpoints.steps()[-1]
    assert killed_at < 2000, "the run finished before it was killed"
    done = subprocess.run(
        [sys.executable, "-m", "scaleout", "train", str(path), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert f"resumed {run.path} at step {killed_at}" in done.stderr.replace("\n", " ")
    steps = [r["step"] for r in read_metrics(run.metrics)]
    assert steps == sorted(set(steps)) and steps[-1] == 2000
    # The killed-and-resumed run ends exactly where an uninterrupted run ends.
    _, reference = train(write_config(tmp_path, name="reference", **LONG))
    a, b = final_tensors(run), final_tensors(reference)
    for name in a:
        if name.startswith(("model.", "optim.")):
            assert torch.equal(a[name], b[name]), name


def test_ctrl_c_saves_a_valid_checkpoint(tmp_path):
    path = write_config(tmp_path, **LONG)
    run = RunDir(tmp_path / "runs" / "t")
    proc = start(path)
    try:
        wait_for_checkpoint(run, proc, 50)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert "interrupted at step" in stderr and "Traceback" not in stderr
    tensors, meta = load_checkpoint(run.checkpoints.latest())
    assert 50 <= meta["step"] < 2000
    assert read_metrics(run.metrics)[-1]["step"] == meta["step"]


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_workers_give_the_same_run(tmp_path, workers):
    path = write_config(tmp_path, name=f"w{workers}", steps=12)
    _, run = train(path, f"loader.workers={workers}")
    _, reference = train(write_config(tmp_path, name="ref", steps=12))
    a, b = final_tensors(run), final_tensors(reference)
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("model."))
