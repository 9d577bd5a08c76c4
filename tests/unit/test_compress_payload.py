"""The byte format: round trips, and every corruption refused (property tests)."""

import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scaleout.compress import CODEC_NAMES, CorruptPayload, Encoded, NonFiniteInput, get
from scaleout.compress.payload import MAGIC, pack, unpack
from scaleout.compress.tables import get_table

BLOCKED = ("dynamic8", "dynamic8_bnb", "linear8", "onebit")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Random shapes (0 to 4 dims, some empty), dtypes, magnitudes from 1e-30 to 1e30,
    zeros, denormals and signs."""
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=4))
    dtype = draw(st.sampled_from(DTYPES))
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    log_scale = draw(st.floats(-30, 30))
    values = rng.standard_normal(n) * 10.0**log_scale
    kind = draw(st.sampled_from(["plain", "zeros", "denormal", "mixed"]))
    if kind == "zeros":
        values[:] = 0
    elif kind == "denormal":
        values = rng.standard_normal(n) * 1e-40
    elif kind == "mixed" and n:
        values[rng.random(n) < 0.3] = 0
        values[rng.random(n) < 0.1] *= 1e-20
    x = torch.from_numpy(values.astype(np.float32)).reshape(shape).to(dtype)
    assume(torch.isfinite(x).all())  # fp16 overflows beyond 65504
    return x


def codec_options(name: str, block_size: int | None) -> dict:
    return {"block_size": block_size} if name in BLOCKED else {}


@SETTINGS
@given(
    x=tensors(),
    name=st.sampled_from(CODEC_NAMES),
    block_size=st.one_of(st.none(), st.integers(1, 70)),
    crc=st.booleans(),
)
def test_bytes_round_trip_preserves_everything(x, name, block_size, crc):
    codec = get(name, **codec_options(name, block_size))
    try:
        encoded = codec.encode(x)
    except NonFiniteInput:
        assert name == "fp16"  # a value beyond 65504 in a float32 or bfloat16 tensor
        return
    again = Encoded.from_bytes(encoded.to_bytes(crc=crc))
    assert (again.codec, again.dtype, again.shape, again.block_size) == (
        encoded.codec,
        encoded.dtype,
        encoded.shape,
        encoded.block_size,
    )
    assert torch.equal(again.codes, encoded.codes) and torch.equal(again.scales, encoded.scales)
    y = codec.decode(again)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, codec.decode(encoded))
    assert torch.isfinite(y).all()


@SETTINGS
@given(
    x=tensors(),
    name=st.sampled_from(["dynamic8", "linear8", "dynamic8_bnb"]),
    block_size=st.one_of(st.none(), st.integers(1, 70)),
)
def test_absmax_codecs_bound_the_error_at_any_scale(x, name, block_size):
    """Error at most one cell of the table (largest gap) times the block's absmax, plus the
    output dtype's rounding and float32's smallest denormal."""
    codec = get(name, block_size=block_size)
    y = codec.roundtrip(x).double().view(-1)
    flat = x.double().view(-1)
    n = flat.numel()
    if n == 0:
        return
    length = block_size or n
    blocks = torch.nn.functional.pad(flat.abs(), (0, -n % length)).view(-1, length)
    scale = blocks.amax(1).repeat_interleave(length)[:n]
    mags = np.unique(np.abs(get_table(name).values.astype(np.float64)))
    cell = np.max(np.diff(mags))
    finfo = torch.finfo(x.dtype)
    smallest_denormal = finfo.smallest_normal * finfo.eps + 1.5e-45  # of x.dtype, float32
    bound = scale * cell + flat.abs() * finfo.eps + smallest_denormal
    assert torch.all((flat - y).abs() <= bound)


@SETTINGS
@given(x=tensors(), name=st.sampled_from(CODEC_NAMES), data=st.data())
def test_truncated_or_padded_payloads_are_refused(x, name, data):
    payload = get(name, nonfinite="flag").encode(x).to_bytes(crc=data.draw(st.booleans()))
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(CorruptPayload):
        Encoded.from_bytes(payload[:cut])
    extra = data.draw(st.binary(min_size=1, max_size=9))
    with pytest.raises(CorruptPayload):
        Encoded.from_bytes(payload + extra)


@SETTINGS
@given(x=tensors(), name=st.sampled_from(CODEC_NAMES), data=st.data())
def test_any_flipped_bit_is_refused_with_crc(x, name, data):
    payload = bytearray(get(name, nonfinite="flag").encode(x).to_bytes(crc=True))
    position = data.draw(st.integers(0, 8 * len(payload) - 1))
    payload[position // 8] ^= 1 << (position % 8)
    with pytest.raises(CorruptPayload):
        Encoded.from_bytes(bytes(payload))


def _resealed(body: bytes) -> bytes:
    """A payload whose header was edited and whose CRC was recomputed to match: only the
    header checks can catch it."""
    return body + zlib.crc32(body).to_bytes(4, "little")


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, b"XOCQ", "magic"),
        (4, b"\x09", "version"),
        (5, b"\x63", "codec id"),
        (6, b"\x07", "dtype id"),
        (7, b"\x41", "flag"),
        (8, b"\x03", "must hold|implies|ends inside"),  # ndim 3: lengths misread
        (12, b"\x05", "must hold"),  # block_size 5: 3 scales expected, 1 present
        (20, b"\x07", "must hold"),  # first dim 7 instead of 3
        (36, b"\x11", "must hold"),  # the code-byte count
    ],
)
def test_inconsistent_headers_are_refused(offset, value, message):
    encoded = get("dynamic8").encode(torch.randn(3, 4))
    body = bytearray(encoded.to_bytes(crc=True)[:-4])
    body[offset : offset + len(value)] = value
    with pytest.raises(CorruptPayload, match=message):
        Encoded.from_bytes(_resealed(bytes(body)))


def test_a_nonfinite_scale_is_refused():
    encoded = get("dynamic8").encode(torch.randn(8))
    bad = Encoded("dynamic8", torch.float32, (8,), encoded.codes, torch.tensor([float("inf")]))
    with pytest.raises(CorruptPayload, match="non-finite scale"):
        Encoded.from_bytes(bad.to_bytes())


def test_header_starts_with_magic_and_crc_is_on_by_default():
    payload = get("dynamic8").encode(torch.randn(4)).to_bytes()
    assert payload[:4] == MAGIC
    assert int.from_bytes(payload[-4:], "little") == zlib.crc32(payload[:-4])


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_pack_unpack_round_trip(name):
    x = torch.randn(37)
    encoded = get(name, nonfinite="flag").encode(x)
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), pack(encoded)])[3:]  # unaligned
    again = unpack(buffer, encoded)
    torch.testing.assert_close(get(name).decode(again), get(name).decode(encoded))
    flagged = get(name, nonfinite="flag").encode(torch.full((37,), float("nan")))
    assert unpack(pack(flagged), flagged).nonfinite
