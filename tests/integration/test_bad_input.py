"""Every bad input the reliability issue lists is one line naming the setting, before any
worker starts and before the run directory is touched; the extremes the property test
(test_set_property.py) draws only small values for are checked here one by one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scaleout.api import prepare
from scaleout.errors import UserError
from tests.unit.test_bad_input import TINY

REPO = Path(__file__).resolve().parents[2]


def test_custom_resource_no_node_offers_fails_in_seconds(ray_session, tmp_path):
    """Ray would keep such an actor pending forever (the issue: killed after 150 s)."""
    started = time.monotonic()
    run = prepare(
        REPO / "configs/mnist_downpour.toml",
        overrides=[*TINY, f"run.out_dir='{tmp_path}'", "downpour.shard_resource='typo'"],
    )
    with pytest.raises(UserError, match="offers the resource 'typo'"):
        run.train()
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("config", "overrides", "names"),
    [
        (
            "configs/mnist_downpour.toml",
            ["downpour.num_shards=5000", "model.sizes=[784, 16, 10]", "model.dropout=0.0"],
            "downpour.num_shards = 5000",
        ),
        (
            "configs/mnist_sync.toml",
            ["sync.num_workers=4096", "train.batch_size=4096", "data.num_train=8192"],
            "sync",
        ),
    ],
)
def test_more_processes_than_the_cluster_holds(ray_session, tmp_path, config, overrides, names):
    run = prepare(REPO / config, overrides=[*TINY, f"run.out_dir='{tmp_path}'", *overrides])
    with pytest.raises(UserError, match="processes") as raised:
        run.train()
    assert names in str(raised.value)
