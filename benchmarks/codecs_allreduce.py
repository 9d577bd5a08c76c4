"""Suite `codecs_allreduce`: DDP's gradient bucket averaged over two hosts, raw or 8-bit.

The collective counterpart of `codecs_transfer` (same testnet hosts, gloo pair, fillers and
link measurement): a bucket of 10k to 16M float32 values averaged over the two hosts,

- raw:   `all_reduce` of the float32 bucket (DDP's own);
- 8-bit: what `scaleout.compress.ddp_hook` does with dynamic8: encode, pack, one
         all-gather of the payloads, decode both and average them in rank order;
- auto:  what the hook does with `[compress] link` set (`OnLink.encodes_allreduce`): raw or
         8-bit, from the link measured between the hosts and the codec's cost, measured on
         both and agreed (`OnLink.agree`: each term's slower host).

Each repetition starts at a barrier, after an untimed filler all-reduce that empties both
links' token buckets, and ends when this host has the average; every repetition runs the
three modes in an order drawn for it, and a speed-up is the median over repetitions of
raw's time over the mode's. Both hosts check once per size that the average is exact:
the mean of the values (raw) or of their round trips (8-bit).

Target (auto, the mode a user gets): never slower than raw. Where it chose 8 bits, its
speed-up over raw is >= 1.0x; where it chose raw, it runs raw's very operation (their ratio
is the noise of two runs of one thing), so the choice is judged instead: 8-bit's speed-up
there is <= 1.0x.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import Row, SuiteResult, one_axis, register_suite
from benchmarks.codecs_transfer import (
    FILLER_BYTES,
    MIN_REPS,
    RATES,
    REPS,
    label,
    main,
    measured_link,
    missing,
    run_pair,
    speed_note,
)
from scaleout.comm import destroy_distributed, join_group
from scaleout.compress.link import TIMED_SIZES, average_8bit

SIZES = [10_000, 100_000, 1_000_000, 4_000_000, 16_000_000]
MODES = ["raw", "8-bit", "auto"]
BUDGET_S = 3.0  # raw's share per size: fewer repetitions where raw takes longer


def _coded(mode: str, numel: int, codec: Any) -> bool:  # noqa: ANN401 - an OnLink
    return mode == "8-bit" or (mode == "auto" and codec.encodes_allreduce(numel, 2))


def _average(mode: str, x: torch.Tensor, codec: Any) -> torch.Tensor:  # noqa: ANN401
    if _coded(mode, x.numel(), codec):
        return average_8bit(x, codec)
    out = x.clone()
    dist.all_reduce(out)
    return out.div_(2)


def _one(mode: str, x: torch.Tensor, codec: Any) -> tuple[float, torch.Tensor]:  # noqa: ANN401
    filler = torch.zeros(FILLER_BYTES // 4)
    dist.all_reduce(filler)
    dist.barrier()
    start = time.perf_counter()
    average = _average(mode, x, codec)
    return time.perf_counter() - start, average


def _reps(n: int, link: Any, reps: int) -> int:  # noqa: ANN401 - a LinkSpeed
    each = 2 * link.seconds(4 * n) + link.seconds(FILLER_BYTES)
    return max(MIN_REPS, min(25 * reps, int(BUDGET_S / each)))


def worker(rank: int, master: str, port: int, out: Path, sizes: list[int], reps: int) -> None:
    from scaleout.compress import OnLink, get

    torch.set_num_threads(1)
    join_group(rank, 2, master, port, backend="gloo")
    times: dict[str, dict[int, list[float]]] = {mode: {} for mode in MODES}
    try:
        link, _ = measured_link(rank)
        codec = OnLink(get("dynamic8"), link)
        codec.agree()
        assert codec.speed is not None
        for n in sizes:
            x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * n + rank))
            others = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * n + r))
                      for r in range(2)]  # fmt: skip
            exact = (others[0] + others[1]) / 2
            rounded = (codec.roundtrip(others[0]) + codec.roundtrip(others[1])) / 2
            for mode in MODES:
                times[mode][n] = []
            for rep in range(_reps(n, link, reps) + 1):
                for mode in random.Random(rep).sample(MODES, len(MODES)):
                    seconds, average = _one(mode, x, codec)
                    if rep:
                        times[mode][n].append(seconds)
                    else:  # exact, outside the timing
                        expected = rounded if _coded(mode, n, codec) else exact
                        torch.testing.assert_close(average, expected, rtol=1e-6, atol=1e-6)
        if rank == 0:
            chosen = {str(n): codec.encodes_allreduce(n, 2) for n in sizes}
            link_fields = {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s}
            assert codec.timed is not None
            record = {"times": times, "encoded": chosen, "speed": codec.speed.to_dict()}
            out.write_text(json.dumps({**record, "link": link_fields, "timed": codec.timed}))
    finally:
        destroy_distributed()


def rows_for(rate: str, result: dict[str, Any]) -> list[Row]:
    times, rows = result["times"], []
    for n in SIZES:
        key = str(n)
        for mode in MODES:
            samples = times[mode][key]
            median = statistics.median(samples)
            spread = (max(samples) - min(samples)) / median
            name = f"allreduce {rate} {label(n)} floats {mode} (spread {spread:.0%}, "
            rows.append(Row(f"{name}{len(samples)} reps)", 1e3 * median, "ms", "lower"))
        encoded = result["encoded"][key]
        for mode in MODES[1:]:
            pairs = zip(times["raw"][key], times[mode][key], strict=True)
            speedup = statistics.median(raw / ours for raw, ours in pairs)
            name = f"allreduce {rate} {label(n)} speed-up {mode} vs raw"
            if mode == "auto":
                name += f" (chose {'8-bit' if encoded else 'raw'})"
            if mode == "auto" and encoded:  # 8 bits chosen: at least as fast as raw
                rows.append(Row(name, speedup, "x", "higher", None, 1.0))
            elif mode == "8-bit" and not encoded:  # raw chosen (auto is raw): was it right?
                name += ", where auto chose raw"
                rows.append(Row(name, speedup, "x", "lower", None, 1.0))
            else:
                rows.append(Row(name, speedup, "x", "higher"))
    return rows


def plot(results: dict[str, dict], ax: Any) -> None:  # noqa: ANN401 - a matplotlib axis
    for rate, result in results.items():
        for mode, style in zip(MODES, ("-", "--", "-."), strict=True):
            ms = [1e3 * statistics.median(result["times"][mode][str(n)]) for n in SIZES]
            ax.plot(SIZES, ms, style, marker="o", label=f"{rate} {mode}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bucket size (float32 values)")
    ax.set_ylabel("median time to average over 2 hosts (ms)")
    ax.set_title("DDP bucket: raw all-reduce vs 8-bit all-gather")
    ax.legend(fontsize=6)


def measure() -> tuple[list[Row], list[str], dict]:
    if (lacking := missing()) is not None:
        return [], [f"all-reduce skipped: {lacking}"], {}
    results = {rate: run_pair(rate, SIZES, REPS, __name__) for rate in RATES}
    rows = [row for rate in RATES for row in rows_for(rate, results[rate])]
    speed = results[RATES[0]]["speed"]
    sizes = ", ".join(label(n) for n in TIMED_SIZES)
    timed = "; ".join(
        f"{rate}: raw "
        + "/".join(f"{1e3 * t:.2f}" for t in r["timed"][0])
        + " ms, 8-bit "
        + "/".join(f"{1e3 * t:.2f}" for t in r["timed"][1])
        + " ms"
        for rate, r in results.items()
    )
    notes = [
        f"two testnet hosts at {', '.join(RATES)}, one gloo process each (1 thread); median "
        f"of {REPS} repetitions or as many as fit {BUDGET_S:.0f} s of raw per size (at least "
        f"{MIN_REPS}); 8-bit = dynamic8 per tensor as ddp_hook sends it; auto = the hook on "
        "compress.link, choosing by both schedules as `OnLink.agree` timed them between the "
        f"hosts at {sizes} values ({timed}) with the codec measured on both (the slower's terms at "
        f"{RATES[0]}: {speed_note(speed)}). Both hosts share this machine's 2 cores.",
    ]
    return rows, notes, results


@register_suite("codecs_allreduce", "DDP bucket over 2 hosts: raw all-reduce vs 8-bit vs auto")
def run() -> SuiteResult:
    rows, notes, results = measure()

    return SuiteResult(rows, plot=one_axis(plot, results), notes=notes)


if __name__ == "__main__":
    main(worker, "one side of the all-reduce benchmark")
