"""Every bad input the reliability issue lists is one line naming the setting, before any
worker starts and before the run directory is touched; the extremes the property test
(test_set_property.py) draws only small values for are checked here one by one."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaleout.api import prepare
from scaleout.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TINY = ["data.num_train=512", "data.num_test=256", "train.steps=4", "train.batch_size=64"]


def fails_before_writing(tmp_path: Path, config: str, *overrides: str) -> str:
    """The one-line error `scaleout.fit` gives for `overrides`, checking nothing was written
    (the run directory does not exist) and no strategy was built."""
    out = tmp_path / "runs"
    with pytest.raises(UserError) as raised:
        prepare(REPO / config, overrides=[*TINY, f"run.out_dir='{out}'", *overrides]).train()
    assert not out.exists() or not any(out.iterdir()), "the run wrote files before failing"
    message = str(raised.value)
    assert len(message.splitlines()) == 1, message
    return message


@pytest.mark.parametrize(
    ("config", "overrides", "names"),
    [
        ("configs/mnist_downpour.toml", ["downpour.num_shards=2000000"], "downpour.num_shards"),
        ("configs/mnist_downpour.toml", ["data.num_train=1"], "downpour.num_replicas"),
        (
            "configs/mnist_downpour.toml",
            ["compress.codec='fp16'", "compress.block_size=64"],
            "block_size",
        ),
        ("configs/autoencoder_model_parallel.toml", ["model_parallel.grid=[1,7]"], "grid"),
        ("configs/mnist_sync.toml", ["sync.timeout_s=1e15"], "sync.timeout_s"),
        # found by the property test: 1e-12 s made the group's store time out at once
        ("configs/mnist_sync.toml", ["sync.timeout_s=1e-12"], "sync.timeout_s"),
        ("configs/mnist_sync.toml", ["data.num_train=1"], "train.batch_size"),
        ("configs/mnist_single.toml", ["train.lr=inf"], "train.lr"),
        ("configs/mnist_single.toml", ["train.lr=nan"], "train.lr"),
        ("configs/mnist_downpour.toml", ["downpour.num_replicas=1000000"], "num_replicas"),
        ("configs/mnist_sandblaster.toml", ["sandblaster.num_shards=100000000"], "num_shards"),
        # found by the property test: 10^12 loader processes exhausted memory (OOM)
        ("configs/mnist_single.toml", ["loader.workers=1000000000000"], "loader.workers"),
        # found by the property test: torch.set_num_threads overflowed its C int in a worker
        ("configs/autoencoder_model_parallel.toml", ["run.num_threads=2147483648"], "num_threads"),
        # 2^31 L-BFGS pairs: the coordinator's list of them exhausted memory
        ("configs/mnist_sandblaster.toml", ["sandblaster.history=2147483648"], "history"),
        # 2^31 copies of every patch: an allocation of petabytes
        ("configs/autoencoder_model_parallel.toml", ["data.channels=2147483648"], "channels"),
    ],
)
def test_validation_errors_before_any_worker(tmp_path, config, overrides, names):
    assert names in fails_before_writing(tmp_path, config, *overrides)
