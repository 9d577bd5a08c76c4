"""Fast encode/decode for the 8-bit tables: one pass over memory per direction.

On the CPU, float32 and bfloat16 go to the C kernels of `scaleout.compress.native` at every
size (the same arithmetic, bit for bit, at a smaller fixed cost per call). What follows
describes the torch kernels, which serve everything else (GPUs, float16) and the CPU where
no C compiler is available.

Encoding must find, for each magnitude a = |x| / scale, its rank among the table's
thresholds. A binary search (`searchsorted` over 128 thresholds) takes seven dependent
steps per number. Instead we index a lookup table by the top bits of a's float32 bit
pattern: for a >= 0 those bits are monotone in a, and with `shift` low bits dropped each
bin spans a relative width of at most 2^-(23 - shift). `shift` is chosen so that no bin
holds more than one threshold; each bin's int32 entry packs the threshold's low bits and
the codes below and above it, so one gather and one integer compare give the exact rank:

    entry = low_bits(threshold) | code_below << shift | code_above << (shift + 8)
    code  = code_above if low_bits(a) > low_bits(threshold) else code_below

Bins below the one of the smallest threshold all give the code of magnitude 0, so
magnitudes are clamped up to `first_bin` and only bins from there on are stored (the table
shrinks from 260 KB to 16-50 KB and mostly stays in cache). Negative inputs index a second
copy of the table, so asymmetric maps (bitsandbytes') need no special case.
`encode_reference` is the straightforward searchsorted version the tests hold this to, bit
for bit.

Decoding is a gather from the 256 values times the scale. Compiled on CPU it reads the
codes two at a time, as int16, from a table of all 65536 pairs of values (512 KB), which
halves the number of scalar gathers; with one scale for the whole tensor, the table is
scaled first (131072 multiplications) and each gather fetches two finished float32 values
as one int64. Both give exactly `values[code] * scale`.

The indices of every gather are in range by construction (magnitudes are clamped to the
table's top; codes are bytes), so the compiled kernels are built without inductor's
per-element bounds assertions (`assert_indirect_indexing`), which would add a compare and
a branch to every gather.

The kernels are plain torch functions. `torch.compile` (inductor: fused C++/OpenMP on CPU,
Triton on GPU) turns each into one loop over memory (the absmax reduction included). The
first compile on a machine is slow (inductor caches it on disk, so later processes compile
faster), and a compiled call has a fixed cost that small tensors do not repay, so by
default only tensors of at least `COMPILE_MIN_NUMEL` values use the compiled version: the
environment variable `SCALEOUT_COMPRESS_COMPILE` (`auto`, `always`, `never`) or
`compiling(mode)` choose otherwise (test suites: `never`). Any failure to compile falls
back, with a warning, to the same functions run eagerly (several passes over memory, so
slower).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from scaleout.compress import native
from scaleout.compress.tables import CodeTable, Rounding, get_table

COMPILE_MIN_NUMEL = 1 << 20
PAIRS_MIN_NUMEL = 1 << 18  # building a scaled pair table (131072 values) pays off from here
_MODES = ("auto", "always", "never")
_ABS_MASK = 0x7FFFFFFF
_EXP_ALL_ONES = 0x7F800000  # |bits| >= this: Inf or NaN


@dataclass(frozen=True)
class Lookup:
    """A table's encoder (bins over float32 bit patterns) and decoder (256 values)."""

    entries: torch.Tensor  # (2 * (num_bins - first_bin),) int32: positive, then negative bins
    values: torch.Tensor  # (256,) float32 normalised value of each code
    pair_values: torch.Tensor  # (65536, 2) float32: row lo + 256 * hi = values[lo], values[hi]
    shift: int  # bits of the float32 pattern below the bin index
    first_bin: int  # bin of the smallest threshold: smaller magnitudes are clamped up to it
    num_bins: int  # bins up to the largest magnitude's, first_bin .. num_bins - 1 stored
    top_bits: int  # bit pattern of the largest magnitude: larger inputs are clamped to it
    pos_thresholds: torch.Tensor  # (P - 1,) float32, for the reference encoder
    neg_thresholds: torch.Tensor
    pos_codes: torch.Tensor  # (P,) int64
    neg_codes: torch.Tensor

    @property
    def static(self) -> dict[str, int]:
        """The encoder's integer options (baked into its compiled kernel)."""
        return dict(
            shift=self.shift,
            first_bin=self.first_bin,
            num_bins=self.num_bins,
            top_bits=self.top_bits,
        )


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)


def _bin_entries(
    thresholds: np.ndarray, codes: np.ndarray, shift: int, first_bin: int, num_bins: int
) -> np.ndarray | None:
    """Entries for one sign, or None when some bin would hold two thresholds."""
    thr_bits = _bits(thresholds)  # ascending, as thresholds are
    starts = np.arange(first_bin, num_bins, dtype=np.int64) << shift  # each bin's first pattern
    below = np.searchsorted(thr_bits, starts, side="left")  # thresholds < bin start
    up_to_end = np.searchsorted(thr_bits, starts + (1 << shift) - 1, side="right")
    count = up_to_end - below  # thresholds inside the bin
    if count.max() > 1:
        return None
    mask = (1 << shift) - 1
    has = count == 1
    low = np.where(has, thr_bits[np.minimum(below, len(thr_bits) - 1)] & mask, mask)
    code_below = codes[below].astype(np.int64)
    code_above = np.where(has, codes[np.minimum(below + 1, len(codes) - 1)], code_below)
    return low | code_below << shift | code_above.astype(np.int64) << (shift + 8)


def _pairs(values: torch.Tensor) -> torch.Tensor:
    """(256,) -> (65536, 2): row lo + 256 * hi holds (values[lo], values[hi]), the two codes
    of an int16 read from bytes (lo, hi) on a little-endian machine."""
    return torch.stack([values.repeat(256), values.repeat_interleave(256)], dim=1)


@cache
def _lookup_cpu(table_name: str, rounding: Rounding) -> Lookup:
    table: CodeTable = get_table(table_name)
    pos_thr, neg_thr = table.thresholds(rounding)
    top = max(table.pos_magnitudes[-1], table.neg_magnitudes[-1])
    top_bits = int(_bits(top))
    for shift in range(15, 7, -1):  # the coarsest bins that separate every threshold
        num_bins = (top_bits >> shift) + 1
        first_bin = int(min(_bits(pos_thr[0]), _bits(neg_thr[0]))) >> shift
        pos = _bin_entries(pos_thr, table.pos_codes, shift, first_bin, num_bins)
        neg = _bin_entries(neg_thr, table.neg_codes, shift, first_bin, num_bins)
        if pos is not None and neg is not None:
            break
    else:  # pragma: no cover - every table here separates at shift 15
        raise AssertionError(f"{table_name}: thresholds too close for a bit-pattern lookup")
    return Lookup(
        entries=torch.from_numpy(np.concatenate([pos, neg]).astype(np.int32)),
        values=torch.from_numpy(table.values.astype(np.float32)),
        pair_values=_pairs(torch.from_numpy(table.values.astype(np.float32))),
        shift=shift,
        first_bin=first_bin,
        num_bins=num_bins,
        top_bits=top_bits,
        pos_thresholds=torch.from_numpy(pos_thr),
        neg_thresholds=torch.from_numpy(neg_thr),
        pos_codes=torch.from_numpy(table.pos_codes.astype(np.int64)),
        neg_codes=torch.from_numpy(table.neg_codes.astype(np.int64)),
    )


_LOOKUPS: dict[tuple[str, str, torch.device], Lookup] = {}


def lookup(table_name: str, rounding: Rounding, device: torch.device) -> Lookup:
    """The lookup for `table_name` with its tensors on `device` (built once, then cached)."""
    key = (table_name, rounding, device)  # a device hashes faster than its str()
    if key not in _LOOKUPS:
        cpu = _lookup_cpu(table_name, rounding)
        tensors = {
            name: getattr(cpu, name).to(device)
            for name in ("entries", "values", "pair_values", "pos_thresholds", "neg_thresholds")
        }
        _LOOKUPS[key] = Lookup(
            **tensors,
            shift=cpu.shift,
            first_bin=cpu.first_bin,
            num_bins=cpu.num_bins,
            top_bits=cpu.top_bits,
            pos_codes=cpu.pos_codes.to(device),
            neg_codes=cpu.neg_codes.to(device),
        )
    return _LOOKUPS[key]


def _split(x: torch.Tensor, block_size: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n,) -> full blocks (num_full, block_size) and the ragged tail (1, rest) or None.

    Kept apart (not zero-padded) so that the compiled kernel sees a plain 2-D view with a
    static row length; padding inside it costs a mask per element."""
    n = x.numel()
    if block_size is None or n <= block_size:
        return x.view(1, n), None
    full = n - n % block_size
    tail = x[full:].view(1, -1) if full < n else None
    return x[:full].view(-1, block_size), tail


def absmax(x: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """Per-block max |x| as float32 (num_blocks, 1); Inf and NaN propagate."""
    parts = [
        p.float().abs().amax(dim=1, keepdim=True) for p in _split(x, block_size) if p is not None
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _encode_blocks(
    blocks: torch.Tensor,
    scales: torch.Tensor | None,
    entries: torch.Tensor,
    *,
    shift: int,
    first_bin: int,
    num_bins: int,
    top_bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks (B, L) -> codes (B, L) int8, scales (B, 1) float32, count of Inf/NaN inputs.

    With `scales` None they are each block's absmax; otherwise the given (cached) scales,
    and inputs beyond them are clamped to the largest magnitude."""
    xf = blocks.float()
    num_bad = ((xf.view(torch.int32) & _ABS_MASK) >= _EXP_ALL_ONES).sum()
    if scales is None:
        scales = xf.abs().amax(dim=1, keepdim=True)
    safe = torch.where(scales > 0, scales, 1.0)  # all-zero blocks: a = 0
    bits = (xf / safe).view(torch.int32)  # sign bit, then |a| as a monotone integer
    mag = (bits & _ABS_MASK).clamp(min=first_bin << shift, max=top_bits)
    stored = num_bins - first_bin
    key = (mag >> shift) - first_bin + ((bits >> 31) & stored)  # negatives: the second table
    entry = entries[key]
    low = (1 << shift) - 1
    code = torch.where((mag & low) > (entry & low), entry >> (shift + 8), entry >> shift)
    # int8, not uint8: inductor vectorises int32 -> int8 but not int32 -> uint8.
    return (code & 0xFF).to(torch.int8), scales, num_bad


def _encode_blocks_fresh(
    blocks: torch.Tensor, entries: torch.Tensor, **static: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _encode_blocks(blocks, None, entries, **static)


def _decode_blocks(
    codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, *, dtype: torch.dtype
) -> torch.Tensor:
    """codes (B, L) uint8, scales (B, 1) -> (B, L) of `dtype`: values[code] * scale."""
    return (values[codes.to(torch.int32)] * scales).to(dtype)


def _decode_pairs(
    pairs: torch.Tensor, scales: torch.Tensor, pair_values: torch.Tensor, *, dtype: torch.dtype
) -> torch.Tensor:
    """pairs (B, L/2) int16, two codes each; scales (B, 1) -> (B, L/2, 2) of `dtype`."""
    return (pair_values[pairs.to(torch.int32) & 0xFFFF] * scales.unsqueeze(-1)).to(dtype)


def _decode_pairs_scaled(pairs: torch.Tensor, pair_bits: torch.Tensor) -> torch.Tensor:
    """pairs (1, L/2) int16 -> (1, L/2) of pair_bits' integer type: the bits of two finished
    values each (int64 for float32 values, int32 for 16-bit ones)."""
    return pair_bits[pairs.to(torch.int32) & 0xFFFF]


def encode_reference(
    x: torch.Tensor, scales: torch.Tensor, table: Lookup, block_size: int | None
) -> torch.Tensor:
    """The straightforward encoder: a binary search per value (`searchsorted`). uint8 (n,).

    x (n,), scales (num_blocks, 1): one per block of `block_size` values, or one in all."""
    n = x.numel()
    per_value = scales.view(-1).repeat_interleave(block_size or n)[:n]  # (n,)
    safe = torch.where(per_value > 0, per_value, 1.0)
    a = x.float().view(-1) / safe
    mag = a.abs()
    pos = table.pos_codes[torch.searchsorted(table.pos_thresholds, mag)]
    neg = table.neg_codes[torch.searchsorted(table.neg_thresholds, mag)]
    return torch.where(torch.signbit(a), neg, pos).to(torch.uint8)


# --- compiled versions ---------------------------------------------------------------------

_COMPILED: dict[tuple, Callable] = {}
_COMPILE_FAILED: set[str] = set()  # device types where torch.compile failed once
_MODE_OVERRIDE: list[str] = []  # innermost `compiling(mode)` last


def compile_mode() -> str:
    """`auto` (compile for tensors of >= COMPILE_MIN_NUMEL values), "always" or "never"."""
    if _MODE_OVERRIDE:
        return _MODE_OVERRIDE[-1]
    mode = os.environ.get("SCALEOUT_COMPRESS_COMPILE", "auto")
    if mode not in _MODES:
        raise ValueError(f"SCALEOUT_COMPRESS_COMPILE = {mode!r}: use 'auto', 'always' or 'never'")
    return mode


@contextmanager
def compiling(mode: str) -> Iterator[None]:
    """Use compile mode `mode` inside the block (e.g. "never" to time the eager kernels)."""
    if mode not in _MODES:
        raise ValueError(f"compile mode {mode!r}: use 'auto', 'always' or 'never'")
    _MODE_OVERRIDE.append(mode)
    try:
        yield
    finally:
        _MODE_OVERRIDE.pop()


def _use_compiled(x: torch.Tensor) -> bool:
    mode = compile_mode()
    if mode == "never" or x.device.type in _COMPILE_FAILED:
        return False
    return mode == "always" or x.numel() >= COMPILE_MIN_NUMEL


def _run(
    name: str,
    fn: Callable,
    static: dict,
    x: torch.Tensor,
    *args: torch.Tensor,
    compiled: bool | None = None,
) -> Any:
    """fn(x, *args, **static), compiled once per (name, static options) when worthwhile
    (`compiled` None: decided by `_use_compiled(x)`)."""
    if not (_use_compiled(x) if compiled is None else compiled):
        return fn(x, *args, **static)
    key = (name, tuple(sorted(static.items())))
    if key not in _COMPILED:

        def kernel(*tensors: torch.Tensor):  # noqa: ANN202 - static options baked in
            return fn(*tensors, **static)

        # every gather's indices are in range by construction (see the module docstring)
        options = {"assert_indirect_indexing": False}
        _COMPILED[key] = torch.compile(kernel, dynamic=True, options=options)
    try:
        # One code object serves every variant, and inductor specialises on dtype, device
        # and thread count: allow those recompiles (the default limit is 8).
        with torch._dynamo.config.patch(recompile_limit=256):
            return _COMPILED[key](x, *args)
    except Exception as err:  # noqa: BLE001 - no compiler, no Triton, ...: stay correct
        _COMPILE_FAILED.add(x.device.type)
        warnings.warn(
            f"scaleout.compress: torch.compile failed on {x.device.type} ({err!s:.200}); "
            "using the eager kernels",
            RuntimeWarning,
            stacklevel=3,
        )
        return fn(x, *args, **static)


def encode(
    x: torch.Tensor, scales: torch.Tensor | None, table: Lookup, block_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x (n,) -> codes uint8 (n,), scales float32 (num_blocks, 1), number of Inf/NaN inputs.

    `scales` None: each block's absmax, computed in the same kernel. On the CPU the C
    kernels (`scaleout.compress.native`) serve float32 and bfloat16 at every size."""
    lib = _native(x, x.dtype)
    if lib is not None:
        done = _encode_native(lib, x, scales, table, block_size)
        if done is not None:
            return done[0], done[1], 0
    static = table.static
    codes, new_scales, num_bad = [], [], 0
    row = 0
    for part in _split(x, block_size):
        if part is None:
            continue
        if scales is None:
            c, s, bad = _run("encode", _encode_blocks_fresh, static, part, table.entries)
        else:
            given = scales[row : row + part.shape[0]]
            c, s, bad = _run("encode_given", _encode_blocks, static, part, given, table.entries)
        row += part.shape[0]
        codes.append(c.view(-1))
        new_scales.append(s)
        num_bad += int(bad)
    if len(codes) == 1:
        return codes[0].view(torch.uint8), new_scales[0], num_bad
    return torch.cat(codes).view(torch.uint8), torch.cat(new_scales), num_bad


def _reads_pairs(codes: torch.Tensor, block_size: int | None) -> bool:
    """Whether to decode two codes per gather: compiled, on CPU, little-endian, at least
    `PAIRS_MIN_NUMEL` codes, and every block (and so the tail) of an even length starting at
    an even address."""
    return (
        _use_compiled(codes)
        and codes.numel() >= PAIRS_MIN_NUMEL
        and codes.device.type == "cpu"
        and sys.byteorder == "little"
        and codes.is_contiguous()
        and codes.numel() % 2 == 0
        and (block_size is None or block_size % 2 == 0)
        and codes.data_ptr() % 2 == 0
    )


_BITS_OF = {4: torch.int64, 2: torch.int32}  # bytes of one value -> integer type of a pair
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native(x: torch.Tensor, dtype: torch.dtype) -> native.Kernels | None:
    """The C kernels when they serve `x` (on the CPU, not empty) and `dtype`, else None."""
    if dtype not in _NATIVE_DTYPES or x.device.type != "cpu" or x.numel() == 0:
        return None
    return native.library()


def _float32(scales: torch.Tensor) -> torch.Tensor:
    """The num_blocks scales as contiguous float32, in whatever shape they came: the C
    kernels read only their data (and a view costs about a microsecond)."""
    if scales.dtype != torch.float32 or not scales.is_contiguous():
        scales = scales.to(torch.float32).contiguous()
    return scales


def _num_blocks(n: int, block_size: int | None) -> int:
    return 1 if block_size is None or n <= block_size else -(-n // block_size)


def _encode_native(
    lib: native.Kernels,
    x: torch.Tensor,
    scales: torch.Tensor | None,
    table: Lookup,
    block: int | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`encode` in one C loop; None when some input is Inf or NaN (the torch path counts
    and flags them)."""
    x = x.contiguous()
    n, num_blocks = x.numel(), _num_blocks(x.numel(), block)
    codes = torch.empty(n, dtype=torch.uint8)
    new_scales = torch.empty((num_blocks, 1), dtype=torch.float32)  # as returned: no view
    given = None
    if scales is not None:
        given = _float32(scales)
        assert given.numel() == num_blocks, (given.numel(), num_blocks)
    bad = lib.encode[x.dtype](
        x.data_ptr(),
        n,
        block or 0,
        None if given is None else given.data_ptr(),
        new_scales.data_ptr(),
        codes.data_ptr(),
        table.entries.data_ptr(),
        table.shift,
        table.first_bin,
        table.num_bins,
        table.top_bits,
    )
    return None if bad else (codes, new_scales)


def check_out(out: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError unless `out` can take n contiguous values of `dtype` on `device`."""
    if out.numel() != n or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"decode(out=...): out holds {out.numel()} {out.dtype} values on {out.device}; "
            f"give a tensor of {n} {dtype} values on {device}"
        )
    if not out.is_contiguous():
        raise ValueError("decode(out=...): out must be contiguous (e.g. torch.empty(n))")


def decode(
    codes: torch.Tensor,
    scales: torch.Tensor,
    table: Lookup,
    block_size: int | None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(n,) of `dtype` (a float type) from codes uint8 (n,) and scales (num_blocks, 1)
    or (num_blocks,): values[code] * scale rounded once, from float32, to `dtype`; into
    `out` (contiguous, n values of `dtype`, any shape: returned as it is) when given."""
    n = codes.numel()
    if out is not None:
        check_out(out, n, dtype, codes.device)
    lib = _native(codes, dtype)
    if lib is not None:  # no views on this path: each costs about a microsecond
        codes = codes.contiguous()
        given = _float32(scales)
        assert given.numel() == _num_blocks(n, block_size), (given.numel(), n, block_size)
        values = torch.empty(n, dtype=dtype) if out is None else out  # contiguous
        lib.decode[dtype](
            codes.data_ptr(),
            n,
            block_size or 0,
            given.data_ptr(),
            table.values.data_ptr(),
            values.data_ptr(),
        )
        return values
    values = _decode_torch(codes, scales.view(-1, 1), table, block_size, dtype)
    return values if out is None else out.view(-1).copy_(values)


def _decode_torch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    table: Lookup,
    block_size: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    pairs = _reads_pairs(codes, block_size) and dtype.itemsize in _BITS_OF
    static = {"dtype": dtype}
    out, row = [], 0
    for part in _split(codes, block_size):
        if part is None:
            continue
        given = scales[row : row + part.shape[0]]
        row += part.shape[0]
        if not pairs:
            values = _run("decode", _decode_blocks, static, part, given, table.values)
        elif part.shape[0] == 1:  # one scale: scale the table, then fetch finished pairs
            finished = (table.pair_values * given).to(dtype)  # (65536, 2)
            pair_bits = finished.view(_BITS_OF[dtype.itemsize]).view(-1)
            two = part.view(torch.int16)  # (1, L/2): two codes each
            values = _run(
                "decode_pairs_scaled", _decode_pairs_scaled, {}, two, pair_bits, compiled=True
            )
            values = values.view(dtype)
        else:
            two = part.view(torch.int16)  # (B, L/2)
            values = _run(
                "decode_pairs", _decode_pairs, static, two, given, table.pair_values, compiled=True
            )
        out.append(values.view(-1))
    return out[0] if len(out) == 1 else torch.cat(out)
