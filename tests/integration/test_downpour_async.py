"""Asynchrony that converges, end to end: the staleness bound with one replica slowed, DiLoCo
against hand-computed outer steps and against strategy single, the threads default, and the
one-line refusals."""

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from scaleout.checkpoint import load_checkpoint
from scaleout.metrics import read_metrics
from scaleout.rundir import RunDir
from scaleout.strategies.downpour.pushes import PUSHES_FILE
from scaleout.strategies.downpour.staleness_plot import STALENESS_PLOT
from tests.integration.test_downpour import driver, write_config


def slow_down(run, replica: int, stop: threading.Event) -> threading.Thread:
    """Hold replica `replica` stopped 0.15 s of every 0.2 s (SIGSTOP / SIGCONT)."""

    def cycle():
        while run.strategy.step < 10 and not stop.is_set():
            time.sleep(0.02)
        pid = run.strategy.replicas[replica].pid()
        while not stop.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.15)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # the run ended and its replicas with it
                return
            time.sleep(0.05)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    return thread


def slowed_run(tmp_path, name: str, *overrides: str) -> list[dict]:
    path = write_config(tmp_path, name, replicas=3, warmstart=0, steps=150, eval_every=150)
    run = driver(path, "downpour.n_fetch=1", "downpour.n_push=1", *overrides)
    stop = threading.Event()
    slow_down(run, 2, stop)
    try:
        result = run.train()
    finally:
        stop.set()
    assert result.step == 150 and result.summary["replica_failures"] == 0
    return read_metrics(run.run_dir.path / PUSHES_FILE)


@pytest.mark.slow
def test_no_applied_push_is_staler_than_max_staleness_with_a_replica_slowed(ray_session, tmp_path):
    free = slowed_run(tmp_path, "free")
    assert max(p["staleness_max"] for p in free) > 2  # the slowed replica's pushes are stale
    bounded = slowed_run(tmp_path, "bounded", "downpour.max_staleness=2")
    assert max(p["staleness_max"] for p in bounded) <= 2
    assert {p["replica"] for p in bounded} == {0, 1, 2}
    assert sum(p["wait_s"] for p in bounded) > 0  # the fast ones waited for it


def test_max_staleness_trains_records_waits_and_draws_staleness(ray_session, tmp_path):
    path = write_config(tmp_path, "bounded", warmstart=0, steps=200, eval_every=200)
    run = driver(path, "downpour.max_staleness=1", "downpour.staleness_rule='inverse'")
    result = run.train()
    assert result.step == 200 and result.summary["final_test_accuracy"] > 0.85
    pushes = read_metrics(run.run_dir.path / PUSHES_FILE)
    assert max(p["staleness_max"] for p in pushes) <= 1
    assert all("wait_s" in p and 0 < p["rule_scale"] <= 1 for p in pushes)
    assert (run.run_dir.path / STALENESS_PLOT).stat().st_size > 0
    records = read_metrics(run.run_dir.metrics)
    assert all(r["staleness_max"] <= 1 for r in records if "staleness_max" in r)


def test_diloco_with_one_replica_and_plain_outer_sgd_is_strategy_single(ray_session, tmp_path):
    """Outer SGD at rate 1 on the pseudo-gradient (fetched - local) puts the shards at the
    replica's own parameters: one DiLoCo replica is strategy single, step for step (to
    float rounding: w - (w - w_local) is not w_local bit for bit)."""
    path = write_config(tmp_path, "one", replicas=1, warmstart=0, steps=40, eval_every=20)
    common = ["downpour.n_fetch=4", "downpour.n_push=4", "train.optimizer=adam", "train.lr=0.002"]
    diloco = driver(
        path,
        *common,
        "downpour.mode=diloco",
        "downpour.outer_optimizer=sgd",
        "downpour.outer_lr=1.0",
    ).train()
    single = driver(path, *common, "train.strategy=single", "run.name=single").train()
    ours, _ = load_checkpoint(RunDir(diloco.run_dir).checkpoints.latest())
    reference, _ = load_checkpoint(RunDir(single.run_dir).checkpoints.latest())
    weights = [k for k in reference if k.startswith("model.")]
    for key in weights:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-4, atol=1e-5)
    assert abs(diloco.final_test_accuracy - single.final_test_accuracy) < 0.005


@pytest.mark.slow
def test_diloco_stopped_and_resumed_takes_the_steps_of_an_uninterrupted_run(ray_session, tmp_path):
    """The replicas' own optimizer state is in the checkpoint: a DiLoCo run stopped and
    resumed takes the steps the same run takes without a stop (one replica, outer SGD at
    rate 1, Adam, whose fresh state's first steps are far larger than a trained one's)."""
    common = [
        "downpour.n_fetch=4",
        "downpour.n_push=4",
        "downpour.mode=diloco",
        "downpour.outer_optimizer=sgd",
        "downpour.outer_lr=1.0",
        "train.optimizer=adam",
        "train.lr=0.002",
    ]
    fields = dict(replicas=1, warmstart=0, eval_every=20, checkpoint_every=20)
    whole = driver(write_config(tmp_path, "whole", steps=40, **fields), *common).train()
    path = write_config(tmp_path, "halves", steps=20, **fields)
    driver(path, *common).train()
    resumed = driver(path, *common, "train.steps=40", resume=True).train()
    assert resumed.step == 40
    ours, _ = load_checkpoint(RunDir(resumed.run_dir).checkpoints.latest())
    reference, _ = load_checkpoint(RunDir(whole.run_dir).checkpoints.latest())
    for key in [k for k in reference if k.startswith(("model.", "optim."))]:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-4, atol=1e-5)


def test_diloco_pushes_once_per_h_steps_and_trains(ray_session, tmp_path):
    path = write_config(tmp_path, "diloco", warmstart=0, steps=160, eval_every=160)
    h = 8
    run = driver(path, f"downpour.n_fetch={h}", f"downpour.n_push={h}", "downpour.mode=diloco")
    result = run.train()
    assert result.step == 160 and result.summary["final_test_accuracy"] > 0.8
    pushes = read_metrics(run.run_dir.path / PUSHES_FILE)
    assert len(pushes) == 160 // h and {p["steps"] for p in pushes} == {h}
    assert {p["replica"] for p in pushes} == {0, 1}


@pytest.mark.slow
def test_diloco_replica_killed_restarts_with_a_live_replicas_optimizer(ray_session, tmp_path):
    """A restarted replica starts from the shards' parameters and a live replica's
    optimizer state, and the run completes."""
    path = write_config(tmp_path, "diloco", warmstart=0, steps=400, eval_every=400)
    run = driver(path, "downpour.n_fetch=4", "downpour.n_push=4", "downpour.mode=diloco")
    thread_started = threading.Event()

    def kill():
        while run.strategy.step < 120:
            time.sleep(0.05)
        os.kill(run.strategy.replicas[1].pid(), signal.SIGKILL)
        thread_started.set()

    threading.Thread(target=kill, daemon=True).start()
    result = run.train()
    assert thread_started.is_set()
    assert result.step == 400 and result.summary["replica_restarts"] == 1
    assert result.summary["final_test_accuracy"] > 0.8


def test_one_replica_at_its_defaults_is_strategy_single_on_the_lm(ray_session, tmp_path):
    """examples/char_lm.toml (shrunk): AdamW, cosine schedule with warm-up, clipping, tied
    embeddings. One Downpour replica at the defaults (n_fetch = n_push = 1, threads off)
    ends where strategy single ends."""
    tiny = [
        "model.kwargs={block = 16, width = 32, layers = 1, heads = 2}",
        "data.kwargs={block = 16, max_chars = 40000, test_chars = 4096}",
        "train.steps=30",
        "train.warmup_steps=5",
        "train.eval_every=30",
        "train.checkpoint_every=30",
        f"run.out_dir='{tmp_path}'",
        "downpour.num_replicas=1",
    ]
    runs = {}
    for strategy in ("single", "downpour"):
        run = driver(
            Path("examples/char_lm.toml"),
            *tiny,
            f"train.strategy={strategy}",
            f"run.name={strategy}",
        )
        runs[strategy] = run.train()
    ours, _ = load_checkpoint(RunDir(runs["downpour"].run_dir).checkpoints.latest())
    reference, _ = load_checkpoint(RunDir(runs["single"].run_dir).checkpoints.latest())
    weights = [k for k in reference if k.startswith("model.")]
    assert weights
    for key in weights:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-6)
    losses = [runs[s].summary["final_test_loss"] for s in ("downpour", "single")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


@pytest.mark.slow
def test_dc_and_gap_rules_train(ray_session, tmp_path):
    for rule in ("dc", "gap"):  # 100 steps ended at 79.9-83% (a run's own asynchrony)
        path = write_config(tmp_path, rule, warmstart=0, steps=200, eval_every=200)
        run = driver(path, f"downpour.staleness_rule={rule}")
        result = run.train()
        assert result.summary["final_test_accuracy"] > 0.8, rule
        pushes = read_metrics(run.run_dir.path / PUSHES_FILE)
        assert any(p["staleness"] > 0 for p in pushes)
        assert np.isfinite([p["rule_scale"] for p in pushes]).all()
