"""Downpour SGD on Ray: training, records, warm start, killed replicas and shards, resume,
and no process left behind."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from scaleout.api import Run, prepare
from scaleout.checkpoint import load_checkpoint
from scaleout.errors import UserError
from scaleout.metrics import read_metrics
from scaleout.rundir import RunDir
from scaleout.runtime import connect
from scaleout.strategies.downpour.pushes import PUSHES_FILE
from tests.run_config import config_file


def write_config(tmp_path: Path, name: str = "dp", **fields) -> Path:
    v = dict(
        num_train=8192,
        sizes=[784, 128, 10],
        steps=400,
        eval_every=200,
        checkpoint_every=200,
        replicas=2,
        warmstart=40,
    )
    v.update(fields)
    return config_file(
        tmp_path,
        name,
        run={"seed": 0, "num_threads": 1},
        data={"dataset": "mnist", "num_train": v["num_train"], "num_test": 2000},
        model={"kind": "mlp", "sizes": v["sizes"]},
        train={
            "strategy": "downpour",
            "steps": v["steps"],
            "batch_size": 64,
            "optimizer": "adagrad",
            "lr": 0.05,
            "warmup_steps": 0,  # a 400-step run: its accuracy bound predates the default warm-up
            "eval_every": v["eval_every"],
            "log_every": 20,
            "checkpoint_every": v["checkpoint_every"],
        },
        downpour={
            "num_replicas": v["replicas"],
            "num_shards": 2,
            "n_fetch": 2,
            "n_push": 2,
            "warmstart_steps": v["warmstart"],
            "shard_checkpoint_every": 20,
        },
    )


def driver(path: Path, *overrides: str, resume: bool = False) -> Run:
    return prepare(path, overrides=list(overrides), resume=resume, overwrite=not resume)


def kill_when(run: Run, step: int, pid_of) -> threading.Thread:
    """SIGKILL the process `pid_of()` names once the strategy has passed `step`."""

    def watch():
        while run.strategy.step < step:
            time.sleep(0.05)
        os.kill(pid_of(), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_trains_records_staleness_and_warm_starts(ray_session, tmp_path):
    downpour = driver(write_config(tmp_path))
    result = downpour.train()
    assert result.step == 400 and not result.interrupted
    assert result.summary["final_test_accuracy"] > 0.9
    assert result.summary["replica_failures"] == 0
    records = read_metrics(downpour.run_dir.metrics)
    assert records[-1]["step"] == 400
    for key in (
        "time_s",
        "step",
        "examples",
        "loss",
        "lr",
        "staleness_mean",
        "staleness_max",
        "bytes_sent",
        "bytes_received",
        "updates_per_s",
        "replicas_alive",
    ):
        assert key in records[-1], key
    pushes = read_metrics(downpour.run_dir.path / PUSHES_FILE)
    # one push per n_push = 2 steps of each replica
    assert sum(1 for _ in pushes) == pytest.approx(400 / 2, abs=4)
    assert {p["replica"] for p in pushes} == {0, 1}
    assert all(p["replica"] == 0 for p in pushes if p["step"] < 40)  # warm start: replica 0 only
    assert all(p["staleness"] >= 0 for p in pushes if p["staleness"] is not None)
    assert any(p["staleness"] > 0 for p in pushes)  # two replicas do interleave
    # every push carries one full gradient: 2 shards x (784*128+128 + 128*10+10) floats
    assert {p["bytes_sent"] for p in pushes} == {4 * (784 * 128 + 128 + 128 * 10 + 10)}
    tensors, meta = load_checkpoint(downpour.run_dir.checkpoints.latest())
    assert meta["step"] == 400 and "model.layers.fc1.weight" in tensors
    assert len(list((downpour.run_dir.path / "shards").glob("shard_*/step_*.json"))) >= 2


@pytest.mark.slow
def test_killed_replica_is_restarted_and_training_completes(ray_session, tmp_path):
    """Kill one of 3 replicas mid-run: the run completes, about as accurate as without it."""
    options = dict(replicas=3, steps=900, warmstart=0)
    reference = driver(write_config(tmp_path, "reference", **options), "train.lr=0.02").train()
    downpour = driver(write_config(tmp_path, **options), "train.lr=0.02")
    kill_when(downpour, 150, lambda: downpour.strategy.replicas[1].pid())
    result = downpour.train()
    assert result.step == 900
    assert result.summary["replica_failures"] == 1 and result.summary["replica_restarts"] == 1
    accuracy = result.summary["final_test_accuracy"]
    assert accuracy > 0.88
    assert accuracy > reference.summary["final_test_accuracy"] - 0.02
    failure = load_checkpoint(downpour.run_dir.checkpoints.latest())[1]["failures"][0]
    assert failure["replica"] == 1 and failure["kind"] == "died" and failure["restarted"]


@pytest.mark.slow
def test_replica_dead_before_an_evaluation_is_restarted_and_another_answers(ray_session, tmp_path):
    """A replica that died unnoticed (with its node, say) right before an evaluation: the
    evaluation finds it dead, handles it as a failed replica and asks the next one (the run
    used to end with Ray's ActorUnavailableError when a testnet host was killed)."""
    reference = driver(write_config(tmp_path, "reference")).train().summary
    downpour = driver(write_config(tmp_path))
    strategy, evaluate, killed = downpour.strategy, downpour.strategy.evaluate, []

    def kill_replica_0_then_evaluate():
        if not killed:
            pid = strategy.replicas[0].pid()
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while alive({pid}) and time.monotonic() < deadline:
                time.sleep(0.05)
            killed.append(pid)
        return evaluate()

    strategy.evaluate = kill_replica_0_then_evaluate
    result = downpour.train()
    assert killed and result.step == 400
    assert result.summary["replica_failures"] == 1 and result.summary["replica_restarts"] == 1
    accuracy = result.summary["final_test_accuracy"]  # a replica's chunk lost, and restarted
    assert accuracy > 0.85 and accuracy > reference["final_test_accuracy"] - 0.03
    failure = load_checkpoint(downpour.run_dir.checkpoints.latest())[1]["failures"][0]
    assert failure["replica"] == 0 and failure["kind"] == "died" and failure["restarted"]


@pytest.mark.slow
def test_killed_shard_resumes_from_its_checkpoint(ray_session, tmp_path):
    downpour = driver(write_config(tmp_path, steps=600), "downpour.shard_backups=0")
    kill_when(downpour, 200, lambda: downpour.strategy.shards.servers[0][0].info()[0]["pid"])
    result = downpour.train()
    assert result.step == 600
    assert result.summary["shard_restarts"] == 1
    assert 0 <= result.summary["shard_updates_lost"] <= 20  # shard_checkpoint_every
    assert result.summary["final_test_accuracy"] > 0.9


@pytest.mark.slow
def test_threaded_replicas_survive_a_killed_shard_and_a_killed_replica(ray_session, tmp_path):
    """The fault paths with fetch and push threads: a shard SIGKILLed (no backup: Ray
    restarts it from its checkpoint) and a replica SIGKILLed (restarted); the run ends,
    about as accurate as the same run without faults.

    Against a fault-free run rather than a fixed bar: this asynchronous run's final accuracy
    spreads by about +-1.5 points from run to run (0.870-0.904 with the faults, 0.883-0.899
    without), so a fixed 0.88 failed runs whose faults had cost nothing."""
    options = dict(steps=800, replicas=2)
    overrides = ("downpour.threads=true", "downpour.shard_backups=0", "train.lr=0.02")
    reference = driver(write_config(tmp_path, "reference", **options), *overrides).train()
    downpour = driver(write_config(tmp_path, **options), *overrides)
    kill_when(downpour, 200, lambda: downpour.strategy.shards.servers[0][0].info()[0]["pid"])
    kill_when(downpour, 450, lambda: downpour.strategy.replicas[1].pid())
    result = downpour.train()
    assert result.step == 800
    assert result.summary["shard_restarts"] == 1
    assert 0 <= result.summary["shard_updates_lost"] <= 20  # shard_checkpoint_every
    assert result.summary["replica_failures"] == 1 and result.summary["replica_restarts"] == 1
    accuracy = result.summary["final_test_accuracy"]
    assert accuracy > 0.85
    assert accuracy > reference.summary["final_test_accuracy"] - 0.03
    pushes = read_metrics(downpour.run_dir.path / PUSHES_FILE)
    assert pushes and all(p["threads"] is True for p in pushes)


@pytest.mark.slow
def test_killed_shard_primary_fails_over_to_its_backup_losing_nothing(ray_session, tmp_path):
    """One replica fetching and pushing every step is deterministic: with a shard primary
    SIGKILLed mid-run, the backup takes over, the pushes in flight are sent again, and the
    run ends exactly where the fault-free one does (every metric equal), 0 updates lost."""
    options = dict(replicas=1, steps=300, warmstart=0, eval_every=100)
    exact = (
        "downpour.n_fetch=1",
        "downpour.n_push=1",
        "downpour.shard_backups=1",
        "downpour.threads=false",  # in turn, whatever "auto" would measure
    )
    reference = driver(write_config(tmp_path, "reference", **options), *exact).train()
    downpour = driver(write_config(tmp_path, **options), *exact)
    kill_when(downpour, 120, lambda: downpour.strategy.shards.servers[0][0].info()[1]["pid"])
    result = downpour.train()
    assert result.step == 300
    assert result.summary["shard_restarts"] == 1 and result.summary["shard_updates_lost"] == 0
    assert result.summary["shard_backups"] == 1
    kept = ("step", "loss", "test_accuracy", "test_loss")
    records = [{k: r.get(k) for k in kept} for r in read_metrics(downpour.run_dir.metrics)]
    expected = [
        {k: r.get(k) for k in kept} for r in read_metrics(reference.run_dir / "metrics.jsonl")
    ]
    assert records == expected
    failure = load_checkpoint(downpour.run_dir.checkpoints.latest())[1]["failures"][0]
    assert failure["kind"] == "shard failed over to its backup"


def test_replicas_that_keep_failing_stop_the_run(ray_session, tmp_path):
    downpour = driver(write_config(tmp_path, replicas=1, warmstart=0), "downpour.max_restarts=0")
    kill_when(downpour, 40, lambda: downpour.strategy.replicas[0].pid())
    with pytest.raises(UserError, match="every Downpour replica failed"):
        downpour.train()


def test_unreachable_cluster_is_a_clear_error():
    with pytest.raises(UserError, match="cannot reach the Ray cluster at '127.0.0.1:9'"):
        connect("127.0.0.1:9")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (Ray's GCS, raylet and workers of a run)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines()[1:]:
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state != "Z":
            running.add(pid)
    return running


def run_tracking(args: list[str], until=None) -> tuple[subprocess.Popen, set[int], str]:
    """Run the CLI; collect the processes it starts; optionally SIGINT when `until()`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaleout", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started, deadline, interrupted = set(), time.monotonic() + 240, False
    try:
        while proc.poll() is None:
            started |= descendants(proc.pid)
            if until is not None and not interrupted and until():
                proc.send_signal(signal.SIGINT)
                interrupted = True
            assert time.monotonic() < deadline, "the run took too long"
            time.sleep(0.1)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, started, err


@pytest.mark.slow
def test_cli_interrupt_resume_and_no_process_left(tmp_path):
    """The command as a user runs it: Ctrl-C, --resume, and nothing left running after."""
    path = write_config(tmp_path, steps=800, checkpoint_every=100, eval_every=400)
    run = RunDir(tmp_path / "runs" / "dp")
    proc, first, err = run_tracking([str(path)], until=lambda: bool(run.checkpoints.steps()))
    assert proc.returncode == 130, err
    stopped = load_checkpoint(run.checkpoints.latest())[1]["step"]
    assert 100 <= stopped < 800
    done, second, err = run_tracking([str(path), "--resume"])
    assert done.returncode == 0, err
    assert f"at step {stopped}" in err
    steps = [r["step"] for r in read_metrics(run.metrics)]
    assert steps == sorted(set(steps)) and steps[-1] == 800
    assert len(first) > 2 and len(second) > 2  # Ray's GCS, raylet and workers were seen
    deadline = time.monotonic() + 15
    while alive(first | second) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(first | second), "Ray processes outlived the run"


@pytest.mark.slow
def test_three_thread_replicas_train(ray_session, tmp_path):
    """Fetch, compute and push in three threads per replica (the paper's appendix)."""
    # Pipelined replicas push gradients of staler parameters: a smaller step size, and more
    # steps. At 800 steps runs end at 0.8795-0.9045 (CI failed one at 0.8795); at 1600 at
    # 0.8995-0.921 (6 seeds), clear of the bar.
    steps = 1600
    downpour = driver(write_config(tmp_path, steps=steps), "downpour.threads=true", "train.lr=0.02")
    result = downpour.train()
    assert result.step == steps and result.summary["final_test_accuracy"] > 0.88
    pushes = read_metrics(downpour.run_dir.path / PUSHES_FILE)
    assert len(pushes) == pytest.approx(steps / 2, abs=4)
    assert all(p["staleness"] is not None and p["updates_lost"] == 0 for p in pushes)


def test_diverging_replica_stops_the_run_with_the_users_error(ray_session, tmp_path):
    downpour = driver(write_config(tmp_path, steps=200), "train.optimizer=sgd", "train.lr=1e12")
    with pytest.raises(UserError, match="training diverged: replica"):
        downpour.train()


def test_one_replica_fetching_and_pushing_every_step_is_strategy_single(ray_session, tmp_path):
    """One replica, n_fetch = n_push = 1, no warm start, threads at their default (off):
    the shards apply each gradient before the next fetch, with the same element-wise
    optimizer, and replica 0 draws strategy single's batches and dropout masks: the runs
    end with the same weights, bit for bit."""
    path = write_config(tmp_path, "one", replicas=1, warmstart=0, steps=40, eval_every=20)
    overrides = ["downpour.n_fetch=1", "downpour.n_push=1", "model.dropout=[0.2, 0.5]"]
    downpour = driver(path, *overrides).train()
    single = driver(path, *overrides, "train.strategy=single", "run.name=single").train()
    ours, _ = load_checkpoint(RunDir(downpour.run_dir).checkpoints.latest())
    reference, _ = load_checkpoint(RunDir(single.run_dir).checkpoints.latest())
    weights = [k for k in reference if k.startswith("model.")]
    assert weights and all(torch.equal(ours[k], reference[k]) for k in weights)
    assert downpour.final_test_accuracy == single.final_test_accuracy


@pytest.mark.slow
def test_stuck_replica_is_restarted_by_the_watchdog(ray_session, tmp_path):
    """A replica that stops making progress (SIGSTOP: alive, but silent) is killed after
    downpour.timeout_s and restarted; the run completes."""
    downpour = driver(write_config(tmp_path, steps=300, warmstart=0), "downpour.timeout_s=5")
    frozen: list[int] = []

    def freeze():
        while downpour.strategy.step < 60:
            time.sleep(0.05)
        frozen.append(downpour.strategy.replicas[1].pid())
        os.kill(frozen[0], signal.SIGSTOP)

    threading.Thread(target=freeze, daemon=True).start()
    started = time.monotonic()
    result = downpour.train()
    assert result.step == 300 and time.monotonic() - started < 120
    assert result.summary["replica_failures"] == 1 and result.summary["replica_restarts"] == 1
    failure = load_checkpoint(downpour.run_dir.checkpoints.latest())[1]["failures"][0]
    assert failure["kind"] == "stuck" and "downpour.timeout_s" in failure["message"]
    deadline = time.monotonic() + 10  # the frozen process is ended, not left behind
    while alive(set(frozen)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert frozen and not alive(set(frozen))


@pytest.mark.slow
def test_replica_0_lost_for_good_during_warm_start_hands_it_to_the_next(ray_session, tmp_path):
    """Warm start trains one replica alone; when replica 0 fails for good there, the next
    replica alive goes on (the run used to end early, with exit status 0)."""
    downpour = driver(write_config(tmp_path, steps=200, warmstart=150), "downpour.max_restarts=0")
    kill_when(downpour, 40, lambda: downpour.strategy.replicas[0].pid())
    result = downpour.train()
    assert result.step == 200
    assert result.summary["replica_failures"] == 1 and result.summary["replica_restarts"] == 0
    pushes = read_metrics(downpour.run_dir.path / PUSHES_FILE)
    assert {p["replica"] for p in pushes if 60 < p["step"] < 150} == {1}


@pytest.mark.slow
def test_resume_without_shard_checkpoints_starts_from_the_drivers(ray_session, tmp_path, capsys):
    """Shard checkpoints lost (their directory deleted): --resume starts the shards from the
    driver checkpoint's weights, says so, and keeps what the run had learned."""
    path = write_config(tmp_path, steps=400, warmstart=0)
    first = driver(path, "train.steps=200", "downpour.shard_backups=0").train()
    before = first.summary["final_test_accuracy"]
    shutil.rmtree(tmp_path / "runs" / "dp" / "shards")
    resumed = driver(path, "downpour.shard_backups=0", resume=True)
    result = resumed.train()
    assert "have no checkpoint of their own" in capsys.readouterr().err
    records = [r for r in read_metrics(resumed.run_dir.metrics) if "test_accuracy" in r]
    first_after = next(r["test_accuracy"] for r in records if r["step"] > 200)
    assert result.step == 400 and first_after >= before - 0.02, (before, first_after)
