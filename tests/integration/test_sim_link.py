"""A link's latency and bandwidth measured over TCP (`scaleout.sim.measure_link`), and the
simulator's `--link calibrated`."""

import subprocess
import sys
import time

from scaleout.comm import free_port
from scaleout.sim import measure_link


def test_probe_measures_a_loopback_link(monkeypatch):
    """Over loopback: a round trip of a byte takes microseconds, and megabytes move at
    more than 100 MB/s (a 1 Gbit link would be 125 MB/s)."""
    monkeypatch.setattr(measure_link, "LATENCY_ROUNDS", 50)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "scaleout.sim.measure_link", "serve", str(port)]
    )
    try:
        time.sleep(0.2)
        measured = measure_link.probe("127.0.0.1", port)
    finally:
        server.wait(timeout=30)
    assert server.returncode == 0
    assert 0 < measured["latency_s"] < 5e-3
    assert measured["bytes_per_s"] > 100e6
