"""Bad input files are refused before they are expanded, each as a one-line DataError that
names the file: gzip IDX bombs and truncated streams, Pillow decompression bombs and
truncated or corrupt images, .npy/.npz headers that do not match the bytes behind them."""

from __future__ import annotations

import gzip
import struct
import tracemalloc
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from scaleout.data import load_npz, read_idx, write_idx
from scaleout.data import npyfile as npyfile_mod
from scaleout.data.images import (
    ImageFolderDataset,
    NpyDataset,
    check_image_data,
    decode_image,
    write_image_folder,
)
from scaleout.errors import DataError, UserError

MiB = 1 << 20


def _refused(call: Callable[[], object], path: Path, *words: str, peak: int = 8 * MiB) -> str:
    """Run `call`, expect a one-line DataError naming `path` and `words`, allocating less
    than `peak` bytes on the way (numpy and bytes allocations are traced)."""
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            call()
        _, used = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert isinstance(info.value, UserError)
    assert str(path) in message, message
    assert "\n" not in message
    for word in words:
        assert word in message, message
    assert used < peak, f"{used} bytes allocated before refusing"
    return message


def _idx_header(code: int, *dims: int) -> bytes:
    return struct.pack(">BBBB", 0, 0, code, len(dims)) + struct.pack(f">{len(dims)}I", *dims)


# ---------------------------------------------------------------- IDX


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_absurd_header_is_refused_before_allocating(tmp_path, suffix):
    path = tmp_path / f"images.idx{suffix}"
    raw = _idx_header(0x0E, 2**32 - 1, 2**32 - 1) + b"\0" * 64  # 2^67 bytes of float64
    path.write_bytes(gzip.compress(raw) if suffix else raw)
    _refused(lambda: read_idx(path), path, "more than the limit of", "(4294967295, 4294967295)")


def test_idx_limit_is_enforced_from_the_header(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((60, 28, 28), dtype=np.uint8))
    assert read_idx(path).shape == (60, 28, 28)
    _refused(lambda: read_idx(path, max_bytes=1000), path, "declares 47040 bytes", "limit")


def test_idx_gzip_header_larger_than_the_stream_can_hold(tmp_path):
    # MNIST's shape, but a 60-byte gzip file: deflate cannot expand that far, so the reader
    # refuses without allocating the 47 MB the header declares.
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(_idx_header(0x08, 60000, 28, 28) + b"\0" * 100))
    _refused(lambda: read_idx(path), path, "truncated", "gzip file can hold")


def test_idx_gzip_bomb_after_the_data_is_not_expanded(tmp_path):
    # A valid 10-byte IDX followed by 256 MiB of zeros in further gzip members (a 260 KB
    # file): reading stops a few KiB past the declared data.
    path = tmp_path / "labels-idx1-ubyte.gz"
    zeros = gzip.compress(bytes(MiB), compresslevel=9)
    path.write_bytes(gzip.compress(_idx_header(0x08, 10) + bytes(range(10))) + zeros * 256)
    assert path.stat().st_size < MiB
    _refused(lambda: read_idx(path), path, "more than 4096 trailing bytes", "header says 10")


def test_idx_gzip_with_a_few_trailing_bytes_counts_them(tmp_path):
    path = tmp_path / "labels.idx.gz"
    path.write_bytes(gzip.compress(_idx_header(0x08, 3) + b"abc" + b"xyzw"))
    _refused(lambda: read_idx(path), path, "4 trailing bytes", "found 7")


def test_idx_truncated_and_corrupt_gzip(tmp_path):
    path = tmp_path / "images.idx.gz"
    rng = np.random.default_rng(0)
    write_idx(path, rng.integers(0, 256, (200, 28, 28), dtype=np.uint8))  # incompressible
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    _refused(lambda: read_idx(path), path, "truncated or corrupted", "gzip stream")
    flipped = bytearray(raw)
    flipped[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(flipped))
    _refused(lambda: read_idx(path), path, "truncated or corrupted")


def test_idx_plain_file_short_of_its_header_is_refused_from_its_size(tmp_path):
    path = tmp_path / "images.idx"
    path.write_bytes(_idx_header(0x08, 60000, 28, 28) + bytes(1000))
    _refused(lambda: read_idx(path), path, "truncated: header says 47040000", "found 1000")


# ---------------------------------------------------------------- images


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height 8-bit grey pixels but holds almost no data:
    what a decompression bomb looks like to Image.open."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


@pytest.fixture
def folder(tmp_path) -> Path:
    return write_image_folder(tmp_path / "images", num_classes=2, num_train=6, num_test=2, size=32)


def _replace(folder: Path, raw: bytes, name: str = "000003.png") -> Path:
    """Put `raw` into the training split as a later (not the first) image."""
    path = folder / "train" / "class_001" / name
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize(
    ("side", "words"),
    [
        (20000, ["too large to decode", "decompression bomb"]),  # over twice Pillow's limit
        (10000, ["has 10000 x 10000 pixels", "more than the limit of"]),  # over the limit
    ],
)
def test_image_decompression_bomb_is_refused_from_the_header(folder, side, words):
    path = _replace(folder, _png_header(side, side))
    assert path.stat().st_size < 100
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # also when warnings are errors (pytest -W error)
        _refused(lambda: decode_image(path), path, *words)
    _refused(lambda: ImageFolderDataset(folder, "train"), path, *words, peak=64 * MiB)


def test_image_bomb_limit_follows_pillow_setting(folder, monkeypatch):
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1000)  # 32x32 = 1024 is now a bomb
    path = folder / "train" / "class_000" / "000000.jpg"
    _refused(lambda: ImageFolderDataset(folder, "train"), path, "has 32 x 32 pixels", "1000")


def test_truncated_jpeg_names_the_file(folder):
    path = folder / "train" / "class_001" / "000003.jpg"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    _refused(lambda: ImageFolderDataset(folder, "train"), path, "truncated or corrupt", "re-encode")


def test_corrupt_and_unreadable_images_name_the_file(folder, tmp_path):
    garbage = _replace(folder, b"not an image at all" * 10, "000005.png")
    _refused(lambda: decode_image(garbage), garbage, "not an image Pillow can read")
    png = tmp_path / "broken.png"
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)).save(png)
    raw = bytearray(png.read_bytes())
    raw[60:200] = bytes(140)  # inside IDAT: a bad CRC or a broken zlib stream
    png.write_bytes(bytes(raw))
    _refused(lambda: decode_image(png), png, "truncated or corrupt")


def test_image_of_another_size_names_the_file(folder):
    path = folder / "train" / "class_001" / "000003.jpg"
    PIL.Image.new("RGB", (40, 30), "red").save(path)
    _refused(lambda: ImageFolderDataset(folder, "train"), path, "40x30 pixels", "data.image_size")
    assert ImageFolderDataset(folder, "train", image_size=32)[3][0].shape == (3, 32, 32)


# ---------------------------------------------------------------- .npy / .npz


@pytest.fixture
def arrays(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", 6), ("test", 2)):
        np.save(tmp_path / f"x_{split}.npy", rng.integers(0, 256, (count, 8, 8, 3), np.uint8))
        np.save(tmp_path / f"y_{split}.npy", np.arange(count) % 2)
    return tmp_path


def test_truncated_npy_is_refused_before_mapping(arrays):
    path = arrays / "x_train.npy"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])
    _refused(lambda: NpyDataset(arrays, "train"), path, "truncated", "(6, 8, 8, 3)")
    _refused(lambda: check_image_data("npy", arrays), path, "truncated")
    path.write_bytes(raw + b"extra")
    _refused(lambda: NpyDataset(arrays, "train"), path, "5 trailing bytes")


def test_npy_header_claiming_a_huge_shape_is_refused_before_allocating(arrays):
    path = arrays / "y_train.npy"
    with open(path, "wb") as f:
        header = {"descr": "<i8", "fortran_order": False, "shape": (2**40,)}
        np.lib.format.write_array_header_1_0(f, header)
        f.write(bytes(48))
    _refused(lambda: NpyDataset(arrays, "train"), path, "truncated", "(1099511627776,)")


def test_npy_of_objects_or_garbage_is_refused(arrays):
    path = arrays / "y_train.npy"
    np.save(path, np.array([1, "two", None], dtype=object), allow_pickle=True)
    _refused(lambda: NpyDataset(arrays, "train"), path, "Python objects")
    path.write_bytes(b"PK\x03\x04 not an npy file")
    _refused(lambda: NpyDataset(arrays, "train"), path, "not a readable .npy file")


def test_npz_bomb_is_refused_before_decompressing(tmp_path, monkeypatch):
    path = tmp_path / "data.npz"
    np.savez_compressed(path, x_train=np.zeros((1024, 1024)), y_train=np.zeros(1024, np.int64))
    assert path.stat().st_size < MiB  # 8 MiB of zeros
    monkeypatch.setattr(npyfile_mod, "MAX_NPZ_BYTES", 4 * MiB)
    _refused(lambda: load_npz(path, "train"), path, "would expand to", "limit of 4194304")


def test_npz_member_header_that_lies_is_refused(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, y_train=np.zeros(4, np.int64))
    with zipfile.ZipFile(path, "a") as archive, archive.open("x_train.npy", "w") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (2**31, 2**31)}
        )
        f.write(bytes(16))
    _refused(lambda: load_npz(path, "train"), path, "member x_train.npy is truncated")
