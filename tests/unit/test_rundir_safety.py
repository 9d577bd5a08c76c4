"""The run directory under failure: `--overwrite` deletes nothing until the new run has
started, one run at a time writes a directory, and a full disk (or an unwritable file) is
one line that leaves the previous checkpoint intact. Strategy "single" on tiny synthetic
data: no Ray; the parameter-server shard is driven as a plain object."""

import errno
import gc
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import scaleout
import scaleout.checkpoint as checkpoint_module
import scaleout.metrics as metrics_module
from scaleout.api import prepare
from scaleout.checkpoint import load_checkpoint
from scaleout.cli import main
from scaleout.errors import DiskError, UserError
from scaleout.metrics import read_metrics
from scaleout.nn.optim import OptimizerSpec
from scaleout.ps.shard import ParameterShard
from scaleout.ps.wire import Wire
from scaleout.rundir import ASIDE_DIR, RunDir
from scaleout.strategies.single import Single
from tests.run_config import config_file
from tests.tiny_run import config, files, lock_is_free

# --- --overwrite --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [RuntimeError("no worker"), UserError("bad"), KeyboardInterrupt()]
)
def test_overwrite_that_fails_at_start_keeps_the_previous_run(tmp_path, previous, error):
    run_dir, before = previous
    run = prepare(config(tmp_path, steps=30, hidden=12), overwrite=True)
    assert not (run_dir / "metrics.jsonl").exists()  # set aside, not deleted
    assert (run_dir / ASIDE_DIR / "metrics.jsonl").exists()

    def start(resume):
        (run_dir / "shards").mkdir()  # as a strategy's shards would write at start
        (run_dir / "shards" / "new").write_text("new")
        raise error

    run.strategy.start = start
    with pytest.raises(type(error)):
        run.train()
    assert files(run_dir) == before  # byte for byte, config.json included
    assert not (run_dir / ASIDE_DIR).exists() and not (run_dir / "shards").exists()
    assert lock_is_free(run_dir)
    tensors, meta = load_checkpoint(run_dir / "checkpoints" / "step_00000020.json")
    assert meta["step"] == 20


def test_overwrite_that_succeeds_removes_the_previous_run(tmp_path, previous, monkeypatch):
    run_dir, _ = previous
    seen = {}
    start = Single.start

    def spy(self, resume):
        seen["aside"] = (run_dir / ASIDE_DIR / "checkpoints" / "step_00000020.json").exists()
        seen["metrics"] = (run_dir / "metrics.jsonl").exists()
        return start(self, resume)

    monkeypatch.setattr(Single, "start", spy)
    result = scaleout.fit(config(tmp_path, steps=10, every=5), overwrite=True)
    assert seen == {"aside": True, "metrics": False}  # deleted only once it had started
    assert result.step == 10
    assert RunDir(run_dir).checkpoints.steps() == [5, 10]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [5, 10]
    assert not any(p.name.startswith(".previous") for p in run_dir.iterdir())
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 10


def test_a_prepared_run_never_trained_gives_the_directory_back(tmp_path, previous):
    run_dir, before = previous
    run = prepare(config(tmp_path), overwrite=True)
    assert not lock_is_free(run_dir)
    with pytest.raises(UserError, match=r"is being written by another run in this process"):
        prepare(config(tmp_path), overwrite=True)
    run.close()
    assert files(run_dir) == before and lock_is_free(run_dir)

    run = prepare(config(tmp_path), overwrite=True)
    del run
    gc.collect()
    assert files(run_dir) == before and lock_is_free(run_dir)


def test_an_aside_copy_beside_a_run_is_refused(tmp_path, previous):
    run_dir, _ = previous
    (run_dir / ASIDE_DIR).mkdir()
    (run_dir / ASIDE_DIR / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=r"\.previous holds the files of a previous run"):
        scaleout.fit(config(tmp_path), overwrite=True)
    assert (run_dir / ASIDE_DIR / "metrics.jsonl").exists() and lock_is_free(run_dir)


def test_the_lock_is_released_after_a_run_and_after_a_failed_one(tmp_path, monkeypatch):
    scaleout.fit(config(tmp_path, steps=5, every=5))
    run_dir = tmp_path / "runs" / "r"
    assert lock_is_free(run_dir)

    def start(self, resume):
        raise RuntimeError("start failed")

    with monkeypatch.context() as patch:
        patch.setattr(Single, "start", start)
        with pytest.raises(RuntimeError, match="start failed"):
            scaleout.fit(config(tmp_path, steps=10, every=5), overwrite=True)
    assert lock_is_free(run_dir)
    assert scaleout.fit(config(tmp_path, steps=10, every=5), resume=True).step == 10


def test_a_run_refused_or_failing_at_start_leaves_no_directory_behind(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="no checkpoint to resume from"):
        scaleout.fit(config(tmp_path), resume=True)
    assert not (tmp_path / "runs" / "r").exists()

    def start(self, resume):
        raise UserError("downpour.num_shards = 2000000: more processes than the cluster has")

    monkeypatch.setattr(Single, "start", start)
    with pytest.raises(UserError, match="more processes"):
        scaleout.fit(config(tmp_path))
    assert not (tmp_path / "runs" / "r").exists()


# --- a full disk ------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", [".safetensors", ".json"])
def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_previous(
    tmp_path, monkeypatch, failing
):
    atomic_write = checkpoint_module.atomic_write

    def full(path, write):
        def part_then_full(tmp):
            write(tmp)  # (a part of) the file is written, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        atomic_write(path, part_then_full if path.name == f"step_00000020{failing}" else write)

    monkeypatch.setattr(checkpoint_module, "atomic_write", full)
    with pytest.raises(DiskError) as raised:
        scaleout.fit(config(tmp_path))
    message = str(raised.value)
    run_dir = tmp_path / "runs" / "r"
    checkpoints = run_dir / "checkpoints"
    assert "\n" not in message
    assert f"cannot write checkpoint {checkpoints / 'step_00000020'}: " in message
    assert "No space left on device (errno 28); free space" in message
    assert f"the previous checkpoint {checkpoints / 'step_00000010.json'} is intact" in message
    assert "the run stopped at step 20: fix it, then --resume" in message
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step_00000010.json",
        "step_00000010.safetensors",
    ]
    tensors, meta = load_checkpoint(checkpoints / "step_00000010.json")
    assert meta["step"] == 10 and tensors
    assert lock_is_free(run_dir)
    monkeypatch.undo()  # space freed: the run goes on from its last checkpoint
    assert scaleout.fit(config(tmp_path), resume=True).step == 20


def test_a_full_disk_in_metrics_is_one_line(tmp_path, monkeypatch, capsys):
    class Full:
        def __init__(self, *args, **kwargs):
            self.file = open(*args, **kwargs)  # noqa: SIM115

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self):
            self.file.flush()

        def close(self):
            self.file.close()

    path = config_file(tmp_path, "r", **config(tmp_path))
    monkeypatch.setattr(metrics_module, "open", Full, raising=False)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (err,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert f"cannot write metrics {tmp_path / 'runs' / 'r' / 'metrics.jsonl'}: No space" in err
    assert "the run stopped at step 10; no checkpoint was written yet" in err


def test_an_unwritable_config_is_one_line(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    # A directory where config.json's temporary file goes: unwritable, as root too.
    (run_dir / f".config.json.{os.getpid()}.tmp").mkdir(parents=True)
    with pytest.raises(DiskError, match=r"cannot write config .*config\.json: Is a directory"):
        scaleout.fit(config(tmp_path))
    assert lock_is_free(run_dir)


# --- a parameter-server shard that cannot checkpoint -----------------------------------------


@pytest.fixture
def shard_threads():
    threads = torch.get_num_threads()  # the shard sets one thread, as in its own process
    yield
    torch.set_num_threads(threads)


def make_shard(directory: Path, every: int = 2) -> ParameterShard:
    return ParameterShard(
        3, 10, OptimizerSpec("sgd", lr=0.1), checkpoint_dir=str(directory), checkpoint_every=every
    )


def push(shard: ParameterShard) -> tuple[int, int]:
    return shard.push(Wire().encode(torch.ones(10)), shard.version)


def test_a_shard_that_cannot_checkpoint_keeps_applying_pushes(tmp_path, shard_threads):
    blocked = tmp_path / "a file"
    blocked.write_text("")  # a file where the shard's directory should be: unwritable, as root too
    shard = make_shard(blocked / "shard_3")
    for _ in range(5):
        push(shard)
    assert shard.version == 5
    assert torch.allclose(shard.param.detach(), torch.full((10,), -0.5))
    assert shard.checkpoint_failures == 2  # due at versions 2 and 4, tried again each time
    assert shard.checkpoint_error.startswith("parameter-server shard 3: cannot write checkpoint")
    with pytest.raises(
        DiskError,
        match=r"^parameter-server shard 3: cannot write checkpoint .*"
        r"shard_3/step_00000005: Not a directory",
    ):
        shard.checkpoint()
    with pytest.raises(DiskError, match="parameter-server shard 3"):
        shard.initialize(np.zeros(10, dtype=np.float32))  # the first checkpoint, at start


def test_a_shard_retries_at_the_next_due_point(tmp_path, shard_threads, monkeypatch):
    shard = make_shard(tmp_path / "shard_3")
    shard.initialize(np.zeros(10, dtype=np.float32))
    with monkeypatch.context() as patch:  # the disk fills up
        patch.setattr(
            checkpoint_module,
            "save_file",
            lambda tensors, path: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")),
        )
        for _ in range(3):
            push(shard)
        assert shard.checkpoint_failures == 1 and shard._saved_version == 0
    push(shard)  # space again: version 4 is due, and written
    assert shard._saved_version == 4 and shard.checkpoint_failures == 1
    assert shard.checkpoints.steps() == [0, 4]
    tensors, meta = load_checkpoint(shard.checkpoints.latest())
    assert meta["version"] == 4 and not list(shard.checkpoints.directory.glob("*.tmp"))


def test_a_relative_run_directory_is_made_absolute_on_the_driver(tmp_path, monkeypatch):
    """Shards and replicas on other nodes are handed the run directory: a relative one
    would put their checkpoints wherever `ray start` ran on their node."""
    monkeypatch.chdir(tmp_path)
    settings = config(tmp_path)
    settings["run"]["out_dir"] = "relative/runs"
    run = prepare(settings)
    try:
        assert run.job.run.out_dir == tmp_path / "relative" / "runs"
        assert run.job.run_dir.is_absolute() and run.run_dir.path.is_absolute()
    finally:
        run.close()
