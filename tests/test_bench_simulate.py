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
