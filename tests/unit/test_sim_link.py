"""A link's latency and bandwidth measured over TCP (`scaleout.sim.measure_link`), and the
simulator's `--link calibrated`."""

import pytest

from scaleout.errors import ConfigError
from scaleout.sim.calibration import Calibration, LinkCost, MessageCost
from scaleout.sim.simulate import link_of


def test_link_calibrated_takes_the_measured_link_or_says_how():
    cal = Calibration(
        cores=2,
        pull=MessageCost(fixed_s=0.0, bytes_per_s=1e9),
        push=MessageCost(fixed_s=0.0, bytes_per_s=1e9),
    )
    with pytest.raises(ConfigError, match="--testnet"):
        link_of("calibrated", cal)
    cal.link = LinkCost(bytes_per_s=1.1e8, latency_s=2e-4)
    assert link_of("calibrated", cal) == (1.1e8, 2e-4)
    assert link_of("100mbit", cal)[0] == pytest.approx(12.5e6)


def test_a_call_across_hosts_costs_its_difference_less_the_links_transfer():
    """`measure_crossing.across`: the far calls' wall time beyond the near ones' and beyond
    the payload's transfer at the link's rate, their core-seconds beyond the near ones'."""
    from scaleout.sim.measure_crossing import across

    sizes = [1_000_000, 4_000_000]

    def cost(walls, cores, callers, at=sizes):
        return MessageCost(
            fixed_s=0.0,
            bytes_per_s=1e9,
            measured_bytes=at,
            measured_s=walls,
            measured_core_s=cores,
            measured_caller_core_s=callers,
        )

    near = cost([0.002, 0.006], [0.003, 0.009], [0.001, 0.003])
    far = cost([0.014, 0.050], [0.010, 0.030], [0.002, 0.005])
    extra = across(near, far, bytes_per_s=125e6)  # 8 ms / 32 ms on the link
    assert extra.measured_s == pytest.approx([0.004, 0.012])
    assert extra.measured_core_s == pytest.approx([0.007, 0.021])
    assert extra.seconds(2_000_000) == pytest.approx(extra.measured_s[0] + 0.008 * 0.5)
    # a far call no slower than the near one and its transfer costs (almost) nothing more
    assert across(near, near, 125e6).seconds(4_000_000) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="same sizes"):
        across(near, cost([0.01], [0.01], [0.0], at=[5]), 1e9)
