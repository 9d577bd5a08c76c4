"""Raw or 8-bit per message: the plan against its closed form, the measured codec cost, and
the parameter-server wire that follows the plan."""

import numpy as np
import pytest
import torch

from scaleout.api import config_from_dict
from scaleout.compress import CompressSection, ErrorFeedback, get
from scaleout.compress.payload import payload_size
from scaleout.compress.transfer import MIN_CHUNK, CodecSpeed, LinkSpeed, encoded_s, plan
from scaleout.ps.wire import Wire


def quarter(n):
    return n  # one byte per value, no header: the closed forms stay readable


FREE = CodecSpeed(0.0, 0.0, 0.0, 0.0)


def test_link_by_name_and_rate():
    assert LinkSpeed.parse("1gbit") == LinkSpeed(125e6, 50e-6)
    assert LinkSpeed.parse("250mbit").bytes_per_s == pytest.approx(31.25e6)
    assert LinkSpeed.parse("40MB").bytes_per_s == pytest.approx(40e6)
    with pytest.raises(ValueError, match="compress.link = 'fast'"):
        LinkSpeed.parse("fast", "compress.link =")
    assert LinkSpeed(1e6, 0.01).seconds(1000) == pytest.approx(0.011)


def test_a_measured_link_is_the_robust_line_through_its_times():
    """Messages at 1 ms + bytes / 1 MB/s, one size disturbed tenfold: the line holds."""
    times = [(b, 1e-3 + b / 1e6) for b in (10, 1_000, 10_000, 100_000, 1_000_000)]
    times[2] = (10_000, 10 * times[2][1])
    link = LinkSpeed.from_times(times)
    assert link.bytes_per_s == pytest.approx(1e6, rel=1e-6)
    assert link.latency_s == pytest.approx(1e-3, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        LinkSpeed.from_times([(10, 1.0)])


def test_one_piece_is_encode_wire_decode():
    link = LinkSpeed(1e6, 0.01)
    speed = CodecSpeed(1e-3, 1e-7, 2e-3, 2e-7)
    n = 10_000
    expected = 0.01 + (1e-3 + 1e-7 * n) + n / 1e6 + (2e-3 + 2e-7 * n)
    assert encoded_s(n, n, link, speed, quarter) == pytest.approx(expected)
    chosen = plan(n, link, speed, quarter, pipeline=False)
    assert chosen.encoded and chosen.chunk == n and chosen.num_chunks == 1
    assert chosen.seconds == pytest.approx(expected)
    assert chosen.raw_s == pytest.approx(0.01 + 4 * n / 1e6)


def test_pipeline_pays_the_slowest_stage_per_extra_piece():
    """4 pieces of 2^16 values on a link that takes longer than the codec: latency, one
    piece through all three stages, then 3 more wire times."""
    link = LinkSpeed(1e6, 1e-4)
    speed = CodecSpeed(1e-5, 1e-8, 1e-5, 1e-8)
    n = 4 * MIN_CHUNK
    piece = MIN_CHUNK
    wire = piece / 1e6
    stages = (1e-5 + 1e-8 * piece) + wire + (1e-5 + 1e-8 * piece)
    assert encoded_s(n, piece, link, speed, quarter) == pytest.approx(1e-4 + stages + 3 * wire)
    chosen = plan(n, link, speed, quarter)
    assert chosen.encoded and chosen.chunk == MIN_CHUNK and chosen.num_chunks == 4
    assert chosen.pieces() == [(i * piece, (i + 1) * piece) for i in range(4)]


def test_raw_where_the_codec_costs_more_than_the_bytes_it_saves():
    link = LinkSpeed(10e9 / 8, 20e-6)
    slow = CodecSpeed(50e-6, 2e-9, 50e-6, 1e-9)
    small = plan(10_000, link, slow, quarter)
    assert not small.encoded and small.seconds == small.raw_s
    # the same codec on a 100 Mbit link: 8 bits win, about 4x for a large message
    large = plan(4_000_000, LinkSpeed.parse("100mbit"), slow, quarter)
    assert large.encoded and 3.5 < large.raw_s / large.seconds <= 4.0
    assert plan(0, link, slow, quarter).encoded is False


def test_a_free_codec_always_encodes():
    for n in (1, 1000, 10**7):
        assert plan(n, LinkSpeed(1e9, 0.0), FREE, quarter).encoded


def test_measure_fits_call_and_value_costs(monkeypatch):
    """Known costs on a clock the calls advance (sleeping oversleeps by whatever the box
    does meanwhile): send 2 ms + 10 ns per value, receive 1 ms + 20 ns; `measure` fits
    them exactly, whatever the repeats."""
    import types

    from scaleout.compress import transfer

    now = [0.0]
    monkeypatch.setattr(transfer, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def send(x):
        now[0] += 2e-3 + 1e-8 * x.numel()
        return x.numel()

    def receive(numel):
        now[0] += 1e-3 + 2e-8 * numel
        return torch.zeros(1)

    speed = CodecSpeed.measure(send, receive, repeats=3)
    assert speed.send_call_s == pytest.approx(2e-3) and speed.send_value_s == pytest.approx(1e-8)
    assert speed.receive_call_s == pytest.approx(1e-3)
    assert speed.receive_value_s == pytest.approx(2e-8)


def section(link, error_feedback=False):
    return CompressSection(codec="dynamic8", link=link, error_feedback=error_feedback)


def test_wire_follows_the_plan():
    n = 100_000
    x = torch.randn(n)
    slow = CodecSpeed(1e-3, 1e-8, 1e-3, 1e-8)
    fast = CodecSpeed(1e-6, 1e-10, 1e-6, 1e-10)
    raw = Wire(section("10gbit"), speed=slow).encode(x)  # 2 ms of codec calls > the 0.24 ms saved
    assert isinstance(raw, np.ndarray) and torch.equal(Wire().decode(raw), x)
    encoded = Wire(section("100mbit"), speed=slow).encode(x)
    assert isinstance(encoded, bytes) and len(encoded) == payload_size("dynamic8", (n,), 0)
    assert Wire(section("10gbit"), speed=fast).encodes(n)
    # without a link: always encoded, as before
    assert Wire(CompressSection(codec="dynamic8")).encodes(1)
    # a wire that measures the codec itself: 8 bits on 100 Mbit for 100k values
    assert Wire(section("100mbit")).encodes(n)


def test_a_raw_message_carries_the_residual_in_full():
    """Error feedback: after an 8-bit message the residual r is kept; a raw message then
    sends y + r exactly and keeps nothing."""
    codec = ErrorFeedback(get("dynamic8"))
    x, y = torch.randn(1000), torch.randn(1000)
    residual = x - codec.decode(codec.encode(x, "k"))
    assert residual.abs().max() > 0
    assert torch.equal(codec.spend(y, "k"), y + residual)
    assert torch.equal(codec.compensate(y, "k"), y)

    wire = Wire(section("10gbit", error_feedback=True), speed=CodecSpeed(1.0, 0.0, 1.0, 0.0))
    wire._codec.encode(x, "k")  # an earlier 8-bit message of this stream
    kept = wire._codec.residuals["k"].clone()
    sent = wire.decode(wire.encode(y, "k"))
    assert torch.equal(sent, y + kept) and "k" not in wire._codec.residuals


def test_a_bad_link_names_the_field():
    with pytest.raises(ValueError, match="compress.link"):
        config_from_dict(
            {
                "run": {"name": "x"},
                "data": {"dataset": "mnist"},
                "model": {"kind": "mlp", "sizes": [784, 10]},
                "compress": {"codec": "dynamic8", "link": "fast"},
            }
        )


def test_encodes_only_where_priced_at_most_the_margin_of_raw():
    """8 bits priced at 0.9x raw stay raw (within what the codec's price can be off by under
    load); at 0.7x they are chosen. One piece, a free wire: encoded = send + receive."""
    from scaleout.compress.transfer import ENCODE_MARGIN

    n, link = 1000, LinkSpeed(1e3, 0.0)  # raw: 4 s; encoded wire: 1 s
    for share, expected in ((0.9, False), (0.7, True)):
        codec_s = share * 4.0 - 1.0  # on top of the encoded bytes' 1 s
        speed = CodecSpeed(codec_s / 2, 0.0, codec_s / 2, 0.0)
        chosen = plan(n, link, speed, quarter, pipeline=False)
        assert chosen.raw_s == pytest.approx(4.0)
        assert chosen.encoded is expected, (share, ENCODE_MARGIN)
