"""Suite `codecs_speed`: nanoseconds per number to encode and decode (paper section 4.2).

dynamic8 on 1M and 16M values, float32 and bfloat16 input, one thread and all threads:
encode with a fresh absmax (the scale costs a second read), encode with a cached scale
(`refresh_every=50`, the paper's remedy for the absmax's cost), decode. Beside them, in the
same run: a plain copy of the tensor (the memory-bandwidth limit), a 256-way binary search
(`searchsorted`, what the closed-form lookup replaces), the same kernels run eagerly
(without torch.compile), and bitsandbytes' CPU `quantize_blockwise` /
`dequantize_blockwise` when it is installed (it is not a dependency).

Targets (the paper's GTX Titan figures): encode <= 1.0 ns, decode <= 0.5 ns per number on
one thread; >= 3x faster than bitsandbytes on the CPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from scaleout.bench import Row, SuiteResult, register_suite
from scaleout.compress import Codec, get, kernels

SIZES = {"1M": 1 << 20, "16M": 1 << 24}
BNB_BLOCK = 4096


def ns_per_number(fn: Callable[[], object], n: int, min_seconds: float = 0.5) -> float:
    """Fastest of repeated calls (after a warm-up, which also compiles), in ns per value.
    The minimum is the least disturbed by other work on a shared machine."""
    fn()
    best, start, calls = float("inf"), time.perf_counter(), 0
    while calls < 3 or (time.perf_counter() - start < min_seconds and calls < 50):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        calls += 1
    return 1e9 * best / n


def bitsandbytes_functions() -> tuple[Callable, Callable] | None:
    try:
        import bitsandbytes.functional as bnb  # optional: not a dependency
    except Exception:  # noqa: BLE001 - absent, or present but unable to load on this machine
        return None
    return bnb.quantize_blockwise, bnb.dequantize_blockwise


def measure() -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    bnb = bitsandbytes_functions()
    if bnb is None:
        notes.append("bitsandbytes is not installed: its column is skipped")
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    fresh = get("dynamic8")
    table = kernels.lookup("dynamic8", "nearest", torch.device("cpu"))
    try:
        for num_threads in sorted({1, cores}):
            torch.set_num_threads(num_threads)
            for size, n in SIZES.items():
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
                    tag = f"{size} {str(dtype).removeprefix('torch.')} {num_threads} thread(s)"
                    rows += codec_rows(x, tag, one=num_threads == 1)
                    if bnb is not None:
                        rows += bitsandbytes_rows(bnb, x, tag, rows)
            rows += slow_path_rows(fresh, table, f"1M float32 {num_threads} thread(s)")
    finally:
        torch.set_num_threads(threads)
    notes += [
        "dynamic8, one absmax per tensor, nearest rounding; fastest of repeated calls "
        "(>= 3, >= 0.5 s) after a warm-up that also compiles (torch.compile, inductor C++).",
        f"bitsandbytes: quantize_blockwise/dequantize_blockwise, blocksize {BNB_BLOCK}, its "
        "CPU kernels; speed-up rows = its ns/number over ours with the same blocks "
        "(target >= 3).",
    ]
    return rows, notes


def codec_rows(x: torch.Tensor, tag: str, one: bool) -> list[Row]:
    """Encode (fresh and cached scale) and decode of `x`, per tensor and in blocks of
    `BNB_BLOCK` (as bitsandbytes), and a plain copy."""
    fresh, blocked = get("dynamic8"), get("dynamic8", block_size=BNB_BLOCK)
    cached = get("dynamic8", refresh_every=50)
    encoded, encoded_blocks = fresh.encode(x), blocked.encode(x)
    figures = {
        "encode": (lambda: fresh.encode(x), 1.0),
        "encode, cached scale": (lambda: cached.encode(x, key=0), 1.0),
        "decode": (lambda: fresh.decode(encoded), 0.5),
        f"encode, blocks of {BNB_BLOCK}": (lambda: blocked.encode(x), 1.0),
        f"decode, blocks of {BNB_BLOCK}": (lambda: blocked.decode(encoded_blocks), 0.5),
        "plain copy": (x.clone, None),
    }
    rows = []
    for what, (fn, paper) in figures.items():
        target = paper if one else None  # the paper's figures are per GPU thread pool
        value = ns_per_number(fn, x.numel())
        rows.append(Row(f"{what} {tag}", value, "ns/number", "lower", paper, target))
    return rows


def slow_path_rows(codec: Codec, table: kernels.Lookup, tag: str) -> list[Row]:
    """What the compiled lookup replaces: a binary search, and the same kernels uncompiled."""
    x = torch.randn(SIZES["1M"])
    scales = x.abs().amax().view(1, 1)
    rows = []
    reference = ns_per_number(lambda: kernels.encode_reference(x, scales, table, None), x.numel())
    rows.append(Row(f"encode by searchsorted (reference) {tag}", reference, "ns/number", "lower"))
    with kernels.compiling("never"):
        encoded = codec.encode(x)
        for what, fn in (
            ("encode, eager kernels", lambda: codec.encode(x)),
            ("decode, eager kernels", lambda: codec.decode(encoded)),
        ):
            rows.append(Row(f"{what} {tag}", ns_per_number(fn, x.numel()), "ns/number", "lower"))
    return rows


def bitsandbytes_rows(
    bnb: tuple[Callable, Callable], x: torch.Tensor, tag: str, ours: list[Row]
) -> list[Row]:
    quantize, dequantize = bnb
    n = x.numel()
    codes, state = quantize(x, blocksize=BNB_BLOCK)
    encode = ns_per_number(lambda: quantize(x, blocksize=BNB_BLOCK), n)
    decode = ns_per_number(lambda: dequantize(codes, state), n)
    by_name = {row.name: row.value for row in ours}
    rows = []
    for what, theirs in (("encode", encode), ("decode", decode)):
        rows.append(Row(f"bitsandbytes {what} {tag}", theirs, "ns/number", "lower"))
        speedup = theirs / by_name[f"{what}, blocks of {BNB_BLOCK} {tag}"]
        rows.append(Row(f"{what} speed-up vs bitsandbytes {tag}", speedup, "x", "higher", target=3))
    return rows


def plot(rows: list[Row], ax) -> None:  # noqa: ANN001 - a matplotlib axis
    """ns/number per operation, one thread, 16M values (float32), ours beside the others."""
    picks = [
        r
        for r in rows
        if r.unit == "ns/number" and "1 thread" in r.name and "16M float32" in r.name
    ]
    picks += [r for r in rows if "searchsorted" in r.name and "1 thread" in r.name]
    picks += [r for r in rows if "eager" in r.name and "1 thread" in r.name]
    ax.barh(range(len(picks)), [r.value for r in picks])
    ax.set_yticks(
        range(len(picks)), [r.name.replace(" 1 thread(s)", "") for r in picks], fontsize=6
    )
    ax.set_xscale("log")
    ax.set_xlabel("ns per number (one thread; paper GPU: encode 1.0, decode 0.5)")
    ax.set_title("encode / decode speed")


@register_suite("codecs_speed", "ns per number to encode and decode 8-bit codes (CPU)")
def run() -> SuiteResult:
    rows, notes = measure()

    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 6))
        plot(rows, ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    return SuiteResult(rows, plot=draw, notes=notes)
