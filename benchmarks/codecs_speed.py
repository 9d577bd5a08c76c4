"""Suite `codecs_speed`: nanoseconds per number to encode and decode (paper section 4.2).

dynamic8 at every size from 64k to 64M values, float32 and bfloat16 input, one scale per
tensor and blocks of 4096 (bitsandbytes' layout), on one thread: encode with a fresh
absmax, decode into a preallocated tensor (`decode(encoded, out=...)`), and decode into a
new tensor against a clone of the input (a new tensor's first touch of its pages costs
more than decoding, so that ratio says what decoding adds). Beside them, in the same run:
bitsandbytes' CPU `quantize_blockwise` / `dequantize_blockwise` when it is installed (it
is not a dependency); its CPU decode cannot write into given memory, so the speed-up row
sets each library's fastest decode side by side (ours into `out`, its own allocating),
and a row without a target compares both allocating (there page faults bound both). At
1M values, what the C kernels replace: a binary search (`searchsorted`) and the torch
kernels, eager and compiled.

Every timing is the median of `REPEATS` samples of back-to-back calls lasting at least
`SAMPLE_S` each; the spread (max - min over the median) is in each row's name.

Targets (the paper's GTX Titan figures, and issue 15): encode <= 1.0 ns, decode <= 0.5 ns
per number; decoding into new memory <= 1.1x a clone; >= 3x faster than bitsandbytes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks import Row, SuiteResult, one_axis, register_suite
from scaleout.compress import get, kernels, native

SIZES = {"64k": 1 << 16, "256k": 1 << 18, "1M": 1 << 20, "4M": 1 << 22, "16M": 1 << 24}
SIZES["64M"] = 1 << 26
BNB_BLOCK = 4096
REPEATS = 5
SAMPLE_S = 0.05
ENCODE_NS, DECODE_NS, ALLOC_RATIO, BNB_SPEEDUP = 1.0, 0.5, 1.1, 3.0


def timing(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """ns per value: the median over `REPEATS` samples (each the mean of back-to-back
    calls for at least `SAMPLE_S`, after a warm-up call), and the spread of the samples."""
    fn()
    samples = []
    for _ in range(REPEATS):
        calls, started = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - started < SAMPLE_S:
            fn()
            calls += 1
        samples.append(1e9 * (time.perf_counter() - started) / calls / n)
    median = statistics.median(samples)
    return median, (max(samples) - min(samples)) / median


def bitsandbytes_functions() -> tuple[Callable, Callable] | None:
    try:
        import bitsandbytes.functional as bnb  # optional: not a dependency
    except Exception:  # noqa: BLE001 - absent, or present but unable to load on this machine
        return None
    return bnb.quantize_blockwise, bnb.dequantize_blockwise


def _row(what: str, figure: tuple[float, float], unit: str, target: float | None) -> Row:
    value, spread = figure
    better = "higher" if unit == "x" and target == BNB_SPEEDUP else "lower"
    paper = {ENCODE_NS: 1.0, DECODE_NS: 0.5}.get(target) if unit == "ns/number" else None
    return Row(f"{what} (spread {100 * spread:.0f}%)", value, unit, better, paper, target)


def size_rows(x: torch.Tensor, tag: str, bnb: tuple[Callable, Callable] | None) -> list[Row]:
    """Encode, decode into out, decode allocating vs a clone, per tensor and in blocks;
    bitsandbytes' blockwise functions beside the blocks."""
    n, rows = x.numel(), []
    clone = timing(x.clone, n)
    for layout, block in (("one scale", None), (f"blocks of {BNB_BLOCK}", BNB_BLOCK)):
        codec = get("dynamic8", block_size=block)
        encoded = codec.encode(x)
        out = torch.empty_like(x)
        encode = timing(lambda c=codec: c.encode(x), n)
        decode = timing(lambda c=codec, e=encoded, o=out: c.decode(e, out=o), n)
        fresh = timing(lambda c=codec, e=encoded: c.decode(e), n)
        ratio = (fresh[0] / clone[0], max(fresh[1], clone[1]))
        rows += [
            _row(f"encode {tag}, {layout}", encode, "ns/number", ENCODE_NS),
            _row(f"decode into out {tag}, {layout}", decode, "ns/number", DECODE_NS),
            _row(f"decode into new memory / clone {tag}, {layout}", ratio, "x", ALLOC_RATIO),
        ]
        if block is not None and bnb is not None:
            rows += bitsandbytes_rows(bnb, x, tag, encode, decode, fresh)
    rows.append(_row(f"clone {tag}", clone, "ns/number", None))
    return rows


def bitsandbytes_rows(
    bnb: tuple[Callable, Callable],
    x: torch.Tensor,
    tag: str,
    encode: tuple[float, float],
    decode: tuple[float, float],
    decode_new: tuple[float, float],
) -> list[Row]:
    """bitsandbytes' encode and decode of `x`, and our speed-up over them; ours (`encode`,
    `decode` into out, `decode_new` into new memory) with the same blocks."""
    quantize, dequantize = bnb
    n = x.numel()
    codes, state = quantize(x, blocksize=BNB_BLOCK)
    theirs = {  # its CPU dequantize takes no out=
        "encode": timing(lambda: quantize(x, blocksize=BNB_BLOCK), n),
        "decode": timing(lambda: dequantize(codes, state), n),
    }
    rows = []
    for what, ours in (("encode", encode), ("decode", decode)):
        rows.append(_row(f"bitsandbytes {what} {tag}", theirs[what], "ns/number", None))
        speedup = (theirs[what][0] / ours[0], max(theirs[what][1], ours[1]))
        rows.append(_row(f"{what} speed-up vs bitsandbytes {tag}", speedup, "x", BNB_SPEEDUP))
    both_new = (theirs["decode"][0] / decode_new[0], max(theirs["decode"][1], decode_new[1]))
    rows.append(
        _row(f"decode speed-up vs bitsandbytes, both into new memory {tag}", both_new, "x", None)
    )
    return rows


def replaced_rows() -> list[Row]:
    """At 1M float32 values, one scale: a binary search and the torch kernels."""
    x = torch.randn(SIZES["1M"])
    n, codec = x.numel(), get("dynamic8")
    table = kernels.lookup("dynamic8", "nearest", torch.device("cpu"))
    scales = x.abs().amax().view(1, 1)
    rows = [
        _row(
            "encode by searchsorted (reference) 1M float32",
            timing(lambda: kernels.encode_reference(x, scales, table, None), n),
            "ns/number",
            None,
        )
    ]
    with native.native_disabled():
        for mode, what in (("never", "eager"), ("always", "compiled")):
            with kernels.compiling(mode):
                encoded = codec.encode(x)
                for op, fn in (
                    ("encode", lambda: codec.encode(x)),
                    ("decode", lambda e=encoded: codec.decode(e)),
                ):
                    rows.append(
                        _row(
                            f"{op}, torch kernels {what}, 1M float32",
                            timing(fn, n),
                            "ns/number",
                            None,
                        )
                    )
    return rows


def measure() -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    bnb = bitsandbytes_functions()
    if bnb is None:
        notes.append("bitsandbytes is not installed: its rows are skipped")
    if native.library() is None:
        notes.append("the C kernels are unavailable here: these are the torch kernels")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for size, n in SIZES.items():
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
                rows += size_rows(x, f"{size} {str(dtype).removeprefix('torch.')}", bnb)
        rows += replaced_rows()
    finally:
        torch.set_num_threads(threads)
    notes += [
        "dynamic8, nearest rounding, one thread; median of "
        f"{REPEATS} samples of >= {SAMPLE_S} s of calls each.",
        f"bitsandbytes: quantize_blockwise / dequantize_blockwise, blocksize {BNB_BLOCK}, "
        "its CPU kernels; speed-up = its ns/number over ours with the same blocks (target "
        ">= 3); decode: ours into out=, its own into new memory (its CPU dequantize takes "
        "no out=), and both into new memory (no target).",
    ]
    return rows, notes


def plot(rows: list[Row], ax) -> None:  # noqa: ANN001 - a matplotlib axis
    """ns/number by size, float32 in blocks of 4096: ours, bitsandbytes', a clone."""
    series = {
        "encode": "encode {} float32, blocks of 4096",
        "decode into out": "decode into out {} float32, blocks of 4096",
        "bitsandbytes encode": "bitsandbytes encode {} float32",
        "bitsandbytes decode": "bitsandbytes decode {} float32",
        "clone": "clone {} float32",
    }
    by_name = {row.name.split(" (spread")[0]: row.value for row in rows}
    sizes = [s for s in SIZES if series["encode"].format(s) in by_name]
    for label, pattern in series.items():
        values = [by_name.get(pattern.format(s)) for s in sizes]
        if all(v is not None for v in values):
            ax.plot([SIZES[s] for s in sizes], values, marker="o", label=label)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("values per tensor")
    ax.set_ylabel("ns per number (one thread; paper GPU: encode 1.0, decode 0.5)")
    ax.legend(fontsize=7)
    ax.set_title("encode / decode speed")


@register_suite("codecs_speed", "ns per number to encode and decode 8-bit codes (CPU)")
def run() -> SuiteResult:
    rows, notes = measure()

    return SuiteResult(rows, plot=one_axis(plot, rows, (9, 6)), notes=notes)
