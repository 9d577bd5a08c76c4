"""The 8-bit codecs' CPU kernels in C (`csrc/codec8.c`), built on first use and called
through ctypes.

Why not torch.compile on the CPU: a compiled call has a large fixed cost, so below
`kernels.COMPILE_MIN_NUMEL` values (most gradients and shard pushes) the eager torch path,
several passes over memory, would run instead. The C kernels have a small fixed cost per
call and run one loop per direction at every size (with AVX-512 VBMI, the table lives in
registers and 64 codes are looked up per three instructions; elsewhere a plain loop the
compiler vectorises with gathers).

The library is compiled with the machine's C compiler (`$CC`, else `cc`; `-O3
-march=native`, never `-ffast-math`: every result must equal the torch reference bit for
bit) into `$SCALEOUT_NATIVE_DIR` (default `~/.cache/scaleout/native`), named by a hash of
the source, the flags and this CPU, so processes of one machine build it once (each
writes a temporary file and renames it into place) and machines of a cluster that share
a home directory never load one another's. Where it cannot be built or loaded the codecs
fall back to the torch kernels with one warning. `SCALEOUT_COMPRESS_NATIVE=never` (or
`native_disabled()`) turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("csrc") / "codec8.c"
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-Wall")
TUNED = ("-march=native",)  # dropped when the compiler refuses it
_MODES = ("auto", "never")
_DISABLED: list[bool] = []  # innermost `native_disabled()` last


@dataclass(frozen=True)
class Kernels:
    """The C functions by input (encode) or output (decode) dtype."""

    encode: dict[torch.dtype, Any]
    decode: dict[torch.dtype, Any]


@cache
def mode() -> str:
    """`SCALEOUT_COMPRESS_NATIVE` (read once; `reset()` reads it again)."""
    mode = os.environ.get("SCALEOUT_COMPRESS_NATIVE", "auto")
    if mode not in _MODES:
        raise ValueError(f"SCALEOUT_COMPRESS_NATIVE = {mode!r}: use 'auto' or 'never'")
    return mode


def reset() -> None:
    """Forget the loaded library and the mode (tests, or after changing the environment)."""
    mode.cache_clear()
    _load.cache_clear()


@contextmanager
def native_disabled() -> Iterator[None]:
    """Use the torch kernels inside the block (to time or test them)."""
    _DISABLED.append(True)
    try:
        yield
    finally:
        _DISABLED.pop()


def _cpu_signature() -> str:
    """This CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "scaleout" / "native"
    return Path(os.environ.get("SCALEOUT_NATIVE_DIR", default))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compile the source into `target` (atomically); None, or the compiler's complaint."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["failed"])[-1]
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> Path:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r} is not on PATH)")
    source, cpu = SOURCE.read_bytes(), _cpu_signature().encode()
    for flags in ((*FLAGS, *TUNED), FLAGS):
        command = " ".join((compiler, *flags)).encode()
        digest = hashlib.sha256(b"\0".join([source, command, cpu])).hexdigest()[:16]
        target = _cache_dir() / f"codec8-{platform.machine()}-{digest}.so"
        if target.exists():
            return target
        error = _compile(compiler, flags, target)
        if error is None:
            return target
    raise RuntimeError(f"{compiler} failed: {error}")


def _declare(lib: ctypes.CDLL) -> Kernels:
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    kernels = Kernels({}, {})
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        encode = getattr(lib, f"so_encode_{suffix}")
        encode.argtypes = [pointer, i64, i64, pointer, pointer, pointer, pointer, *[i32] * 4]
        encode.restype = ctypes.c_int
        decode = getattr(lib, f"so_decode_{suffix}")
        decode.argtypes = [pointer, i64, i64, pointer, pointer, pointer]
        decode.restype = None
        kernels.encode[dtype], kernels.decode[dtype] = encode, decode
    return kernels


@cache
def _load() -> Kernels | None:
    try:
        return _declare(ctypes.CDLL(str(_build())))
    except Exception as err:  # noqa: BLE001 - no compiler, read-only home, ...: stay correct
        warnings.warn(
            f"scaleout.compress: the C codec kernels are unavailable ({err!s:.200}); "
            "using the torch kernels (slower below 2^20 values)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def library() -> Kernels | None:
    """The loaded kernels, or None when they are turned off or cannot be built."""
    if _DISABLED or mode() == "never":
        return None
    return _load()
