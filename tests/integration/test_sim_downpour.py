"""The simulator's engine and Downpour schedule against closed forms, and its byte counts
against a real run's counters."""

import json

import pytest

from scaleout.api import fit
from scaleout.compress.payload import payload_size
from scaleout.ps.layout import shard_ranges
from scaleout.sim.downpour import DownpourSim
from scaleout.sim.setting import Setting
from scaleout.strategies.downpour.pushes import PUSHES_FILE
from tests.unit.test_sim_downpour import NUM_PARAMETERS, calibration, config, with_link


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize(("link", "sent"), [(None, "dynamic8"), ("ib56", "fp32")])
def test_byte_counts_equal_a_real_runs(tmp_path, link, sent):
    """One replica, two shards, 8-bit pushes, n_fetch 2, n_push 3: the simulated pushes
    carry exactly the bytes that pushes.jsonl records, and the pulls too; with a link on
    which raw is faster, both send raw."""
    cfg = config(num_shards=2, steps=40, codec="dynamic8", n_fetch=2, n_push=3, shared_memory=True)
    cfg = with_link(cfg, link)
    raw = cfg.model_dump(mode="json")
    raw["run"]["out_dir"] = str(tmp_path)
    result = fit(raw)
    records = [json.loads(line) for line in (result.run_dir / PUSHES_FILE).read_text().splitlines()]
    sim = DownpourSim(cfg, Setting(calibration(cfg), machines=1)).run()
    ranges = shard_ranges(NUM_PARAMETERS, 2)
    per_push = sum(
        4 * (b - a) if sent == "fp32" else payload_size(sent, (b - a,), 0) for a, b in ranges
    )
    assert sim.extra["pushes"] == len(records) == 14  # ceil(40 / 3)
    assert sim.bytes_by_kind["push"] == sum(r["bytes_sent"] for r in records) == 14 * per_push
    assert sim.extra["pulls"] == 20  # every n_fetch = 2 steps
    assert sim.bytes_by_kind["pull"] == sum(r["bytes_received"] for r in records)
    # a window's compute, fetches and pushes are apart, as the simulation counts them:
    # together they fit within the wall time between two pushes (time_s: 0.1 ms steps)
    sequential = [r for r in records if r["threads"] is not True]
    for before, after in zip(sequential, sequential[1:], strict=False):
        parts = after["compute_s"] + after["fetch_s"] + after["push_s"]
        assert parts <= after["time_s"] - before["time_s"] + 2e-4, after
