"""The simulator's Downpour modes: DiLoCo's bytes and steps against a real run's counters and
closed forms, and the staleness bound's gate against the bound."""

import json

import pytest

from scaleout.api import fit
from scaleout.strategies.downpour.pushes import PUSHES_FILE
from tests.unit.test_sim_diloco import simulate, with_downpour
from tests.unit.test_sim_downpour import config


@pytest.mark.usefixtures("ray_session")
def test_diloco_byte_counts_equal_a_real_runs(tmp_path):
    """Two replicas, two shards, 8-bit pseudo-gradients, H = 4, 40 steps: the simulated
    pushes and fetches carry exactly the bytes per example that pushes.jsonl records."""
    h, steps = 4, 40
    cfg = config(
        num_replicas=2,
        num_shards=2,
        steps=steps,
        codec="dynamic8",
        n_fetch=h,
        n_push=h,
        shared_memory=True,
    )
    cfg = with_downpour(cfg, mode="diloco")
    raw = cfg.model_dump(mode="json")
    raw["run"]["out_dir"] = str(tmp_path)
    result = fit(raw)
    lines = (result.run_dir / PUSHES_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    sim = simulate(cfg)
    examples = steps * cfg.train.batch_size
    assert sum(r["steps"] for r in records) == steps
    assert sim.extra["pushes"] == len(records) == steps // h
    assert sim.extra["pulls"] == steps // h
    sent = sum(r["bytes_sent"] for r in records)
    received = sum(r["bytes_received"] for r in records)
    assert sim.bytes_by_kind["push"] / examples == sent / examples
    assert sim.bytes_by_kind["pull"] / examples == received / examples
