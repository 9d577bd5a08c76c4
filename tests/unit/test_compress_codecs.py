"""Codecs: round trips of every code, error bounds, options, state, NaN/Inf, error feedback,
the autograd function, and the paper's error table on a small sample."""

import numpy as np
import pytest
import torch

from scaleout import compress
from scaleout.compress import (
    CODEC_NAMES,
    EIGHT_BIT_CODECS,
    CompressSection,
    Encoded,
    ErrorFeedback,
    NonFiniteInput,
    compressed,
    from_config,
    get,
)
from scaleout.compress.tables import get_table

SYMMETRIC = [name for name in EIGHT_BIT_CODECS if name != "dynamic8_bnb"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def all_codes_message(name: str, scale: float) -> Encoded:
    codes = torch.arange(256, dtype=torch.uint8)
    return Encoded(name, torch.float32, (256,), codes, torch.tensor([scale]))


@pytest.mark.parametrize("name", EIGHT_BIT_CODECS)
@pytest.mark.parametrize("scale", [1.0, 3.7e-20, 2.5e12])
def test_every_code_survives_decode_then_encode(name, scale):
    codec = get(name)
    if name in ("static8", "mantissa8"):
        scale = 10.0  # fixed 10^K, K = 1
    message = all_codes_message(name, scale)
    decoded = codec.decode(message)
    again = codec.encode(decoded)
    assert again.scales.item() == pytest.approx(scale, rel=1e-6)
    values = get_table(name).values
    unique = np.array([np.sum(values == v) == 1 for v in values])  # duplicates: mantissa, 0
    unique |= np.isin(np.arange(256), [126, 254]) & (name == "dynamic8")  # +-0 kept by sign
    np.testing.assert_array_equal(again.codes.numpy()[unique], np.arange(256)[unique])
    torch.testing.assert_close(codec.decode(again), decoded, rtol=0, atol=0)


def cell_bound(name: str, a: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Half the gap between the two table magnitudes around each |a| (the largest error a
    nearest rounding may make), and, beyond the top value of its sign, the distance to it."""
    table = get_table(name)
    bounds = []
    for mags in (table.pos_magnitudes, table.neg_magnitudes):
        mags = mags.astype(np.float64)
        i = np.clip(np.searchsorted(mags, a), 1, len(mags) - 1)
        half = (mags[i] - mags[i - 1]) / 2
        bounds.append(np.where(a > mags[-1], a - mags[-1], half))
    return np.where(negative, bounds[1], bounds[0])


@pytest.mark.parametrize("name", EIGHT_BIT_CODECS)
@pytest.mark.parametrize("block_size", [None, 100])
def test_nearest_error_within_half_a_cell(name, block_size):
    if name in ("static8", "mantissa8") and block_size:
        pytest.skip("fixed-scale codecs have no blocks")
    torch.manual_seed(0)
    x = torch.randn(5_000) * torch.exp(torch.randn(5_000) * 4)
    x[::97] = 0
    codec = get(name, block_size=block_size)
    encoded = codec.encode(x)
    y = codec.decode(encoded)
    length = block_size or x.numel()
    scale = encoded.scales.repeat_interleave(length)[: x.numel()].double()
    a = (x.double().abs() / torch.where(scale > 0, scale, 1)).numpy()
    err = (x.double() - y.double()).abs().numpy()
    bound = cell_bound(name, a, torch.signbit(x).numpy()) * scale.numpy()
    slack = 1e-6 * x.double().abs().numpy()  # float32 rounding of a = x / scale
    assert np.all(err <= bound * (1 + 1e-4) + slack + 1e-30)


@pytest.mark.parametrize("name", SYMMETRIC)
def test_sign_symmetry(name):
    x = torch.randn(2_000) * 3
    codec = get(name)
    torch.testing.assert_close(codec.roundtrip(-x), -codec.roundtrip(x), rtol=0, atol=0)


def test_paper_rounding_reproduces_the_dynamic_tree_row_of_table_1():
    """Table 1, dynamic tree, with the kernel's rounding: U(0, 1) MSE 0.00004 and mean
    relative error 1.39%, N(0, 1) 2.46% (its MSE depends on the sample's absmax, which
    grows with the sample: the benchmark checks it at the paper's 25M samples). Nearest
    rounding does better in every figure (notes section 5)."""
    generator = torch.Generator().manual_seed(0)
    uniform = torch.rand(1_000_000, generator=generator)
    normal = torch.randn(1_000_000, generator=generator)
    results = {}
    for dist, x in (("U", uniform), ("N", normal)):
        for rounding in ("paper", "nearest"):
            y = get("dynamic8", rounding=rounding).roundtrip(x).double()
            mse = torch.mean((x.double() - y) ** 2).item()
            mre = 100 * torch.mean((x.double() - y).abs() / x.double().abs()).item()
            results[dist, rounding] = mse, mre
    assert results["U", "paper"][0] == pytest.approx(4e-5, rel=0.1)
    assert results["U", "paper"][1] == pytest.approx(1.39, rel=0.03)
    assert results["N", "paper"][1] == pytest.approx(2.46, rel=0.05)
    for dist in ("U", "N"):
        nearest, paper = results[dist, "nearest"], results[dist, "paper"]
        assert nearest[0] < 0.5 * paper[0] and nearest[1] < 0.75 * paper[1]


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (), (1,), (7, 5, 3)])
def test_any_shape_and_dtype(name, dtype, shape):
    x = torch.randn(shape).to(dtype)
    codec = get(name)
    y = codec.decode(Encoded.from_bytes(codec.encode(x).to_bytes()))
    assert y.dtype == dtype and y.shape == x.shape
    if name in ("fp32", "fp16", "bf16", "dynamic8", "linear8", "dynamic8_bnb") and x.numel():
        assert torch.allclose(y.float(), x.float(), rtol=0.1, atol=0.05 * x.abs().max().item())


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("block_size", [None, 4])
def test_all_zero_tensors_and_blocks(name, block_size):
    x = torch.zeros(10)
    x[8] = -2.0  # blocks 0 and 1 all zero, block 2 not
    options = {"block_size": block_size} if name in ("dynamic8", "linear8", "onebit") else {}
    codec = get(name, **options)
    torch.testing.assert_close(codec.roundtrip(torch.zeros(10)), torch.zeros(10))
    y = codec.roundtrip(x)
    assert torch.all(y[:8] == 0) and torch.all(y[9:] == 0)
    assert y[8].item() == pytest.approx(-2.0, rel=0.06)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raise_by_default_and_flag_on_request(name, bad):
    x = torch.randn(50)
    x[7] = bad
    with pytest.raises(NonFiniteInput, match="nonfinite='flag'"):
        get(name).encode(x)
    encoded = get(name, nonfinite="flag").encode(x)
    assert encoded.nonfinite
    again = Encoded.from_bytes(encoded.to_bytes())
    assert again.nonfinite and torch.isnan(compress.decode(again)).all()


def test_fp16_overflow_is_refused():
    with pytest.raises(NonFiniteInput, match="beyond fp16"):
        get("fp16").encode(torch.tensor([1e5, 1.0]))


def test_refresh_every_reuses_the_scale_per_key():
    codec = get("dynamic8", refresh_every=3)
    scales = []
    for call in range(7):
        x = torch.full((4,), float(call + 1))
        encoded = codec.encode(x, key="w")
        scales.append(encoded.scales.item())
        codec.encode(torch.full((4,), 100.0), key="other")  # its own key, its own scale
    assert scales == [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 7.0]
    # Beyond a stale scale, values clamp to the largest code: 2.0 with scale 1.0 -> 1.0.
    stale = get("dynamic8", refresh_every=2)
    stale.encode(torch.tensor([1.0, 0.5]), key="k")
    torch.testing.assert_close(
        stale.roundtrip(torch.tensor([2.0, 0.5]), key="k")[0], torch.tensor(1.0)
    )


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown"):
        get("int4")
    with pytest.raises(ValueError, match="exponent_offset .* does not apply to codec 'dynamic8'"):
        get("dynamic8", exponent_offset=2)
    with pytest.raises(ValueError, match="block_size"):
        get("fp16", block_size=64)
    with pytest.raises(ValueError, match="nearest"):
        get("dynamic8_bnb", rounding="paper")
    with pytest.raises(ValueError, match="block_size"):
        get("dynamic8", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        get("dynamic8").encode(torch.arange(5))
    with pytest.raises(ValueError, match="cannot decode a fp16 message"):
        get("dynamic8").decode(get("fp16").encode(torch.ones(3)))


def test_exponent_offset_scales_static_types():
    x = torch.tensor([35.0, -0.7])
    near = get("static8", exponent_offset=2).roundtrip(x)
    assert near[0].item() == pytest.approx(35.0, rel=0.05)
    assert get("static8").roundtrip(x)[0].item() < 10  # K = 1 tops out below 10


def test_from_config_builds_the_section():
    codec = from_config(CompressSection(codec="dynamic8", block_size=256, refresh_every=50))
    assert codec.options["block_size"] == 256 and codec.options["refresh_every"] == 50
    wrapped = from_config(CompressSection(codec="onebit", error_feedback=True))
    assert isinstance(wrapped, ErrorFeedback) and wrapped.name == "onebit"
    for name in CODEC_NAMES:  # the defaults of the section suit every codec
        assert from_config(CompressSection(codec=name)).name == name


def test_error_feedback_sends_the_sum_of_the_inputs():
    """Summed over steps, what arrives equals what was sent but for the last residual."""
    torch.manual_seed(0)
    codec = ErrorFeedback(get("onebit", block_size=64))
    sent = torch.zeros(1000)
    arrived = torch.zeros(1000)
    for _ in range(30):
        g = torch.randn(1000)
        sent += g
        arrived += codec.roundtrip(g, key="g")
    residual = codec.residuals["g"]
    torch.testing.assert_close(arrived + residual, sent, rtol=1e-4, atol=1e-4)
    # Without feedback the 30 errors add up; with it the lag stays about one message's.
    plain = get("onebit", block_size=64)
    torch.manual_seed(0)
    lost = sum(g - plain.roundtrip(g) for g in (torch.randn(1000) for _ in range(30)))
    assert residual.norm() < 1000**0.5 < 0.5 * lost.norm()


def test_error_feedback_keeps_bf16_residuals_in_float32():
    codec = ErrorFeedback(get("dynamic8"))
    x = torch.randn(100).bfloat16()
    encoded = codec.encode(x, key=1)
    assert encoded.dtype == torch.bfloat16 and codec.residuals[1].dtype == torch.float32
    codec.forget(1)
    assert 1 not in codec.residuals


@pytest.mark.parametrize("name", ["dynamic8", "onebit", "bf16"])
def test_compressed_autograd_compresses_forward_and_backward(name):
    codec = get(name)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(8, 16)
    y = compressed(x, codec)
    torch.testing.assert_close(y, codec.roundtrip(x.detach()), rtol=0, atol=0)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, codec.roundtrip(w), rtol=0, atol=0)
