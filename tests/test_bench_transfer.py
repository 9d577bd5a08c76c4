"""The transfer benchmark's pair of testnet hosts: every mode arrives exact (the receiver
asserts it), and auto follows the plan it reports."""

import pytest

from scaleout.bench import codecs_transfer, testnet

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(testnet.available() is not None, reason=str(testnet.available())),
]


def test_a_pair_at_100mbit_sends_every_mode_exactly():
    sizes = [10_000, 300_000]
    result = codecs_transfer.run_pair("100mbit", sizes, reps=2)
    for mode in codecs_transfer.MODES:
        assert all(len(result["times"][mode][str(n)]) >= codecs_transfer.MIN_REPS for n in sizes)
    link = result["link"]
    assert 8e6 < link["bytes_per_s"] < 14e6  # 100 Mbit/s is 12.5 MB/s
    # 4 bytes a value raw against 1 on a link this slow: 8 bits chosen, and faster
    plan = result["plans"]["300000"]
    assert plan["encoded"]
    times = {mode: sorted(result["times"][mode]["300000"]) for mode in ("raw", "auto")}
    assert times["auto"][len(times["auto"]) // 2] < times["raw"][len(times["raw"]) // 2] / 2
