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
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from scaleout.errors import DataError

__all__ = ["IDX_DTYPES", "read_idx", "write_idx"]

# dtype code -> big-endian numpy dtype, as the format stores it.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_FIX = "re-download or re-copy it (MNIST-style data sets ship as .gz IDX files)"


def _is_gz(path: Path) -> bool:
    return path.suffix == ".gz"


def _read_bytes(path: Path) -> bytes:
    """The file's (decompressed) content; I/O and gzip failures become DataError."""
    if not path.is_file():
        raise DataError(
            f"IDX file {path} does not exist; check the data directory or set data.path."
        )
    try:
        if _is_gz(path):
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(
            f"IDX file {path} is truncated or corrupted: its gzip stream cannot be read to "
            f"the end ({e}); {_FIX}."
        ) from e
    except OSError as e:
        raise DataError(f"IDX file {path} cannot be read ({e}); check its permissions.") from e


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (plain, or gzipped when the name ends in `.gz`).

    Returns a native-endian array with the shape the header declares. Raises `DataError`
    for a bad magic, an unknown dtype code, a short header, or data that is shorter or
    longer than the header says.
    """
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(
            f"IDX file {path} is truncated: it has {len(raw)} bytes, fewer than the 4-byte "
            f"magic; {_FIX}."
        )
    zero0, zero1, code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0:
        raise DataError(
            f"IDX file {path} has a bad magic number (first bytes {raw[:4].hex()}, expected "
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
    if len(raw) < header_len:
        raise DataError(
            f"IDX file {path} is truncated: its header needs {header_len} bytes for {ndim} "
            f"dimensions, found {len(raw)}; {_FIX}."
        )
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    found = len(raw) - header_len
    if found < expected:
        raise DataError(
            f"IDX file {path} is truncated: header says {expected} bytes of data, "
            f"found {found} (shape {tuple(dims)}); {_FIX}."
        )
    if found > expected:
        raise DataError(
            f"IDX file {path} has {found - expected} trailing bytes: header says {expected} "
            f"bytes of data, found {found} (shape {tuple(dims)}); {_FIX}."
        )
    data = np.frombuffer(raw, dtype=dtype, count=expected // dtype.itemsize, offset=header_len)
    # astype to native byte order also copies, so the result is writable and owns its memory.
    return data.reshape(dims).astype(dtype.newbyteorder("="))


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
