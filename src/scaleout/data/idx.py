"""Read and write IDX files, the format MNIST and Fashion-MNIST ship in.

IDX (LeCun's format) is a tiny header followed by raw big-endian data:

    byte 0-1   two zero bytes
    byte 2     dtype code (0x08 uint8, 0x09 int8, 0x0B >i2, 0x0C >i4, 0x0D >f4, 0x0E >f8)
    byte 3     number of dimensions
    4 * ndim   big-endian uint32 sizes, one per dimension
    ...        the data, row-major

The format has no checksum, so the reader checks everything it can (magic, header length,
exact data length) and turns each failure into a `DataError` that says which file is bad and
what to do, instead of a reshape error deep inside numpy. Files ending in `.gz` are read and
written through gzip, since that is how the data sets are distributed.

The header is read and checked *before* the data: the reader computes the exact data length
the header declares, refuses a length that no real data set has (`MAX_IDX_BYTES`) or that the
file cannot hold, and then streams exactly that many bytes into a preallocated array. So a
gzip bomb or a wrong file costs a few bytes of reading, never its expanded size in memory.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from scaleout.errors import DataError

__all__ = ["IDX_DTYPES", "MAX_IDX_BYTES", "read_idx", "write_idx"]

# dtype code -> big-endian numpy dtype, as the format stores it.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

# The most data one IDX file may declare. MNIST's largest file holds 47 MB; anything near this
# is a corrupted header or a decompression bomb, and is refused before memory is allocated.
MAX_IDX_BYTES = 8 << 30
# Deflate expands at most ~1032:1, so a gzip file of n bytes cannot hold more than this many
# times n; a header declaring more is refused without allocating the array it declares.
_GZIP_MAX_RATIO = 1040
_TRAILING_PROBE = 4096  # bytes read past the data to report how many trailing bytes there are

_FIX = "re-download or re-copy it (MNIST-style data sets ship as .gz IDX files)"


def _is_gz(path: Path) -> bool:
    return path.suffix == ".gz"


def _read_upto(f: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes; fewer only at the end of the (decompressed) stream."""
    parts, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_into(f: BinaryIO, buffer: memoryview) -> int:
    """Fill `buffer` from `f`; the number of bytes read, short only at the end of the stream."""
    got = 0
    while got < len(buffer):
        n = f.readinto(buffer[got:])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    return got


def read_idx(path: str | os.PathLike, max_bytes: int = MAX_IDX_BYTES) -> np.ndarray:
    """Read an IDX file (plain, or gzipped when the name ends in `.gz`).

    Returns a native-endian array with the shape the header declares. Raises `DataError`
    for a missing or unreadable file, a bad magic, an unknown dtype code, a short header, a
    declared size over `max_bytes` (or more than the file can hold), or data that is shorter
    or longer than the header says. At most the declared data plus a few KiB is decompressed.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"IDX file {path} does not exist; check the data directory or set data.path."
        )
    try:
        with gzip.open(path, "rb") if _is_gz(path) else open(path, "rb") as f:
            return _read_stream(path, f, max_bytes)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(
            f"IDX file {path} is truncated or corrupted: its gzip stream cannot be read to "
            f"the end ({e}); {_FIX}."
        ) from e
    except OSError as e:
        raise DataError(f"IDX file {path} cannot be read ({e}); check its permissions.") from e


def _read_stream(path: Path, f: BinaryIO, max_bytes: int) -> np.ndarray:
    """Header, then exactly the data it declares, then a check that nothing follows."""
    magic = _read_upto(f, 4)
    if len(magic) < 4:
        raise DataError(
            f"IDX file {path} is truncated: it has {len(magic)} bytes, fewer than the 4-byte "
            f"magic; {_FIX}."
        )
    zero0, zero1, code, ndim = magic
    if zero0 != 0 or zero1 != 0:
        raise DataError(
            f"IDX file {path} has a bad magic number (first bytes {magic.hex()}, expected "
            f"0000 then a dtype code); it is not an IDX file or is corrupted, so {_FIX}."
        )
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise DataError(
            f"IDX file {path} has unknown dtype code 0x{code:02X} (known: {known}); "
            f"it is corrupted or not an IDX file, so {_FIX}."
        )
    if ndim < 1:
        raise DataError(f"IDX file {path} declares 0 dimensions; it is corrupted, so {_FIX}.")
    header_len = 4 + 4 * ndim
    sizes = _read_upto(f, 4 * ndim)
    if len(sizes) < 4 * ndim:
        raise DataError(
            f"IDX file {path} is truncated: its header needs {header_len} bytes for {ndim} "
            f"dimensions, found {4 + len(sizes)}; {_FIX}."
        )
    dims = struct.unpack(f">{ndim}I", sizes)
    dtype = IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize  # Python ints: cannot overflow
    shape = f"shape {tuple(dims)}"
    if expected > max_bytes:
        raise DataError(
            f"IDX file {path} declares {expected} bytes of data ({shape}, {dtype.name}), more "
            f"than the limit of {max_bytes}; its header is corrupted or it is not a data set "
            f"file, so {_FIX}."
        )
    on_disk = path.stat().st_size
    if not _is_gz(path):  # the file size tells the data length before anything is read
        found = on_disk - header_len
        _check_length(path, expected, found, shape)
    elif expected > _GZIP_MAX_RATIO * on_disk + (1 << 16):
        raise DataError(
            f"IDX file {path} is truncated: header says {expected} bytes of data ({shape}), "
            f"more than a {on_disk}-byte gzip file can hold; {_FIX}."
        )
    native = dtype.newbyteorder("=")
    data = np.empty(dims, dtype=native)  # filled with the file's big-endian bytes, then swapped
    found = _read_into(f, memoryview(data.reshape(-1).view(np.uint8)))
    if found < expected:
        _check_length(path, expected, found, shape)
    extra = len(_read_upto(f, _TRAILING_PROBE + 1))  # bounded: a bomb is not expanded
    if extra > _TRAILING_PROBE:
        raise DataError(
            f"IDX file {path} has more than {_TRAILING_PROBE} trailing bytes: header says "
            f"{expected} bytes of data ({shape}) and more follow; {_FIX}."
        )
    _check_length(path, expected, expected + extra, shape)
    if not dtype.isnative:
        data.byteswap(inplace=True)
    return data


def _check_length(path: Path, expected: int, found: int, shape: str) -> None:
    """DataError when the data is shorter or longer than the header declares."""
    if found < expected:
        raise DataError(
            f"IDX file {path} is truncated: header says {expected} bytes of data, "
            f"found {found} ({shape}); {_FIX}."
        )
    if found > expected:
        raise DataError(
            f"IDX file {path} has {found - expected} trailing bytes: header says {expected} "
            f"bytes of data, found {found} ({shape}); {_FIX}."
        )


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write `array` as an IDX file, gzipped when the name ends in `.gz`.

    The array's dtype must be one IDX can hold (uint8, int8, int16, int32, float32,
    float64); anything else is a `ValueError`, since silently casting would lose data.
    """
    path = Path(path)
    array = np.asarray(array)
    if array.ndim < 1 or array.ndim > 255:
        raise ValueError(f"write_idx needs an array with 1 to 255 dimensions, got {array.ndim}")
    native = array.dtype.newbyteorder("=")
    code = next((c for c, dt in IDX_DTYPES.items() if dt.newbyteorder("=") == native), None)
    if code is None:
        allowed = ", ".join(str(dt.newbyteorder("=")) for dt in IDX_DTYPES.values())
        raise ValueError(f"write_idx cannot store dtype {array.dtype}; use one of {allowed}")
    header = struct.pack(">BBBB", 0, 0, code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = np.ascontiguousarray(array, dtype=IDX_DTYPES[code]).tobytes()
    if _is_gz(path):
        with gzip.open(path, "wb") as f:
            f.write(header + payload)
    else:
        path.write_bytes(header + payload)
