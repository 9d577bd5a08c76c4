"""A tiny run of strategy "single" on synthetic data (no Ray), its files, and its lock: the
run directory's tests start from it."""

from pathlib import Path

from filelock import FileLock

from scaleout.rundir import LOCK_FILE


def config(tmp_path: Path, steps: int = 20, every: int = 10, hidden: int = 16) -> dict:
    return {
        "run": {"name": "r", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "data": {
            "dataset": "synthetic",
            "input_shape": [8],
            "num_classes": 3,
            "num_train": 256,
            "num_test": 64,
        },
        "model": {"kind": "mlp", "sizes": [8, hidden, 3]},
        "train": {
            "strategy": "single",
            "steps": steps,
            "batch_size": 32,
            "optimizer": "adam",
            "lr": 0.01,
            "eval_every": every,
            "log_every": every,
            "checkpoint_every": every,
        },
    }


def files(run: Path) -> dict[str, bytes]:
    """Every file of the run directory and its bytes, the lock's own files aside."""
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.name.startswith(".lock")
    }


def lock_is_free(run: Path) -> bool:
    lock = FileLock(run / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except TimeoutError:
        return False
    lock.release()
    return True
