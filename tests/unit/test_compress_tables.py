"""The 8-bit tables against the notes' anchor values, and the two roundings against
independent rules (brute-force nearest; the 2015 kernel's closed form from the notes)."""

import numpy as np
import pytest
import torch

from scaleout.compress import kernels
from scaleout.compress.tables import (
    bnb_dynamic_map,
    dynamic8_table,
    dynamic_tree_magnitudes,
    get_table,
    linear8_table,
    mantissa8_table,
    static8_table,
)

TABLES = ["dynamic8", "dynamic8_bnb", "static8", "mantissa8", "linear8"]


def test_dynamic_tree_anchor_values():
    t = dynamic_tree_magnitudes()
    assert len(t) == 126
    anchors = {
        0: 2.75e-6,
        1: 7.25e-6,
        2: 1.875e-5,
        62: 0.10546875,
        74: 0.23671875,
        93: 0.44453125,
        94: 0.45859375,
        125: 0.99140625,
    }
    for index, value in anchors.items():
        assert t[index] == pytest.approx(value, rel=1e-9), index
    assert np.all(np.diff(t) > 0)


def test_dynamic8_code_layout():
    table = dynamic8_table()
    values = table.values
    t = dynamic_tree_magnitudes().astype(np.float32)
    np.testing.assert_array_equal(values[:126], t)
    assert values[126] == 0 and not np.signbit(values[126])
    assert values[254] == 0 and np.signbit(values[254])  # -0
    assert values[127] == 1.0 and values[255] == -1.0
    np.testing.assert_array_equal(values[128:], -values[:128])
    assert len(np.unique(np.abs(values))) == 128  # 126 + 0 + 1
    assert len(np.unique(values)) == 255  # +-0 collapse


def test_paper_examples_of_the_dynamic_tree():
    """Section 4.1: 0.2345678 -> 0.236719 and 0.0000234 -> 0.000019 (absmax 1)."""
    codec_x = torch.tensor([1.0, 0.2345678, 0.0000234])
    from scaleout.compress import get

    y = get("dynamic8").roundtrip(codec_x)
    assert y[1].item() == pytest.approx(0.236719, abs=1e-6)
    assert y[2].item() == pytest.approx(0.000019, abs=1e-6)


def test_bnb_map_anchor_values():
    code = bnb_dynamic_map()
    assert code.shape == (256,) and np.all(np.diff(code) > 0)
    assert code[127] == 0 and code[255] == 1.0
    assert (code < 0).sum() == 127 and (code > 0).sum() == 128
    assert code[0] == pytest.approx(-0.99296875) and code[254] == pytest.approx(0.99296875)
    assert code[128] == pytest.approx(5.5e-7)


def test_bnb_map_equals_bitsandbytes_when_installed():
    functional = pytest.importorskip("bitsandbytes.functional")
    np.testing.assert_array_equal(bnb_dynamic_map(), functional.create_dynamic_map().numpy())


def test_linear_static_mantissa_layouts():
    np.testing.assert_allclose(linear8_table().values[:128], np.arange(128) / 127, rtol=1e-7)
    static = static8_table().values
    lower = 0.1 + 0.35 * (np.arange(8) + 0.5) / 8
    upper = 0.45 + 0.55 * (np.arange(8) + 0.5) / 8
    tree = np.concatenate([lower, upper])
    for e in range(8):
        expected = 10.0**-e * tree
        if e == 7:
            expected[0] = 0  # the smallest code stands for zero
        np.testing.assert_allclose(static[e * 16 : e * 16 + 16], expected, rtol=1e-7)
    mantissa = mantissa8_table().values
    for e in range(8):
        np.testing.assert_allclose(mantissa[e * 16 : e * 16 + 16], np.arange(16) * 10.0**-e)


@pytest.mark.parametrize("name", TABLES)
def test_tables_are_sign_consistent(name):
    table = get_table(name)
    for mags, codes, sign in [
        (table.pos_magnitudes, table.pos_codes, 1),
        (table.neg_magnitudes, table.neg_codes, -1),
    ]:
        assert np.all(np.diff(mags) > 0)
        np.testing.assert_array_equal(table.values[codes], sign * mags)
    if name != "dynamic8_bnb":  # bnb has +1.0 but no -1.0
        np.testing.assert_array_equal(table.pos_magnitudes, table.neg_magnitudes)


def _samples(mags: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random magnitudes across the table's range, plus each threshold's neighbourhood."""
    top = float(mags[-1])
    logs = 10 ** rng.uniform(-9, np.log10(top) + 0.3, 200_000)
    mids = (mags[1:] + mags[:-1]) / 2
    near = np.concatenate([np.nextafter(mags.astype(np.float32), np.float32(v)) for v in (0, 9)])
    nearmid = np.concatenate([mids * (1 + d) for d in (-1e-6, 1e-6, -1e-3, 1e-3)])
    return np.concatenate([logs, mags, near, nearmid, [0.0]]).astype(np.float32)


@pytest.mark.parametrize("name", TABLES)
def test_nearest_rounding_against_brute_force(name):
    table = get_table(name)
    rng = np.random.default_rng(0)
    mags = table.pos_magnitudes.astype(np.float64)
    a = _samples(mags, rng)
    thr, _ = table.thresholds("nearest")
    chosen = mags[np.searchsorted(thr, a, side="left")]
    distance = np.abs(a[:, None].astype(np.float64) - mags[None, :])  # (S, P)
    best = distance.min(axis=1)
    np.testing.assert_array_equal(np.abs(a - chosen), best)  # a nearest value, exactly


def _paper_rule(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The notes' closed form of the 2015 kernel, written out case by case (section 3).
    Returns the magnitude chosen for each a (absmax-normalised)."""
    out = np.empty_like(a, dtype=np.float64)
    for i, v in enumerate(a.astype(np.float64)):
        if v < np.float32(1.5e-6):
            out[i] = 0.0
        elif v > np.float32(0.995703):
            out[i] = 1.0
        elif v <= t[0]:
            out[i] = t[0]
        elif v > t[125]:
            out[i] = t[125]
        else:
            j = np.searchsorted(t, v, side="left") - 1  # t[j] < v <= t[j + 1]
            if j % 2 == 0 and j >= 2:
                out[i] = t[j]  # toward zero
            else:
                lower, upper = t[j], t[j + 1]
                out[i] = lower if v - lower <= upper - v else upper
    return out


def test_paper_rounding_matches_the_notes_rule():
    table = dynamic8_table()
    t = dynamic_tree_magnitudes().astype(np.float32).astype(np.float64)
    rng = np.random.default_rng(1)
    mags = table.pos_magnitudes.astype(np.float64)
    a = _samples(mags, rng)
    a = a[a <= 1][::7]  # the loop is slow; a fifth of the samples
    thr, _ = table.thresholds("paper")
    ours = mags[np.searchsorted(thr, a, side="left")]
    np.testing.assert_array_equal(ours, _paper_rule(a, t))


def test_paper_rounding_is_coarser_than_nearest():
    """The kernel's rounding raises the error (the notes: MSE about x2.5 over a cell)."""
    table = dynamic8_table()
    a = np.random.default_rng(2).uniform(0, 1, 200_000).astype(np.float32)
    mags = table.pos_magnitudes.astype(np.float64)
    errors = {}
    for rounding in ("nearest", "paper"):
        thr, _ = table.thresholds(rounding)
        errors[rounding] = np.mean((a - mags[np.searchsorted(thr, a)]) ** 2)
    assert 2.0 < errors["paper"] / errors["nearest"] < 3.0


@pytest.mark.parametrize("name", TABLES)
@pytest.mark.parametrize("rounding", ["nearest", "paper"])
def test_bit_pattern_lookup_equals_searchsorted(name, rounding):
    """The fast encoder (one gather by float bit pattern) equals a binary search, bit for
    bit, on values at and around every threshold and across the whole float range."""
    if name == "dynamic8_bnb" and rounding == "paper":
        with pytest.raises(ValueError, match="nearest"):
            get_table(name).thresholds(rounding)
        return
    table = kernels.lookup(name, rounding, torch.device("cpu"))
    thr = table.pos_thresholds.numpy()
    probes = np.concatenate(
        [thr, np.nextafter(thr, np.float32(0)), np.nextafter(thr, np.float32(2))]
    )
    rng = np.random.default_rng(3)
    randoms = (10 ** rng.uniform(-45, 2, 100_000)).astype(np.float32)
    a = torch.from_numpy(np.concatenate([probes, randoms, [0, 1, 2, 1e30]]).astype(np.float32))
    x = torch.cat([a, -a])
    scales = torch.ones(1, 1)
    fast = kernels._encode_blocks(
        x.view(1, -1),
        scales,
        table.entries,
        **table.static,
    )[0]
    reference = kernels.encode_reference(x, scales, table, None)
    torch.testing.assert_close(fast.view(torch.uint8).view(-1), reference, rtol=0, atol=0)
