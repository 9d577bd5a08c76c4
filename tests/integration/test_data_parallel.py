"""Synchronous data parallelism: exactness against hand computations and strategy "single",
a process group of Ray actors, a killed worker, resume, and MNIST convergence (slow)."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import scaleout
from scaleout.api import build_job, load_config, prepare
from scaleout.checkpoint import load_checkpoint
from scaleout.comm import WorkerDied, destroy_distributed, free_port, init_distributed
from scaleout.data import make_loader
from scaleout.errors import ConfigError
from tests.run_config import config_file


def write_config(tmp_path: Path, name: str = "s", **fields) -> Path:
    v = dict(
        num_train=1024,
        sizes=[784, 32, 10],
        dropout=0.0,
        steps=4,
        batch=32,
        lr=0.1,
        eval_every=1000,
        checkpoint_every=1000,
        workers=2,
        mode="allreduce",
        average_every=1,
    )
    v.update(fields)
    return config_file(
        tmp_path,
        name,
        run={"seed": 5, "num_threads": 1},
        data={"dataset": "mnist", "num_train": v["num_train"], "num_test": 1000},
        model={"kind": "mlp", "sizes": v["sizes"], "dropout": v["dropout"]},
        train={
            "strategy": "sync",
            "steps": v["steps"],
            "batch_size": v["batch"],
            "optimizer": "momentum",
            "lr": v["lr"],
            "momentum": 0.9,
            "eval_every": v["eval_every"],
            "log_every": 10,
            "checkpoint_every": v["checkpoint_every"],
        },
        sync={
            "num_workers": v["workers"],
            "mode": v["mode"],
            "average_every": v["average_every"],
        },
    )


def run_sync(path: Path, *overrides: str, resume: bool = False):
    run = prepare(path, overrides=list(overrides), resume=resume, overwrite=not resume)
    return run, run.train()


def run_single(path: Path, name: str) -> Path:
    """Strategy "single" on the same config: the reference."""
    overrides = ["train.strategy=single", f"run.name={name}"]
    return scaleout.fit(path, overrides=overrides, overwrite=True).run_dir


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from scaleout.checkpoint import CheckpointDir

    tensors, _ = load_checkpoint(CheckpointDir(run_dir / "checkpoints").latest())
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


def hand_average_sgd(path: Path, num_workers: int, steps: int, every: int) -> dict:
    """Each worker's own SGD-with-momentum step on its slice of the global batch, written
    out by hand (v = mu v + g; w = w - lr v), then weights and velocities averaged."""
    config = load_config(path)
    job = build_job(config)
    torch.manual_seed(config.run.seed)
    train, _ = job.build_data()
    model = job.build_model(train)
    start = [p.detach().clone() for p in model.parameters()]
    lr, mu = config.train.lr, config.train.momentum
    workers = [[w.clone() for w in start] for _ in range(num_workers)]
    velocity: list[list[torch.Tensor] | None] = [None] * num_workers
    loader = make_loader(train, config.train.batch_size, seed=config.run.seed, drop_last=True)
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        xs, ys = torch.tensor_split(x, num_workers), torch.tensor_split(y, num_workers)
        for r in range(num_workers):
            for p, w in zip(model.parameters(), workers[r], strict=True):
                p.data.copy_(w)
            model.zero_grad()
            F.cross_entropy(model(xs[r]), ys[r]).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            if velocity[r] is None:  # torch's first step: the buffer is the gradient
                velocity[r] = grads
            else:
                velocity[r] = [mu * v + g for v, g in zip(velocity[r], grads, strict=True)]
            workers[r] = [w - lr * v for w, v in zip(workers[r], velocity[r], strict=True)]
        if (step + 1) % every == 0:
            mean_w = [sum(ws) / num_workers for ws in zip(*workers, strict=True)]
            mean_v = [sum(vs) / num_workers for vs in zip(*velocity, strict=True)]
            workers = [[w.clone() for w in mean_w] for _ in range(num_workers)]
            velocity = [[v.clone() for v in mean_v] for _ in range(num_workers)]
    names = [f"model.{n}" for n, _ in model.named_parameters()]
    return dict(zip(names, workers[0], strict=True))


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Strategy "single" run in this process sets torch's thread count: put it back, or later
    tests comparing runs bit for bit with subprocesses would see other float reductions."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def assert_close(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=1e-4, msg=key)


# --- comm: process groups ------------------------------------------------------------------


def test_init_distributed_reads_torchrun_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_distributed()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        assert init_distributed() == (0, 1)
        import torch.distributed as dist

        assert dist.get_backend() == "gloo"
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
    finally:
        destroy_distributed()
    assert not torch.distributed.is_initialized()


def test_actors_form_a_process_group(ray_session):
    import ray
    from ray import cloudpickle

    from scaleout.comm import GroupMember, ProcessGroup

    class Member(GroupMember):
        def __init__(self, rank: int, world: int) -> None:
            self.rank = rank

        def all_reduce_rank(self) -> list[float]:
            import torch.distributed as dist

            t = torch.tensor([float(self.rank), 1.0])
            dist.all_reduce(t)
            return [dist.get_rank(), dist.get_world_size(), *t.tolist()]

    cloudpickle.register_pickle_by_value(__import__(__name__))
    group = ProcessGroup.create(Member, 3, num_cpus=0.5)
    try:
        answers = ray.get([a.all_reduce_rank.remote() for a in group.actors])
        assert answers == [[r, 3, 0 + 1 + 2, 3] for r in range(3)]
        assert len(set(group.pids)) == 3
    finally:
        group.close()
    time.sleep(0.5)
    for pid in group.pids:  # no process left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_group_that_cannot_form_is_a_worker_failure_with_its_cause(ray_session):
    """Rank 0 cannot serve the group's store (its port is taken): `create` raises
    `WorkerDied` naming the address and the cause (the CLI shows one line, the driver may
    start the group again), where it used to raise Ray's traceback."""
    import socket

    from ray import cloudpickle

    from scaleout.comm import GroupMember, ProcessGroup, WorkerDied

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]

    class Member(GroupMember):
        def __init__(self, rank: int, world: int) -> None:
            self.rank = rank

        def group_address(self) -> tuple[str, int]:
            return "127.0.0.1", port

    cloudpickle.register_pickle_by_value(__import__(__name__))
    try:
        with pytest.raises(WorkerDied, match=rf"could not join .*127.0.0.1:{port} within 2 s"):
            ProcessGroup.create(Member, 2, num_cpus=0.5, timeout_s=2.0)
    finally:
        taken.close()


# --- exactness -------------------------------------------------------------------------------


def test_average_mode_equals_hand_computed_average_of_worker_steps(ray_session, tmp_path):
    path = write_config(tmp_path, "avg", mode="average", steps=3)
    _, result = run_sync(path)
    assert result.step == 3
    assert_close(weights(result.run_dir), hand_average_sgd(path, 2, 3, every=1))


@pytest.mark.slow
def test_average_every_two_steps_equals_hand_computation(ray_session, tmp_path):
    path = write_config(tmp_path, "avg2", mode="average", steps=4, average_every=2)
    _, result = run_sync(path)
    assert_close(weights(result.run_dir), hand_average_sgd(path, 2, 4, every=2))
    # and it is not the every-step schedule: averaging less often changes the result
    every_step = hand_average_sgd(path, 2, 4, every=1)
    got = weights(result.run_dir)
    assert any(not torch.allclose(got[k], every_step[k], atol=1e-6) for k in got)


def test_allreduce_equals_one_worker_on_the_concatenated_batch(ray_session, tmp_path):
    path = write_config(tmp_path, "ar", steps=5)
    _, result = run_sync(path)
    assert_close(weights(result.run_dir), weights(run_single(path, "ref")))


def test_one_worker_is_strategy_single_with_dropout(ray_session, tmp_path):
    path = write_config(tmp_path, "one", workers=1, dropout=0.5, steps=6)
    _, result = run_sync(path)
    assert_close(weights(result.run_dir), weights(run_single(path, "ref1")), atol=0)


@pytest.mark.slow  # the hook's own tests (test_compress_ddp) run by default
def test_compress_codec_plugs_in_as_ddp_hook(ray_session, tmp_path):
    path = write_config(tmp_path, "fp32", steps=4)
    _, plain = run_sync(path)
    _, compressed = run_sync(path, "run.name=bf16", "compress.codec=bf16")
    got, reference = weights(compressed.run_dir), weights(plain.run_dir)
    assert any(not torch.equal(got[k], reference[k]) for k in got)  # the hook did run
    assert_close(got, reference, atol=2e-2)  # ... and only rounded the gradients


def test_batch_must_split_evenly(ray_session, tmp_path):
    with pytest.raises(ConfigError, match="sync.num_workers"):
        prepare(write_config(tmp_path, "odd", batch=33), overwrite=True)


# --- failure and resume ----------------------------------------------------------------------


def kill_worker_after_checkpoint(run, step: int, pids: list[int]) -> None:
    """SIGKILL sync worker 1 once checkpoint `step` is written (its pids go to `pids`)."""
    checkpoints = run.run_dir.checkpoints

    def kill() -> None:
        while not any(s >= step for s in checkpoints.steps()):
            time.sleep(0.01)
        pids.extend(run.strategy.workers.group.pids)
        os.kill(pids[1], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


@pytest.mark.slow
def test_killed_worker_restarts_the_group_from_the_last_checkpoint(ray_session, tmp_path):
    """A dead worker stops its group; the driver starts the group again from the last
    checkpoint, and the run ends as an uninterrupted one would (SGD, no dropout: equal)."""
    shape = dict(sizes=[784, 64, 10], num_train=4096, batch=128, checkpoint_every=20)
    path = write_config(tmp_path, "restart", steps=120, **shape)
    run = prepare(path, overwrite=True)
    pids: list[int] = []
    kill_worker_after_checkpoint(run, 40, pids)
    result = run.train()
    assert result.step == 120
    assert result.summary["restarts"] == 1
    assert 0 <= result.summary["steps_redone"] < 20 + 20  # since the last checkpoint
    for pid in pids:  # the old group is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    run_sync(write_config(tmp_path, "whole", steps=120, **shape))
    assert_close(weights(tmp_path / "runs" / "restart"), weights(tmp_path / "runs" / "whole"))


@pytest.mark.slow
def test_silent_worker_times_out_its_collective_and_the_group_restarts(
    ray_session, tmp_path, stopped_pids
):
    """Worker 1 stopped (SIGSTOP: alive, never answering): worker 0's all-reduce fails after
    sync.timeout_s, the group is ended (the stopped process too) and started again from the
    last checkpoint; the run completes."""
    shape = dict(sizes=[784, 64, 10], num_train=4096, batch=128, checkpoint_every=20)
    path = write_config(tmp_path, "silent", steps=80, **shape)
    run = prepare(path, overrides=["sync.timeout_s=5"], overwrite=True)
    checkpoints = run.run_dir.checkpoints

    def stop_after_a_checkpoint() -> None:
        while not any(s >= 20 for s in checkpoints.steps()):
            time.sleep(0.01)
        stopped_pids.append(run.strategy.workers.group.pids[1])
        os.kill(stopped_pids[0], signal.SIGSTOP)

    threading.Thread(target=stop_after_a_checkpoint, daemon=True).start()
    started = time.monotonic()
    result = run.train()
    assert result.step == 80 and result.summary["restarts"] == 1
    assert time.monotonic() - started < 120


def test_killed_worker_stops_the_run_and_resume_finishes_it(ray_session, tmp_path):
    shape = dict(sizes=[784, 256, 256, 10], num_train=8192, batch=128, checkpoint_every=20)
    path = write_config(tmp_path, "kill", steps=160, **shape)
    run = prepare(path, overrides=["train.max_restarts=0"], overwrite=True)
    checkpoints = run.run_dir.checkpoints
    pids: list[int] = []
    kill_worker_after_checkpoint(run, 40, pids)
    with pytest.raises(WorkerDied, match=r"sync worker 1 \(pid \d+\) died.*--resume"):
        run.train()
    stopped_at = run.strategy.step
    assert 40 <= stopped_at < 160
    last = checkpoints.latest()
    tensors, meta = load_checkpoint(last)  # valid: checksums verified
    assert meta["strategy"] == "sync" and meta["step"] % 20 == 0 and meta["step"] >= 40
    assert "rng.torch.1" in tensors
    time.sleep(0.5)
    for pid in pids:  # the survivor was stopped too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    resumed, result = run_sync(path, resume=True)
    assert result.step == 160 and resumed.strategy.step == 160


@pytest.mark.slow
def test_resume_equals_uninterrupted_run(ray_session, tmp_path):
    shape = dict(sizes=[784, 64, 10], dropout=0.3, steps=60, checkpoint_every=30)
    path = write_config(tmp_path, "part", **shape)
    run_sync(path, "train.steps=30")
    run_sync(path, resume=True)
    run_sync(write_config(tmp_path, "whole", **shape))
    assert_close(weights(tmp_path / "runs" / "part"), weights(tmp_path / "runs" / "whole"), 0)


# --- convergence -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "average"])
def test_mnist_two_workers_reach_97_percent(ray_session, tmp_path, mode):
    path = write_config(
        tmp_path,
        f"conv_{mode}",
        num_train=60000,
        sizes=[784, 512, 10],
        steps=1400,
        batch=128,
        lr=0.05,
        eval_every=700,
        checkpoint_every=100000,
        mode=mode,
    )
    _, result = run_sync(path, "data.num_test=10000")
    assert result.summary["final_test_accuracy"] >= 0.97, result.summary
