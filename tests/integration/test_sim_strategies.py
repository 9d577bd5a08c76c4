"""The sync and Sandblaster simulations on hand-computable cases equal their closed forms.

Calibrations are built by hand: every cost a case does not exercise is zero (or a rate of
1e30 bytes/s), so the simulated times are sums of the few costs that remain.
"""

from __future__ import annotations

import pytest


def test_a_measuring_process_that_dies_is_reported_at_once():
    import sys
    import time

    from scaleout.sim.measuring import in_processes

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code"):
        in_processes(sys.exit, [(3,)], 1)  # sys.exit(3, queue): a TypeError in the child
    assert time.monotonic() - started < 60


def test_lockstep_measures_each_gap_on_two_ranks():
    """Two gloo ranks on this box: one row per size, one extra per gap (never negative),
    gaps as the ranks computed them (ascending, about as asked)."""
    from scaleout.sim.measure_lockstep import measure_lockstep

    cost = measure_lockstep("exchange", sizes=(100,), gaps_s=(2e-3, 6e-3))
    assert cost.measured_bytes == [400]
    assert len(cost.extra_s) == 1 and len(cost.extra_s[0]) == 2
    assert all(e >= 0 for row in cost.extra_s for e in row)
    assert cost.gaps_s == sorted(cost.gaps_s)
    assert 0.5e-3 < cost.gaps_s[0] < cost.gaps_s[1] < 30e-3
    with pytest.raises(ValueError, match="kind must be one of"):
        measure_lockstep("broadcast")
