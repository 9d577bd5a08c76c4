"""The torch kernels (compiled and eager, the C kernels turned off) against the
binary-search reference, and the eager fallback. The C kernels: test_compress_native.py."""

import pytest
import torch

from scaleout.compress import get, kernels, native


@pytest.fixture(autouse=True)
def torch_kernels():
    with native.native_disabled():
        yield


def sample(n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=generator) * torch.exp(4 * torch.randn(n, generator=generator))
    x[::101] = 0
    x[1::103] = -0.0
    return x


@pytest.mark.slow  # compiling takes from seconds (cached) to a minute (first time)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [None, 1024])
@pytest.mark.parametrize("n", [64 * 1024, 64 * 1024 + 1])  # odd: no decoding by pairs
def test_compiled_kernels_equal_reference_and_eager(dtype, block_size, n):
    table = kernels.lookup("dynamic8", "paper", torch.device("cpu"))
    x = sample(n).to(dtype)
    with kernels.compiling("always"):
        codes, scales, num_bad = kernels.encode(x, None, table, block_size)
        decoded = kernels.decode(codes, scales, table, block_size)
        given, _, _ = kernels.encode(x, scales, table, block_size)
    with kernels.compiling("never"):
        eager_codes, eager_scales, _ = kernels.encode(x, None, table, block_size)
        eager_decoded = kernels.decode(codes, scales, table, block_size)
    assert num_bad == 0
    torch.testing.assert_close(scales, eager_scales, rtol=0, atol=0)
    reference = kernels.encode_reference(x, scales, table, block_size)
    assert torch.equal(codes, reference) and torch.equal(eager_codes, reference)
    assert torch.equal(given, reference)
    torch.testing.assert_close(decoded, eager_decoded, rtol=0, atol=0)


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("block_size", [None, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decoding_by_pairs_equals_one_at_a_time(block_size, dtype):
    """Every pair of codes, from an even and from an odd address (the latter is decoded one
    code at a time), gives values[code] * scale exactly, rounded once to `dtype`."""
    table = kernels.lookup("dynamic8_bnb", "nearest", torch.device("cpu"))
    every_pair = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.uint8)
    every_pair = every_pair.repeat(kernels.PAIRS_MIN_NUMEL // every_pair.numel())
    buffer = torch.cat([torch.zeros(1, dtype=torch.uint8), every_pair])
    num_blocks = 1 if block_size is None else every_pair.numel() // block_size
    scales = torch.rand(num_blocks, 1, generator=torch.Generator().manual_seed(0)) + 0.5
    per_code = scales.repeat_interleave(block_size or every_pair.numel(), dim=0).view(-1)
    expected = (table.values[every_pair.long()] * per_code).to(dtype)
    unaligned = buffer[1:]  # the same codes from an odd address
    assert unaligned.data_ptr() % 2 == 1 and torch.equal(unaligned, every_pair)
    with kernels.compiling("always"):
        assert kernels._reads_pairs(every_pair, block_size)
        assert not kernels._reads_pairs(unaligned, block_size)
        for codes in (every_pair, unaligned):
            decoded = kernels.decode(codes, scales, table, block_size, dtype)
            assert decoded.dtype == dtype and torch.equal(decoded, expected)


def test_eager_kernels_equal_reference_with_ragged_blocks():
    table = kernels.lookup("linear8", "nearest", torch.device("cpu"))
    x = sample(10_007)
    with kernels.compiling("never"):
        codes, scales, _ = kernels.encode(x, None, table, 1000)
    assert scales.shape == (11, 1)
    torch.testing.assert_close(scales.view(-1)[-1], x[10_000:].abs().max())
    assert torch.equal(codes, kernels.encode_reference(x, scales, table, 1000))


def test_a_failing_compiler_falls_back_to_eager(monkeypatch):
    def broken_compile(fn, **options):
        def compiled(*args):
            raise RuntimeError("no C++ compiler")

        return compiled

    monkeypatch.setattr(kernels, "_COMPILED", {})
    monkeypatch.setattr(kernels, "_COMPILE_FAILED", set())
    monkeypatch.setattr(kernels.torch, "compile", broken_compile)
    x = sample(5000)
    codec = get("dynamic8")
    with kernels.compiling("never"):
        expected = codec.roundtrip(x)
    with kernels.compiling("always"), pytest.warns(RuntimeWarning, match="eager"):
        got = codec.roundtrip(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert "cpu" in kernels._COMPILE_FAILED


def test_compile_mode_is_validated(monkeypatch):
    monkeypatch.setenv("SCALEOUT_COMPRESS_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="SCALEOUT_COMPRESS_COMPILE"):
        kernels.compile_mode()
    with pytest.raises(ValueError, match="compile mode"), kernels.compiling("maybe"):
        pass


def test_dynamic8_bnb_is_at_least_as_close_as_bitsandbytes():
    """Ours rounds to the nearest code exactly; bitsandbytes' CPU kernel uses a 65536-bin
    approximation (notes section 6). Same map, same block absmax: never a larger error."""
    functional = pytest.importorskip("bitsandbytes.functional")
    x = sample(1 << 16)
    codes, state = functional.quantize_blockwise(x, blocksize=4096)
    theirs = functional.dequantize_blockwise(codes, state)
    ours = get("dynamic8_bnb", block_size=4096).roundtrip(x)
    torch.testing.assert_close(state.absmax.view(-1), x.view(-1, 4096).abs().amax(1))
    assert torch.all((ours - x).abs() <= (theirs - x).abs() * (1 + 1e-6) + 1e-30)
