"""Strategy "model_parallel" end to end: Ray actors on a grid train the autoencoder greedily,
and the run is the single-process run (strategy "single", the reference) to fp32 tolerance:
the same logged objective, the same checkpointed weights, and checkpoints that resume under
either strategy."""

import os
import signal
import time

import pytest
import torch

from scaleout.api import prepare
from scaleout.checkpoint import load_checkpoint
from scaleout.cli import main
from scaleout.errors import ConfigError
from scaleout.metrics import read_metrics
from scaleout.rundir import RunDir
from scaleout.train import driver
from tests.run_config import config_file
from tests.stop_when import stop_when


def write_config(tmp_path, name, strategy, grid=(1, 2), **sections):
    return config_file(
        tmp_path,
        name,
        run={"seed": 3},
        data={
            "dataset": "patches",
            "patch_size": 16,
            "num_train": 192,
            "num_test": 64,
            "images": ["camera", "grass"],
        },
        model={
            "kind": "sparse_autoencoder",
            "in_channels": 1,
            "in_size": 16,
            "num_stacks": 2,
            "field": [6, 4],
            "step": 2,
            "block": [2, 2, 4],
            "pool_size": 3,
        },
        train={
            "strategy": strategy,
            "steps": 6,
            "batch_size": 32,
            "optimizer": "momentum",
            "lr": 0.005,
            "eval_every": 3,
            "log_every": 2,
            "checkpoint_every": 3,
        },
        model_parallel={"grid": list(grid)},
        **sections,
    )


def weights(run_path):
    tensors, meta = load_checkpoint(RunDir(run_path).checkpoints.latest())
    return {k: v for k, v in tensors.items() if k.startswith(("model.", "optim."))}, meta


def assert_same_run(ours, theirs):
    mine, meta = weights(ours)
    reference, _ = weights(theirs)
    assert set(mine) == set(reference) and meta["step"] == 12
    for key, value in reference.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single")
    assert main(["train", str(write_config(tmp_path, "single", "single"))]) == 0
    return tmp_path / "runs" / "single"


def test_grid_run_equals_single_process_run(tmp_path, single_run, ray_session):
    """A 1 x 2 grid: every logged objective (train and test) and the final weights and
    momentum buffers equal strategy "single"'s; filters.png is drawn from the whole replica."""
    assert main(["train", str(write_config(tmp_path, "grid", "model_parallel"))]) == 0
    run = tmp_path / "runs" / "grid"
    ours, theirs = read_metrics(run / "metrics.jsonl"), read_metrics(single_run / "metrics.jsonl")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [2, 3, 4, 6, 8, 9, 10, 12]
    for mine, reference in zip(ours, theirs, strict=True):
        for key in ("loss", "reconstruction", "sparsity", "alpha", "test_loss"):
            if key in reference:
                assert mine[key] == pytest.approx(reference[key], rel=1e-5), (mine["step"], key)
    assert_same_run(run, single_run)
    assert (run / "filters.png").is_file() and (run / "objective.png").is_file()


def test_resume_across_strategies_and_grids(tmp_path, single_run, ray_session, monkeypatch):
    """Stopped mid-stack-1 on a 2 x 1 grid (as Ctrl-C would), resumed in one process: the run
    ends with exactly the uninterrupted run's weights and optimizer state."""

    first = prepare(write_config(tmp_path, "moved", "model_parallel", grid=(2, 1)))
    monkeypatch.setattr(driver, "StopOnInterrupt", stop_when(lambda: first.strategy.step >= 2))
    result = first.train()
    assert result.interrupted and result.step == 2
    monkeypatch.undo()
    second = prepare(tmp_path / "moved.toml", overrides=['train.strategy="single"'], resume=True)
    result = second.train()
    assert result.step == 12 and not result.interrupted
    assert_same_run(tmp_path / "runs" / "moved", single_run)


def test_worker_killed_mid_run_restarts_the_grid_from_its_checkpoint(
    tmp_path, single_run, ray_session, monkeypatch
):
    """Grid worker 1 SIGKILLed right after the checkpoint at step 3: the driver starts the
    grid again from it, and the run ends with the single-process run's weights."""
    run = prepare(write_config(tmp_path, "restart", "model_parallel"), overwrite=True)
    write = driver.Driver._write_checkpoint
    killed: list[int] = []

    def write_then_kill(self, record):
        write(self, record)
        if not killed:
            killed.append(self.strategy.workers.group.pids[1])
            os.kill(killed[0], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # gone (and reaped) before training goes on
                try:
                    os.kill(killed[0], 0)
                except ProcessLookupError:
                    break
                time.sleep(0.01)

    monkeypatch.setattr(driver.Driver, "_write_checkpoint", write_then_kill)
    result = run.train()
    assert result.summary["restarts"] == 1
    assert 0 <= result.summary["steps_redone"] <= 2  # the chunk that was under way
    assert_same_run(tmp_path / "runs" / "restart", single_run)


def test_model_parallel_needs_an_autoencoder(tmp_path):
    path = write_config(tmp_path, "mlp", "model_parallel")
    mlp = ["model={kind = 'mlp', sizes = [256, 2]}"]
    with pytest.raises(ConfigError, match='model.kind = "sparse_autoencoder"'):
        prepare(path, overrides=mlp)
    assert not (tmp_path / "runs" / "mlp").exists()  # refused before anything was written


def downpour_config(tmp_path, name, num_replicas):
    return write_config(
        tmp_path,
        name,
        "downpour",
        downpour={"num_replicas": num_replicas, "num_shards": 2, "n_fetch": 1, "n_push": 1},
    )


@pytest.mark.slow
def test_one_grid_as_the_only_downpour_replica_equals_single(tmp_path, single_run, ray_session):
    """Downpour with one replica that is a 1 x 2 grid, fetching and pushing every step: each
    worker's shards apply its own filters' updates (in order: a shard runs one caller's calls
    in turn), so the run is strategy "single"'s, weights and logged objective alike."""
    assert main(["train", str(downpour_config(tmp_path, "dp1", 1))]) == 0
    run = tmp_path / "runs" / "dp1"
    ours, theirs = read_metrics(run / "metrics.jsonl"), read_metrics(single_run / "metrics.jsonl")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        for key in ("loss", "test_loss"):
            if key in reference:
                assert mine[key] == pytest.approx(reference[key], rel=1e-4), (mine["step"], key)
    mine, meta = weights(run)
    reference, _ = weights(single_run)
    assert meta["strategy"] == "downpour"
    for key, value in reference.items():
        if key.startswith("model."):
            torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow
def test_two_grid_replicas_train_through_their_shards(tmp_path, ray_session):
    """Two 1 x 2 grids: every worker pushes every step to its own shards; the objective falls.
    Steps are global (a minibatch on either replica): 6 per stack, 12 in all, each worker of
    the replica that took a step pushes once for it."""
    result = prepare(downpour_config(tmp_path, "dp2", 2)).train()
    assert result.step == 12
    records = read_metrics(tmp_path / "runs" / "dp2" / "metrics.jsonl")
    first_stack = [r["loss"] for r in records if r["stack"] == 1]
    assert first_stack[-1] < first_stack[0]
    assert records[-1]["examples"] == 12 * 32  # both replicas' minibatches
    pushes = read_metrics(tmp_path / "runs" / "dp2" / "pushes.jsonl")
    assert len(pushes) == 2 * 12  # 2 workers per replica, one push per step
    assert {(p["replica"], p["worker"]) for p in pushes} == {(r, w) for r in (0, 1) for w in (0, 1)}


@pytest.mark.slow
def test_shipped_config_converges_like_the_single_process_run(tmp_path, ray_session):
    """configs/autoencoder_model_parallel.toml (1 x 2 grid, natural-image patches), shortened
    to 300 steps per stack, against `--set train.strategy=single`: the objective falls the
    same way (every evaluation within 0.1%; they differ only by fp32 summation order)."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "configs" / "autoencoder_model_parallel.toml"
    common = ["--set", "train.steps=300", "--set", "train.eval_every=100"]
    common += ["--set", f'run.out_dir="{tmp_path}"']
    assert main(["train", str(shipped), *common, "--set", 'run.name="grid"']) == 0
    single = ["--set", 'train.strategy="single"', "--set", 'run.name="single"']
    assert main(["train", str(shipped), *common, *single]) == 0
    grid = [r for r in read_metrics(tmp_path / "grid" / "metrics.jsonl") if "test_loss" in r]
    ref = [r for r in read_metrics(tmp_path / "single" / "metrics.jsonl") if "test_loss" in r]
    assert [r["step"] for r in grid] == [r["step"] for r in ref] == list(range(100, 901, 100))
    for mine, reference in zip(grid, ref, strict=True):
        assert mine["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-3)
    per_stack = {r["stack"]: r["test_loss"] for r in ref if r["step"] % 300 == 100}
    ends = {r["stack"]: r["test_loss"] for r in ref if r["step"] % 300 == 0}
    assert all(ends[k] < per_stack[k] for k in ends)  # each stack learns
