"""Check a .npy array's header against the bytes that hold it, before numpy loads it.

`np.load` trusts the header: a header declaring a huge shape makes it allocate that much
before reading a byte (a `MemoryError`, or the machine's memory gone), and a memory map of a
truncated file maps pages past its end, which kill the process with SIGBUS when an example
is read. So the header is parsed first with numpy's own reader (a bounded, literal-only
parse) and the data length it declares is compared with what the file, or the zip member of
an .npz, really holds. Any mismatch, and any array of Python objects (which loading would
unpickle), is a one-line `DataError` naming the file.
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from scaleout.errors import DataError

__all__ = ["MAX_NPZ_BYTES", "check_npy", "check_npz_members", "npy_header"]

# The most an .npz may expand to for the arrays that are read from it: the arrays are loaded
# into memory whole, so anything near this is a decompression bomb or the wrong file.
MAX_NPZ_BYTES = 8 << 30

_FIX = "re-create it with numpy.save"


def npy_header(f: BinaryIO, size: int, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype that the .npy stream `f` (`size` bytes long, positioned at its
    start) declares, read from its header alone. Raises `DataError` naming `name` when it
    is not a .npy file, holds Python objects, or holds fewer or more data bytes than its
    header declares."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise DataError(f"{name} is a version {version} .npy file, which is not read; {_FIX}")
    except DataError:
        raise
    except (ValueError, EOFError, OSError, SyntaxError, zipfile.BadZipFile) as e:
        raise DataError(f"{name} is not a readable .npy file ({e}); {_FIX}") from e
    if dtype.hasobject:
        raise DataError(
            f"{name} holds Python objects (dtype {dtype}), which loading would unpickle; "
            "save a plain numeric array"
        )
    expected = math.prod(shape) * dtype.itemsize  # Python ints: cannot overflow
    found = size - f.tell()
    if found < expected:
        raise DataError(
            f"{name} is truncated: its header declares shape {shape} of {dtype} "
            f"({expected} bytes of data), found {found}; {_FIX}"
        )
    if found > expected:
        raise DataError(
            f"{name} has {found - expected} trailing bytes: its header declares shape {shape} "
            f"of {dtype} ({expected} bytes of data), found {found}; {_FIX}"
        )
    return tuple(shape), dtype


def check_npy(path: str | os.PathLike) -> tuple[tuple[int, ...], np.dtype]:
    """Validate the .npy file at `path` (see `npy_header`) without loading it."""
    path = Path(path)
    name = f".npy file {path}"
    try:
        with open(path, "rb") as f:
            return npy_header(f, os.fstat(f.fileno()).st_size, name)
    except FileNotFoundError:
        raise DataError(f"{name} does not exist; check data.path") from None
    except OSError as e:
        raise DataError(f"{name} cannot be read ({e}); check its permissions") from e


def check_npz_members(
    archive: zipfile.ZipFile, path: Path, keys: list[str], max_bytes: int | None = None
) -> None:
    """Validate the arrays `keys` of the .npz `archive` (opened from `path`) before they are
    decompressed: each member's declared size must fit `max_bytes` in all, and its header
    must match that size. zipfile never yields more than a member's declared size, so
    these checks bound what loading expands. `max_bytes` defaults to `MAX_NPZ_BYTES`."""
    max_bytes = MAX_NPZ_BYTES if max_bytes is None else max_bytes
    members = [archive.getinfo(f"{key}.npy") for key in keys if f"{key}.npy" in archive.namelist()]
    total = sum(info.file_size for info in members)
    if total > max_bytes:
        raise DataError(
            f"{path} would expand to {total} bytes for {keys}, more than the limit of "
            f"{max_bytes} (a decompression bomb, or the wrong file); re-save it with np.savez"
        )
    for info in members:
        with archive.open(info) as f:
            npy_header(f, info.file_size, f"{path} member {info.filename}")  # type: ignore[arg-type]
