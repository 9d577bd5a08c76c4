"""Sandblaster L-BFGS: shard-side two-loop recursion against a numpy reference, the convex
problem against scipy's L-BFGS-B, exactly-once counting with backup tasks and with a replica
killed mid-batch, and a restarted coordinator."""

import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest
import ray
import scipy.optimize

from scaleout.api import prepare
from scaleout.data import load_image_idx
from scaleout.errors import UserError
from scaleout.metrics import read_metrics
from scaleout.ps import shard_ranges
from scaleout.ps.vectors import VectorShard
from scaleout.rundir import RunDir
from scaleout.strategies.sandblaster.lbfgs import LbfgsState, LocalVectors, ShardedVectors, two_loop
from tests.run_config import config_file


def sandblaster(tmp_path, name="sb", *overrides, resume=False, **fields):
    v = dict(num_train=2000, replicas=2, portion=200, iterations=8)
    v.update(fields)
    path = config_file(
        tmp_path,
        name,
        run={"seed": 0, "num_threads": 1},
        data={
            "dataset": "mnist",
            "normalize": False,
            "num_train": v["num_train"],
            "num_test": 1000,
        },
        model={"kind": "mlp", "sizes": [784, 10]},
        train={
            "strategy": "sandblaster",
            "eval_every": 1000,
            "log_every": 1,
            "checkpoint_every": 1000,
        },
        sandblaster={
            "num_replicas": v["replicas"],
            "num_shards": 2,
            "history": 10,
            "portion_size": v["portion"],
            "push_every": 2,
            "max_iterations": v["iterations"],
            "l2": 1e-4,
            "dtype": "float64",
            "tolerance_change": 1e-12,
        },
    )
    return prepare(path, overrides=list(overrides), resume=resume, overwrite=not resume)


def objectives(run: RunDir) -> list[float]:
    return [r["loss"] for r in read_metrics(run.metrics)]


# --- the two-loop recursion on shards -------------------------------------------------------


def numpy_direction(g, pairs):
    """Nocedal & Wright algorithm 7.4, written directly on arrays."""
    q, alphas = g.copy(), []
    for s, y in reversed(pairs):
        alpha = (s @ q) / (s @ y)
        alphas.append(alpha)
        q -= alpha * y
    s, y = pairs[-1]
    q *= (s @ y) / (y @ y)
    for (s, y), alpha in zip(pairs, reversed(alphas), strict=True):
        q += (alpha - (y @ q) / (s @ y)) * s
    return -q


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_two_loop_on_shards_equals_reference(ray_session, num_shards):
    rng = np.random.default_rng(num_shards)
    n, m = 101, 4
    g = rng.standard_normal(n)
    pairs = []
    for _ in range(6):  # more pairs than the ring holds: the oldest are overwritten
        s = rng.standard_normal(n)
        y = s * rng.uniform(0.5, 2.0, n) + 0.1 * rng.standard_normal(n)  # s'y > 0
        pairs.append((s, y))
    state = LbfgsState(history=m)
    local = LocalVectors(VectorShard(0, n))
    actor = ray.remote(VectorShard)
    ranges = shard_ranges(n, num_shards)
    shards = [actor.remote(i, b - a) for i, (a, b) in enumerate(ranges)]
    sharded = ShardedVectors(shards)
    vectors = {"g": g}
    local.shard.initialize(vectors)
    ray.get(
        [sh.initialize.remote({"g": g[a:b]}) for sh, (a, b) in zip(shards, ranges, strict=True)]
    )
    for s, y in pairs:
        state.newest = (state.newest + 1) % m
        for space, split in ((local, [(0, n)]), (sharded, ranges)):
            blocks = {"s_new": s, "y_new": y}
            if space is local:
                local.shard.initialize(blocks)
            else:
                ray.get(
                    [
                        sh.initialize.remote({k: v[a:b] for k, v in blocks.items()})
                        for sh, (a, b) in zip(shards, split, strict=True)
                    ]
                )
            space.run([("push_history", "s_new", "y_new", state.newest)])
        state.rho[state.newest] = 1 / (s @ y)
        state.gamma = (s @ y) / (y @ y)
        state.num_pairs = min(state.num_pairs + 1, m)
    slope_local = two_loop(local, state)
    slope_sharded = two_loop(sharded, state)
    d_local = local.shard.vectors["d"].numpy()
    d_sharded = np.concatenate(ray.get([sh.pull.remote("d") for sh in shards]))
    expected = numpy_direction(g, pairs[-m:])
    np.testing.assert_allclose(d_local, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(d_sharded, expected, rtol=1e-12, atol=1e-12)
    assert slope_sharded == pytest.approx(g @ expected, rel=1e-12) == slope_local
    for sh in shards:
        ray.kill(sh)


# --- the convex problem -----------------------------------------------------------------------


def scipy_softmax_regression(num_train: int, l2: float) -> float:
    data = load_image_idx("mnist", "train", normalize=False).subset(num_train)
    x = data.x.reshape(num_train, -1).double().numpy()  # (N, 784)
    labels = data.y.numpy()
    onehot = np.eye(10)[labels]

    def objective(w):
        weights, bias = w[:7840].reshape(10, 784), w[7840:]
        logits = x @ weights.T + bias
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        f = -(onehot * logp).sum() / num_train + l2 * (weights**2).sum()
        delta = (np.exp(logp) - onehot) / num_train  # (N, 10)
        grad = np.concatenate([(delta.T @ x + 2 * l2 * weights).ravel(), delta.sum(axis=0)])
        return f, grad

    w0 = np.zeros(7850)
    result = scipy.optimize.minimize(
        objective,
        w0,
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-9},
    )
    return float(result.fun)


@pytest.mark.slow
def test_convex_objective_matches_scipy_and_decreases(ray_session, tmp_path):
    run = sandblaster(
        tmp_path,
        "sb",
        "sandblaster.tolerance_grad=1e-7",
        iterations=1000,
        num_train=1000,
        portion=250,
    )
    result = run.train()
    expected = scipy_softmax_regression(1000, 1e-4)
    assert result.summary["final_objective"] == pytest.approx(expected, rel=1e-6)
    trajectory = objectives(run.run_dir)
    assert all(b <= a for a, b in zip(trajectory, trajectory[1:], strict=False))


# --- load balancing and failures ----------------------------------------------------------------


@pytest.mark.slow
def test_backup_tasks_count_every_example_once(ray_session, tmp_path):
    """A 4x straggler with backup tasks: duplicates are dropped, the result is unchanged."""
    plain = sandblaster(tmp_path, "plain", "sandblaster.backup_tasks=false")
    plain.train()
    backed = sandblaster(
        tmp_path,
        "backup",
        "sandblaster.straggler_replica=1",
        "sandblaster.straggler_factor=4",
        replicas=3,
    )
    result = backed.train()
    assert result.summary["duplicates_dropped"] > 0
    np.testing.assert_allclose(objectives(backed.run_dir), objectives(plain.run_dir), rtol=1e-10)
    records = read_metrics(backed.run_dir.metrics)
    # every objective evaluation counted the 2000 examples exactly once
    assert records[-1]["examples"] == 2000 * records[-1]["evaluations"]


def assert_killed_replica_changes_nothing(run, reference, batch: int, replica: int) -> None:
    """SIGKILL `replica` once the coordinator is at `batch`: one failure, and the objective
    at every iteration equals the uninterrupted `reference` run's."""

    def kill_once():
        while run.strategy.batch_id < batch:
            time.sleep(0.005)
        os.kill(ray.get(run.strategy.replicas[replica].pid.remote()), signal.SIGKILL)

    threading.Thread(target=kill_once, daemon=True).start()
    result = run.train()
    assert result.summary["replica_failures"] == 1
    np.testing.assert_allclose(objectives(run.run_dir), objectives(reference.run_dir), rtol=1e-10)


@pytest.mark.slow
def test_replica_killed_mid_batch_changes_nothing(ray_session, tmp_path):
    reference = sandblaster(tmp_path, "reference", replicas=3)
    reference.train()
    run = sandblaster(tmp_path, "killed", replicas=3, portion=50)
    assert_killed_replica_changes_nothing(run, reference, batch=4, replica=2)


@pytest.mark.slow
def test_restarted_coordinator_resumes_from_the_shards(ray_session, tmp_path, capsys):
    straight = sandblaster(tmp_path, "straight", iterations=8)
    straight.train()
    first = sandblaster(tmp_path, "split", iterations=4)
    first.train()  # the coordinator ends; x, g and the history stay in the shards' files
    resumed = sandblaster(tmp_path, "split", resume=True, iterations=8)
    result = resumed.train()
    assert result.step == 8 and "at step 4" in capsys.readouterr().err
    np.testing.assert_allclose(objectives(resumed.run_dir), objectives(straight.run_dir), rtol=1e-9)


@pytest.mark.slow
def test_resume_from_the_newest_snapshot_every_shard_holds(ray_session, tmp_path, capsys):
    """A shard killed while saving snapshot k leaves the others at k: the run resumes from
    k - 1, which every shard holds, and goes on exactly as an uninterrupted run."""
    straight = sandblaster(tmp_path, "straight", iterations=8)
    straight.train()
    sandblaster(tmp_path, "split", iterations=4).train()
    shard_dir = tmp_path / "runs" / "split" / "shards" / "shard_1"
    newest = max(shard_dir.glob("step_*.json"))
    newest.unlink()  # shard 1's newest snapshot never committed
    resumed = sandblaster(tmp_path, "split", resume=True, iterations=8)
    result = resumed.train()
    assert result.step == 8 and "iteration 3 (snapshot 3)" in capsys.readouterr().err
    np.testing.assert_allclose(objectives(resumed.run_dir), objectives(straight.run_dir), rtol=1e-9)


@pytest.mark.slow
def test_resume_without_shard_snapshots_is_one_line(ray_session, tmp_path):
    sandblaster(tmp_path, "gone", iterations=2).train()
    shutil.rmtree(tmp_path / "runs" / "gone" / "shards")
    with pytest.raises(UserError, match="no L-BFGS snapshot in common"):
        sandblaster(tmp_path, "gone", resume=True, iterations=4).train()


@pytest.mark.slow
def test_the_only_replica_killed_mid_batch_is_restarted(ray_session, tmp_path):
    """One replica: while it computes the batch's only running portion it dies; the
    coordinator restarts it and hands the portion out again (it used to wait on nothing)."""
    reference = sandblaster(tmp_path, "reference", replicas=1, iterations=4)
    reference.train()
    run = sandblaster(tmp_path, "killed", replicas=1, iterations=4, portion=100)
    assert_killed_replica_changes_nothing(run, reference, batch=3, replica=0)


@pytest.mark.slow
def test_a_silent_replica_is_treated_as_failed_after_timeout_s(ray_session, tmp_path, stopped_pids):
    """A replica stopped (SIGSTOP: alive, never answering) while it holds a portion: after
    sandblaster.timeout_s the coordinator kills it and hands its portions to others, and
    the objective at every iteration is the uninterrupted run's."""
    reference = sandblaster(tmp_path, "reference", replicas=2, iterations=4)
    reference.train()
    run = sandblaster(tmp_path, "silent", "sandblaster.timeout_s=5", replicas=2, iterations=4)

    def stop_once():
        while run.strategy.batch_id < 3:
            time.sleep(0.005)
        stopped_pids.append(ray.get(run.strategy.replicas[1].pid.remote()))
        os.kill(stopped_pids[0], signal.SIGSTOP)

    threading.Thread(target=stop_once, daemon=True).start()
    result = run.train()
    assert result.summary["replica_failures"] == 1
    failure = run.strategy.failures[0]
    assert failure["replica"] == 1 and "sandblaster.timeout_s" in failure["message"]
    np.testing.assert_allclose(objectives(run.run_dir), objectives(reference.run_dir), rtol=1e-10)
