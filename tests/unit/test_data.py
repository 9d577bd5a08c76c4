"""Tests for scaleout.data: IDX reading, data sets, natural-image patches, loaders."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import skimage.color
import skimage.data
import skimage.util
import torch
from torch.utils.data import TensorDataset

from scaleout.data import (
    NATURAL_IMAGES,
    ArrayDataset,
    ShuffledBatchSampler,
    SyntheticDataset,
    find_data_dir,
    load_image_idx,
    load_npz,
    make_loader,
    natural_image_patches,
    num_batches,
    read_idx,
    whiten_image,
    write_idx,
)
from scaleout.errors import DataError

REPO = Path(__file__).resolve().parents[2]
REPO_MNIST = REPO / "data" / "mnist"
SHARED = REPO.parent / "shared" / "data"
FASHION = SHARED / "fashion-mnist"

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
# ---------------------------------------------------------------- idx


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (np.uint8, (7,)),
        (np.int8, (3, 4)),
        (np.int16, (2, 3, 4)),
        (np.int32, (5, 1)),
        (np.float32, (2, 2, 2, 2)),
        (np.float64, (4, 3)),
        (np.uint8, (0, 28, 28)),
    ],
)
def test_idx_round_trip(tmp_path, dtype, shape, suffix):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    path = tmp_path / f"a.idx{suffix}"
    write_idx(path, a)
    b = read_idx(path)
    assert b.shape == a.shape
    assert b.dtype == np.dtype(dtype)
    assert b.dtype.isnative
    np.testing.assert_array_equal(a, b)
    if suffix:  # really gzipped
        assert path.read_bytes()[:2] == b"\x1f\x8b"


def _hand_built() -> tuple[bytes, np.ndarray]:
    """An int32 (2, 3) IDX file built from the spec with struct, and its values."""
    values = [[1, -2, 3], [2**31 - 1, -(2**31), 0]]
    raw = struct.pack(">BBBB", 0, 0, 0x0C, 2) + struct.pack(">II", 2, 3)
    raw += struct.pack(">6i", *[v for row in values for v in row])
    return raw, np.array(values, dtype=np.int32)


def test_idx_matches_hand_built_bytes(tmp_path):
    raw, expected = _hand_built()
    path = tmp_path / "hand.idx"
    path.write_bytes(raw)
    got = read_idx(path)
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == np.int32 and got.dtype.isnative
    got[0, 0] = 5  # a writable copy, not a view of the file buffer
    out = tmp_path / "out.idx"
    write_idx(out, expected)
    assert out.read_bytes() == raw


def _corrupt(tmp_path: Path, name: str, raw: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda raw: b"\x01" + raw[1:], "magic"),
        (lambda raw: raw[:2] + b"\x0a" + raw[3:], "dtype code 0x0A"),
        (lambda raw: raw[:2] + raw[2:3] + b"\x00" + raw[4:], "0 dimensions"),
        (lambda raw: raw[:-5], "truncated: header says 24 bytes of data, found 19"),
        (lambda raw: raw[:9], "truncated: its header needs 12 bytes"),
        (lambda raw: raw[:2], "truncated"),
        (lambda raw: raw + b"xyz", "3 trailing bytes"),
    ],
)
def test_idx_malformed_raises_data_error(tmp_path, mutate, words):
    raw, _ = _hand_built()
    path = _corrupt(tmp_path, "bad-file.idx", mutate(raw))
    with pytest.raises(DataError) as info:
        read_idx(path)
    assert str(path) in str(info.value)
    assert words in str(info.value)


def test_idx_truncated_gzip(tmp_path):
    path = tmp_path / "images.idx.gz"
    write_idx(path, np.arange(5000, dtype=np.int32).reshape(50, 100))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match="images.idx.gz is truncated or corrupted") as info:
        read_idx(path)
    assert str(path) in str(info.value)
    # A gzip stream that is complete but whose content is short is caught by the length check.
    short = tmp_path / "short.idx.gz"
    raw, _ = _hand_built()
    short.write_bytes(gzip.compress(raw[:-4]))
    with pytest.raises(DataError, match="header says 24 bytes of data, found 20"):
        read_idx(short)
    not_gz = _corrupt(tmp_path, "plain.gz", raw)
    with pytest.raises(DataError, match="plain.gz is truncated or corrupted"):
        read_idx(not_gz)


def test_idx_missing_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_idx(tmp_path / "nope.idx")


def test_write_idx_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="cannot store dtype"):
        write_idx(tmp_path / "a.idx", np.zeros(3, dtype=np.uint16))


# ---------------------------------------------------------------- MNIST / Fashion-MNIST


@pytest.fixture(scope="module")
def mnist_raw_train() -> ArrayDataset:
    return load_image_idx("mnist", "train", path=REPO_MNIST, normalize=False)


def test_mnist_train_from_repo_copy(mnist_raw_train):
    d = mnist_raw_train
    assert d.x.shape == (60000, 1, 28, 28) and d.x.dtype == torch.float32
    assert d.y.shape == (60000,) and d.y.dtype == torch.int64
    assert d.num_classes == 10 and d.input_shape == (1, 28, 28)
    assert np.bincount(d.y.numpy(), minlength=10).tolist() == MNIST_TRAIN_COUNTS
    assert float(d.x.min()) == 0.0 and float(d.x.max()) == 1.0
    x = d.x.double()
    assert abs(float(x.mean()) - 0.1307) < 1e-3
    assert abs(float(x.std()) - 0.3081) < 1e-3


def test_mnist_test_normalized():
    d = load_image_idx("mnist", "test", path=REPO_MNIST)
    assert d.x.shape == (10000, 1, 28, 28)
    assert np.bincount(d.y.numpy(), minlength=10).tolist() == MNIST_TEST_COUNTS
    raw = load_image_idx("mnist", "test", path=REPO_MNIST, normalize=False)
    torch.testing.assert_close(d.x, (raw.x - 0.1307) / 0.3081)


def test_mnist_train_normalized_default_lookup(monkeypatch, mnist_raw_train):
    monkeypatch.delenv("SCALEOUT_DATA", raising=False)
    monkeypatch.chdir(REPO)  # ./data/mnist: the project's own copy
    assert find_data_dir("mnist").resolve() == REPO_MNIST.resolve()
    d = load_image_idx("mnist", "train")
    x = d.x.double()
    assert abs(float(x.mean())) < 3e-3 and abs(float(x.std()) - 1.0) < 3e-3
    assert torch.equal(d.y, mnist_raw_train.y)


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"Fashion-MNIST not present at {FASHION}")
def test_fashion_mnist():
    train = load_image_idx("fashion_mnist", "train", path=FASHION, normalize=False)
    test = load_image_idx("fashion_mnist", "test", path=FASHION)
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert np.bincount(train.y.numpy(), minlength=10).tolist() == [6000] * 10
    assert train.num_classes == 10
    assert abs(float(train.x.double().mean()) - 0.2860) < 1e-3


def test_load_image_idx_bad_args():
    with pytest.raises(ValueError, match="split"):
        load_image_idx("mnist", "valid", path=REPO_MNIST)
    with pytest.raises(ValueError, match="data.dataset"):
        load_image_idx("cifar", "train")


# ---------------------------------------------------------------- find_data_dir


def _write_tiny_idx_set(directory: Path, n_train: int = 5, n_test: int = 3) -> None:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(
            directory / f"{prefix}-images-idx3-ubyte.gz",
            rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        )
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n, dtype=np.uint8))


def test_find_data_dir_explicit_missing(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(DataError, match="data.path") as info:
        find_data_dir("mnist", missing)
    assert str(missing) in str(info.value)


def test_find_data_dir_explicit_lacks_file(tmp_path):
    d = tmp_path / "mnist"
    _write_tiny_idx_set(d)
    (d / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        find_data_dir("mnist", d)


def test_find_data_dir_uses_env(tmp_path, monkeypatch):
    _write_tiny_idx_set(tmp_path / "fashion-mnist")
    monkeypatch.setenv("SCALEOUT_DATA", str(tmp_path))
    assert find_data_dir("fashion_mnist") == tmp_path / "fashion-mnist"
    d = load_image_idx("fashion_mnist", "test", normalize=False)
    assert d.x.shape == (3, 1, 28, 28) and d.y.tolist() == [0, 1, 2]
    expected = read_idx(tmp_path / "fashion-mnist" / "t10k-images-idx3-ubyte.gz")
    np.testing.assert_allclose(d.x[:, 0].numpy(), expected / 255.0, rtol=1e-6)
    # Plain (not gzipped) files are accepted too.
    plain = tmp_path / "plain"
    _write_tiny_idx_set(plain)
    for f in plain.iterdir():
        f.with_suffix("").write_bytes(gzip.decompress(f.read_bytes()))
        f.unlink()
    assert len(load_image_idx("mnist", "train", path=plain)) == 5


def test_find_data_dir_nothing_found(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALEOUT_DATA", str(tmp_path / "nothing"))
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    with pytest.raises(DataError, match="SCALEOUT_DATA") as info:
        find_data_dir("mnist")
    looked = str(info.value)
    assert "data.path" in looked
    assert str(tmp_path / "nothing" / "mnist") in looked
    assert str(tmp_path / "a" / "b" / "data" / "mnist") in looked


def test_find_data_dir_takes_every_root_of_the_env_in_order(tmp_path, monkeypatch):
    _write_tiny_idx_set(tmp_path / "second" / "fashion-mnist")
    _write_tiny_idx_set(tmp_path / "third" / "fashion-mnist")
    roots = [tmp_path / "first", tmp_path / "second", tmp_path / "third"]
    monkeypatch.setenv("SCALEOUT_DATA", os.pathsep.join(map(str, roots)))
    monkeypatch.chdir(tmp_path)
    assert find_data_dir("fashion_mnist") == tmp_path / "second" / "fashion-mnist"
    _write_tiny_idx_set(tmp_path / "data" / "mnist")  # ./data comes after the env's roots
    assert find_data_dir("mnist") == tmp_path / "data" / "mnist"


def test_image_label_count_mismatch(tmp_path):
    d = tmp_path / "mnist"
    _write_tiny_idx_set(d)
    write_idx(d / "train-labels-idx1-ubyte.gz", np.arange(4, dtype=np.uint8))
    with pytest.raises(DataError, match="5 images but .* 4 labels"):
        load_image_idx("mnist", "train", path=d)


# ---------------------------------------------------------------- npz


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {
        "x_train": rng.standard_normal((20, 3, 4)),
        "y_train": rng.integers(0, 5, 20),
        "x_test": rng.standard_normal((6, 3, 4)),
        "y_test": np.array([0, 1, 2, 0, 1, 1]),
    }
    arrays["y_train"][0] = 4
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    train = load_npz(path, "train")
    assert train.x.dtype == torch.float32 and train.y.dtype == torch.int64
    np.testing.assert_allclose(train.x.numpy(), arrays["x_train"].astype(np.float32))
    np.testing.assert_array_equal(train.y.numpy(), arrays["y_train"])
    assert train.num_classes == 5 and train.input_shape == (3, 4)
    test = load_npz(path, "test")
    assert len(test) == 6 and test.num_classes == 3
    custom = load_npz(path, "train", x_key="x_test", y_key="y_test")
    assert len(custom) == 6


def test_npz_errors(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.zeros((4, 2)), y_train=np.zeros(4, dtype=np.int64))
    with pytest.raises(DataError, match=r"\['x_train', 'y_train'\]") as info:
        load_npz(path, "test")
    assert "x_test" in str(info.value)
    with pytest.raises(DataError, match="does not exist"):
        load_npz(tmp_path / "missing.npz", "train")
    np.savez(path, x_train=np.zeros((4, 2)), y_train=np.zeros(3, dtype=np.int64))
    with pytest.raises(DataError, match="one label per"):
        load_npz(path, "train")
    np.savez(path, x_train=np.zeros((2, 2)), y_train=np.array([{}, {}], dtype=object))
    with pytest.raises(DataError, match="d.npz"):
        load_npz(path, "train")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="junk.npz"):
        load_npz(tmp_path / "junk.npz", "train")


# ---------------------------------------------------------------- ArrayDataset


def test_array_dataset():
    x, y = torch.randn(10, 2, 3), torch.arange(10)
    d = ArrayDataset(x, y, num_classes=10)
    assert len(d) == 10 and d.input_shape == (2, 3)
    assert torch.equal(d[3][0], x[3]) and int(d[3][1]) == 3
    bx, by = d.__getitems__([4, 1, 1])
    assert torch.equal(bx, x[[4, 1, 1]]) and by.tolist() == [4, 1, 1]
    assert ArrayDataset.collate((bx, by)) == (bx, by)
    assert len(ArrayDataset(x)[2]) == 1 and len(ArrayDataset(x).__getitems__([0, 1])) == 1
    sub = d.subset(4)
    assert len(sub) == 4 and sub.num_classes == 10 and torch.equal(sub.x, x[:4])
    with pytest.raises(DataError, match="10 inputs but 9 labels"):
        ArrayDataset(x, y[:9])


# ---------------------------------------------------------------- SyntheticDataset


def test_synthetic_deterministic():
    a = SyntheticDataset(50, (2, 5, 5), num_classes=3, seed=7)
    b = SyntheticDataset(50, (2, 5, 5), num_classes=3, seed=7)
    assert a.input_shape == (2, 5, 5) and a.num_classes == 3 and len(a) == 50
    xa, ya = a[13]
    xb, yb = b[13]
    assert xa.shape == (2, 5, 5) and xa.dtype == torch.float32 and ya.dtype == torch.int64
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    idx = [5, 0, 49, 5]
    bx, by = a.__getitems__(idx)
    assert bx.shape == (4, 2, 5, 5) and by.shape == (4,)
    assert torch.equal(bx, torch.stack([a[i][0] for i in idx]))
    assert torch.equal(by, torch.stack([a[i][1] for i in idx]))
    assert SyntheticDataset.collate((bx, by)) == (bx, by)
    c = SyntheticDataset(50, (2, 5, 5), num_classes=3, seed=8)
    assert not torch.equal(a.__getitems__(list(range(50)))[0], c.__getitems__(list(range(50)))[0])
    labels = a.__getitems__(list(range(50)))[1]
    assert set(labels.tolist()) == {0, 1, 2}
    with pytest.raises(IndexError):
        a[50]


def test_synthetic_is_learnable_across_seeds():
    """Nearest class mean fitted on one split (seed 0) classifies another (seed 1)."""
    train = SyntheticDataset(500, (1, 8, 8), num_classes=4, seed=0, signal=1.0)
    test = SyntheticDataset(500, (1, 8, 8), num_classes=4, seed=1, signal=1.0)
    x, y = train.__getitems__(list(range(500)))
    means = torch.stack([x[y == c].mean(0).flatten() for c in range(4)])  # (4, 64)
    for split in (train, test):
        xs, ys = split.__getitems__(list(range(500)))
        pred = torch.cdist(xs.flatten(1), means).argmin(1)
        assert (pred == ys).float().mean() > 0.9
    # With no signal the same classifier is at chance on fresh data.
    noise = SyntheticDataset(500, (1, 8, 8), num_classes=4, seed=1, signal=0.0)
    xs, ys = noise.__getitems__(list(range(500)))
    assert (torch.cdist(xs.flatten(1), means).argmin(1) == ys).float().mean() < 0.4


def test_synthetic_large_shape_is_lazy():
    d = SyntheticDataset(10**9, (3, 227, 227), num_classes=1000)
    x, y = d.__getitems__([0, 10**9 - 1])
    assert x.shape == (2, 3, 227, 227) and 0 <= int(y.min()) and int(y.max()) < 1000


# ---------------------------------------------------------------- patches


def test_patches_shape_variance_determinism():
    d = natural_image_patches(8, 20000, seed=3)
    assert d.x.shape == (20000, 1, 8, 8) and d.x.dtype == torch.float32 and d.y is None
    assert abs(float(d.x.double().var()) - 1.0) < 0.05
    again = natural_image_patches(8, 20000, seed=3)
    assert torch.equal(d.x, again.x)
    other = natural_image_patches(8, 20000, seed=4)
    assert not torch.equal(d.x, other.x)
    rgb = natural_image_patches(6, 10, images=["camera", "coffee"], seed=0, channels=3)
    assert rgb.x.shape == (10, 3, 6, 6)
    assert torch.equal(rgb.x[:, 0], rgb.x[:, 1]) and torch.equal(rgb.x[:, 0], rgb.x[:, 2])


def test_patches_come_from_the_whitened_image():
    d = natural_image_patches(5, 50, images=["camera"], seed=0)
    white = whiten_image(skimage.data.camera().astype(np.float64) / 255.0).astype(np.float64)
    white = (white - white.mean()) / white.std()
    windows = np.lib.stride_tricks.sliding_window_view(white, (5, 5)).reshape(-1, 25)
    for patch in d.x[:5, 0].reshape(5, 25).double().numpy():
        assert np.abs(windows - patch).max(axis=1).min() < 1e-4


def test_patches_bad_args():
    with pytest.raises(ValueError, match="data.images") as info:
        natural_image_patches(8, 10, images=["camera", "lena"])
    assert "hubble_deep_field" in str(info.value)
    with pytest.raises(ValueError, match="data.patch_size"):
        natural_image_patches(301, 10, images=["chelsea"])  # chelsea is 300 x 451
    assert len(NATURAL_IMAGES) == 11


def test_whitening_filter_gain_on_sinusoid():
    """A pure sinusoid of frequency f comes out scaled by R(f) = f exp(-(f/0.2)^4)."""
    n = 128
    yy, xx = np.mgrid[0:n, 0:n]
    for k in (3, 20, 40):
        f = k / n
        image = np.cos(2 * np.pi * k * xx / n) + 5.0  # the mean is removed
        gain = f * np.exp(-((f / 0.2) ** 4))
        np.testing.assert_allclose(whiten_image(image), gain * (image - 5.0), atol=1e-6)


def _radial_power(image: np.ndarray, f_lo: float, f_hi: float) -> float:
    image = image - image.mean()
    power = np.abs(np.fft.fft2(image)) ** 2
    fy = np.fft.fftfreq(image.shape[0])[:, None]
    fx = np.fft.fftfreq(image.shape[1])[None, :]
    f = np.hypot(fy, fx)
    return float(power[(f >= f_lo) & (f < f_hi)].mean())


def test_whitening_flattens_the_spectrum():
    for name in ("camera", "grass", "moon", "coffee"):
        raw = skimage.util.img_as_float64(getattr(skimage.data, name)())
        if raw.ndim == 3:
            raw = skimage.color.rgb2gray(raw)
        white = whiten_image(raw).astype(np.float64)
        raw_ratio = _radial_power(raw, 0.015, 0.025) / _radial_power(raw, 0.14, 0.16)
        white_ratio = _radial_power(white, 0.015, 0.025) / _radial_power(white, 0.14, 0.16)
        # Natural images fall roughly as 1/f^2 (tens to hundreds of times more power at
        # f = 0.02 than at f = 0.15); whitened, the two bands are within ~10x of each other.
        assert raw_ratio > 10.0
        assert raw_ratio > 10.0 * white_ratio
        assert abs(np.log(white_ratio)) < 0.5 * np.log(raw_ratio)


# ---------------------------------------------------------------- loader


def test_num_batches():
    assert num_batches(10, 3, drop_last=False) == 4
    assert num_batches(10, 3, drop_last=True) == 3
    assert num_batches(9, 3) == 3 and num_batches(0, 3) == 0


def test_sampler_covers_each_index_once():
    s = ShuffledBatchSampler(103, 10, seed=1, epoch=0)
    batches = list(s)
    assert len(s) == len(batches) == 11
    assert [len(b) for b in batches] == [10] * 10 + [3]
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(103))
    assert flat != list(range(103))  # shuffled
    same = [i for b in ShuffledBatchSampler(103, 10, seed=1, epoch=0) for i in b]
    assert same == flat
    epoch1 = [i for b in ShuffledBatchSampler(103, 10, seed=1, epoch=1) for i in b]
    seed2 = [i for b in ShuffledBatchSampler(103, 10, seed=2, epoch=0) for i in b]
    assert sorted(epoch1) == list(range(103)) and epoch1 != flat and seed2 != flat
    ordered = [i for b in ShuffledBatchSampler(103, 10, seed=1, shuffle=False) for i in b]
    assert ordered == list(range(103))
    dropped = list(ShuffledBatchSampler(103, 10, seed=1, drop_last=True))
    assert len(dropped) == 10 and all(len(b) == 10 for b in dropped)


def test_sampler_resume_mid_epoch():
    full = list(ShuffledBatchSampler(57, 8, seed=5, epoch=3))
    for b in range(len(full) + 1):
        tail = ShuffledBatchSampler(57, 8, seed=5, epoch=3, start_batch=b)
        assert len(tail) == len(full) - b
        assert list(tail) == full[b:]
    with pytest.raises(ValueError, match="start_batch"):
        ShuffledBatchSampler(57, 8, seed=5, start_batch=9)


def test_make_loader_batches_equal_x_indices():
    x, y = torch.randn(37, 2, 3), torch.arange(37)
    d = ArrayDataset(x, y)
    loader = make_loader(d, 8, seed=4, epoch=2, start_batch=1)
    expected = list(ShuffledBatchSampler(37, 8, seed=4, epoch=2, start_batch=1))
    batches = list(loader)
    assert len(loader) == len(batches) == len(expected) == 4
    for (bx, by), idx in zip(batches, expected, strict=True):
        assert torch.equal(bx, x[idx]) and by.tolist() == idx
    # A dataset without __getitems__ goes through default_collate and gives the same batches.
    plain = list(make_loader(TensorDataset(x, y), 8, seed=4, epoch=2, start_batch=1))
    for (bx, by), (px, py) in zip(batches, plain, strict=True):
        assert torch.equal(bx, px) and torch.equal(by, py)


def test_make_loader_validates():
    d = ArrayDataset(torch.zeros(4, 1))
    with pytest.raises(ValueError, match="train.batch_size"):
        make_loader(d, 0)
    with pytest.raises(ValueError, match="loader.workers"):
        make_loader(d, 2, workers=-1)
