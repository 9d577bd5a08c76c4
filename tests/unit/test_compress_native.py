"""The C codec kernels against the binary-search reference and the torch kernels: every
table, rounding, input type, block layout and size class, every code, given (stale)
scales, decoding into `out`, and the fallback when no compiler is there."""

import pytest
import torch

from scaleout.compress import get, kernels, native
from scaleout.compress.tables import TABLES

CPU = torch.device("cpu")


def sample(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=generator) * torch.exp(4 * torch.randn(n, generator=generator))
    x[::101] = 0
    x[1::103] = -0.0
    return x


def lib() -> native.Kernels:
    loaded = native.library()
    assert loaded is not None, "the C kernels did not build on this machine"
    return loaded


def torch_path(fn, *args):
    with native.native_disabled(), kernels.compiling("never"):
        return fn(*args)


ROUNDINGS = [(name, "nearest") for name in sorted(TABLES)] + [
    (name, "paper")
    for name in sorted(TABLES)
    if name != "dynamic8_bnb"  # bnb's is nearest
]


@pytest.mark.parametrize(("table_name", "rounding"), ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [None, 4096, 1000])
def test_encode_equals_reference(table_name, rounding, dtype, block_size):
    lib()
    table = kernels.lookup(table_name, rounding, CPU)
    x = sample(3 * 4096 + 77).to(dtype)
    codes, scales, num_bad = kernels.encode(x, None, table, block_size)
    torch_codes, torch_scales, _ = torch_path(kernels.encode, x, None, table, block_size)
    assert num_bad == 0 and codes.dtype == torch.uint8
    assert torch.equal(scales, torch_scales)
    assert torch.equal(codes, kernels.encode_reference(x, scales, table, block_size))
    assert torch.equal(codes, torch_codes)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 4095, 4097, 64 * 1024 + 3, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_size_class_round_trips_as_the_torch_kernels(n, dtype):
    """Sizes around the 64-value vector step and the 4096-value block, up to 2^20."""
    lib()
    for block_size in (None, 4096):
        table = kernels.lookup("dynamic8", "nearest", CPU)
        x = sample(n).to(dtype)
        codes, scales, _ = kernels.encode(x, None, table, block_size)
        assert torch.equal(codes, kernels.encode_reference(x, scales, table, block_size))
        decoded = kernels.decode(codes, scales, table, block_size, dtype)
        expected = torch_path(kernels.decode, codes, scales, table, block_size, dtype)
        assert decoded.dtype == dtype and torch.equal(decoded, expected)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1 << 24, (1 << 26) + 5])
def test_large_tensors_equal_the_reference(n):
    lib()
    table = kernels.lookup("dynamic8", "nearest", CPU)
    for dtype in (torch.float32, torch.bfloat16):
        x = sample(n).to(dtype)
        codes, scales, _ = kernels.encode(x, None, table, 4096)
        assert torch.equal(codes, kernels.encode_reference(x, scales, table, 4096))
        decoded = kernels.decode(codes, scales, table, 4096, dtype)
        per_value = scales.view(-1).repeat_interleave(4096)[:n]
        assert torch.equal(decoded, (table.values[codes.long()] * per_value).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [None, 256])
def test_every_code_at_every_lane_decodes_exactly(dtype, block_size):
    """All 256 codes at every position of a 64-code step (plus a ragged tail), with scales
    of 0, negative zero's sign, tiny and huge values: values[code] * scale rounded once."""
    lib()
    table = kernels.lookup("dynamic8_bnb", "nearest", CPU)
    codes = torch.arange(256, dtype=torch.uint8).repeat(65)
    codes = torch.cat([codes, torch.roll(codes, 7)[:1000]])  # (17640,)
    n = codes.numel()
    num_blocks = -(-n // block_size) if block_size else 1
    scales = torch.tensor([0.0, 1e-30, 3.5, 1e30] * num_blocks)[:num_blocks].view(-1, 1)
    per_value = scales.view(-1).repeat_interleave(block_size or n)[:n]
    expected = (table.values[codes.long()] * per_value).to(dtype)
    decoded = kernels.decode(codes, scales, table, block_size, dtype)
    assert torch.equal(decoded, expected)
    assert torch.equal(torch.signbit(decoded), torch.signbit(expected))  # -0.0 kept


def test_given_scales_clamp_like_the_torch_kernels():
    """A stale (cached) scale smaller than the data: inputs beyond it take the top code."""
    lib()
    table = kernels.lookup("dynamic8", "nearest", CPU)
    x = sample(10_000)
    stale = torch.full((3, 1), float(x.abs().max()) / 10)
    codes, scales, _ = kernels.encode(x, stale, table, 4096)
    torch_codes, _, _ = torch_path(kernels.encode, x, stale, table, 4096)
    assert torch.equal(scales, stale) and torch.equal(codes, torch_codes)
    assert torch.equal(codes, kernels.encode_reference(x, stale, table, 4096))


def test_inf_and_nan_take_the_torch_path_and_are_counted():
    lib()
    table = kernels.lookup("dynamic8", "nearest", CPU)
    x = sample(5000)
    x[17], x[4500] = float("inf"), float("nan")
    _, _, num_bad = kernels.encode(x, None, table, 4096)
    assert num_bad == 2
    assert get("dynamic8", nonfinite="flag").encode(x).nonfinite


def test_decode_into_out_allocates_nothing_and_checks_out():
    lib()
    codec = get("dynamic8", block_size=4096)
    x = sample(10_000).view(100, 100)
    encoded = codec.encode(x)
    out = torch.empty(100, 100)
    assert codec.decode(encoded, out=out) is out
    assert torch.equal(out, codec.decode(encoded))
    with pytest.raises(ValueError, match="out holds"):
        codec.decode(encoded, out=torch.empty(10))
    with pytest.raises(ValueError, match="contiguous"):
        codec.decode(encoded, out=torch.empty(100, 200)[:, :100])
    with native.native_disabled():  # the torch kernels fill a 2-D out alike
        torch_out = torch.empty(100, 100)
        assert codec.decode(encoded, out=torch_out) is torch_out
    assert torch.equal(torch_out, out)
    fp32 = get("fp32")  # a codec without a C kernel copies into out
    into = torch.empty(100, 100)
    assert fp32.decode(fp32.encode(x), out=into) is into and torch.equal(into, x)


def test_a_missing_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("SCALEOUT_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    native.reset()
    try:
        with pytest.warns(RuntimeWarning, match="C codec kernels are unavailable"):
            assert native.library() is None
        codec = get("dynamic8")
        x = sample(3000)
        got = codec.roundtrip(x)  # the torch kernels, no second warning
        with native.native_disabled():
            torch.testing.assert_close(got, codec.roundtrip(x), rtol=0, atol=0)
    finally:
        native.reset()


def test_mode_is_validated(monkeypatch):
    try:
        monkeypatch.setenv("SCALEOUT_COMPRESS_NATIVE", "sometimes")
        native.reset()
        with pytest.raises(ValueError, match="SCALEOUT_COMPRESS_NATIVE"):
            native.library()
        monkeypatch.setenv("SCALEOUT_COMPRESS_NATIVE", "never")
        native.reset()
        assert native.library() is None
    finally:
        monkeypatch.delenv("SCALEOUT_COMPRESS_NATIVE")
        native.reset()


def test_a_tensor_that_requires_grad_encodes_as_its_values():
    lib()
    codec = get("dynamic8", block_size=4096)
    x = sample(5000).view(50, 100)
    encoded = codec.encode(x.clone().requires_grad_())
    assert torch.equal(encoded.codes, codec.encode(x).codes)
    assert not encoded.codes.requires_grad and not encoded.scales.requires_grad
