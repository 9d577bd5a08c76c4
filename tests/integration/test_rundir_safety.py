"""The run directory under failure: `--overwrite` deletes nothing until the new run has
started, one run at a time writes a directory, and a full disk (or an unwritable file) is
one line that leaves the previous checkpoint intact. Strategy "single" on tiny synthetic
data: no Ray; the parameter-server shard is driven as a plain object."""

import json
import subprocess
import sys
import textwrap

import scaleout
from scaleout.checkpoint import load_checkpoint
from scaleout.cli import main
from scaleout.metrics import read_metrics
from scaleout.rundir import ASIDE_DIR
from tests.run_config import config_file
from tests.tiny_run import config, lock_is_free

KILLED_OVERWRITE = """
import os, sys
from pathlib import Path
from scaleout.rundir import RunDir
run = RunDir.prepare(Path(sys.argv[1]), {"killed": True}, overwrite=True)
os._exit(0)  # as if killed: no finally, no finalizer
"""


def test_what_a_killed_overwrite_set_aside_is_put_back(tmp_path, previous):
    run_dir, before = previous
    subprocess.run([sys.executable, "-c", KILLED_OVERWRITE, str(run_dir)], check=True)
    assert (run_dir / ASIDE_DIR).is_dir() and not (run_dir / "metrics.jsonl").exists()
    result = scaleout.fit(config(tmp_path, steps=30), resume=True)  # from the put-back run
    assert result.step == 30
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == [10, 20, 30]
    assert not (run_dir / ASIDE_DIR).exists()


# --- one run at a time ------------------------------------------------------------------------

HOLD = """
import sys
from pathlib import Path
from scaleout.rundir import RunDir
run = RunDir.prepare(Path(sys.argv[1]), {"holder": True})
print("locked", flush=True)
sys.stdin.read()
run.close()
"""


def test_a_second_run_fails_at_once_naming_the_first(tmp_path, capsys):
    raw = config(tmp_path, steps=5, every=5)
    path = config_file(tmp_path, "r", **raw)
    run_dir = tmp_path / "runs" / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert f"is being written by another run (pid {holder.pid}); wait for it" in err
        assert json.loads((run_dir / "config.json").read_text()) == {"holder": True}
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert main(["train", str(path)]) == 0  # released when the holder ended
    assert lock_is_free(run_dir)


FILE_SIZE_LIMIT = """
import resource, signal, sys
from pathlib import Path
import scaleout
from scaleout.errors import DiskError

raw = {raw!r}
scaleout.fit(raw)  # checkpoint at step 10, written without a limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # < a checkpoint, > metrics
raw["train"]["steps"] = 20
try:
    scaleout.fit(raw, resume=True)
except DiskError as err:
    print("DiskError:", err)
"""


def test_a_file_size_limit_at_a_checkpoint_fails_cleanly(tmp_path):
    """A real failing write (RLIMIT_FSIZE), through safetensors' own writer."""
    raw = config(tmp_path, steps=10, hidden=2048)  # ~300 kB a checkpoint
    script = FILE_SIZE_LIMIT.format(raw=raw)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("DiskError:"))
    checkpoints = tmp_path / "runs" / "r" / "checkpoints"
    assert f"cannot write checkpoint {checkpoints / 'step_00000020'}: File too large" in line
    assert f"{checkpoints / 'step_00000010.json'} is intact" in line
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step_00000010.json",
        "step_00000010.safetensors",
    ]
    load_checkpoint(checkpoints / "step_00000010.json")
