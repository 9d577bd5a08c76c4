"""The `simulate` suite's held-out cases stay valid configs the simulator can run."""

from scaleout.api import load_config
from scaleout.bench import available_suites
from scaleout.bench.simulate import CASES, _configs_dir, _overrides
from scaleout.sim.simulate import simulation_for


def test_cases_are_valid_configs_with_a_simulation(tmp_path):
    assert "simulate" in available_suites()
    assert len(CASES) >= 12 and len({case.name for case in CASES}) == len(CASES)
    for case in CASES:
        config = load_config(_configs_dir() / case.config, _overrides(case, tmp_path))
        assert config.train.steps == 400
        assert simulation_for(config.train.strategy) is not None


def test_testnet_cases_are_priced_on_two_machines_over_the_measured_network(tmp_path):
    """A case with a link rate is simulated on two machines of this box (one replica and one
    shard each) over the link set into its calibration, never over a named one, and its
    calls across the link cost what was measured beyond the same calls on one host."""
    from pathlib import Path

    from scaleout.bench.simulate import _simulated
    from scaleout.sim.calibration import LinkCost, MessageCost

    calibration = Path(__file__).resolve().parents[1] / "results" / "calibration.json"
    case = next(c for c in CASES if c.link == "100mbit" and "8-bit" not in c.name)

    def simulated(rate, across_s=None):
        network = {"link": LinkCost(bytes_per_s=rate)}
        if across_s is not None:
            cost = MessageCost(fixed_s=across_s, bytes_per_s=1e12)
            network.update(pull_across=cost, push_across=cost)
        return _simulated(case, tmp_path, calibration, {"100mbit": network})

    rows = {rate: simulated(rate) for rate in (12.5e6, 2e6)}
    for row in rows.values():
        assert row["machines"] == 2 and row["link"] == "calibrated"
        assert row["wire_bytes"] > 0 and row["local_bytes"] > 0  # a replica beside a shard
    # the same bytes cross the link; at 2 MB/s they take 6x as long
    assert rows[2e6]["wire_bytes"] == rows[12.5e6]["wire_bytes"]
    assert rows[2e6]["examples_per_s"] < 0.5 * rows[12.5e6]["examples_per_s"]
    # 200 ms more per call across the link: fewer examples/s, the same bytes
    slower = simulated(12.5e6, across_s=0.2)
    assert slower["examples_per_s"] < 0.8 * rows[12.5e6]["examples_per_s"]
    assert slower["wire_bytes"] == rows[12.5e6]["wire_bytes"]


def test_a_testnet_run_placed_unlike_the_simulation_is_run_again(monkeypatch, tmp_path):
    """Ray's spreading now and then puts both shards on one host: such a run does not count;
    after `ATTEMPTS` of them the case fails, naming the placement."""
    import json

    import pytest

    from scaleout.bench import simulate_testnet

    hosts = ["10.0.0.1", "10.0.0.2"]
    apart = {"replicas": hosts[::-1], "shards": hosts}
    together = {"replicas": hosts, "shards": [hosts[1], hosts[1]]}
    placements = [together, apart]
    monkeypatch.setattr(simulate_testnet, "_run", lambda *args: (placements.pop(0), hosts))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"examples": 6400, "time_s": 3.2}) + "\n")
    assert simulate_testnet.measured(tmp_path, [], "1gbit", tmp_path) == 2000
    assert placements == []  # the first run was placed unlike the simulation: run again
    monkeypatch.setattr(simulate_testnet, "_run", lambda *args: (together, hosts))
    with pytest.raises(RuntimeError, match="none with one replica and one shard"):
        simulate_testnet.measured(tmp_path, [], "1gbit", tmp_path)
