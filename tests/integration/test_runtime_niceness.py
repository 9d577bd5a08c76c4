"""The embedded Ray instance's workers run at the driver's niceness, not Ray's default 15
(at 15 Ray's own daemons and the driver preempt training: a Downpour replica lost a
quarter of its steps)."""

import os

import pytest


@pytest.mark.usefixtures("ray_session")
def test_workers_run_at_the_drivers_niceness():
    import ray

    niceness = ray.remote(num_cpus=0)(lambda: __import__("os").nice(0))  # travels by value
    assert ray.get(niceness.remote()) == os.nice(0)
