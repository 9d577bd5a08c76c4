"""Suite `codecs_transfer`: time to move a message between two hosts, raw or 8-bit (Figure 6).

Two emulated hosts (`shared/tools/testnet up 2 RATE`: network namespaces joined by a link
limited to RATE both ways) run one process each, a torch.distributed gloo pair. Host 0
sends messages of 10k to 64M float32 values to host 1, 20 times each after a warm-up:

- raw:             send the float32 tensor;
- 8-bit:           encode (dynamic8, absmax per tensor), send codes + scale, decode;
- 8-bit pipelined: the same in chunks of 1M values, encoding chunk k + 1 while chunk k is
                   on the wire and decoding chunk k while k + 1 arrives.

Each repetition starts at a barrier and ends when host 0 receives a one-byte
acknowledgement sent after host 1 has the message (decoded): the time includes one small
message's latency for every variant alike. Both processes use one thread. The receiver
checks once per size that what it decoded is exactly decode(encode(x)).

Target: 8-bit >= 3.5x faster than raw from 1M values on (the paper: about 2x), and never
slower at 10k; measured at 1 Gbit/s and at 10 Gbit/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaleout.bench import Row, SuiteResult, register_suite
from scaleout.comm import destroy_distributed, join_group

SIZES = [10_000, 100_000, 1_000_000, 4_000_000, 16_000_000, 64_000_000]
REPS = int(os.environ.get("SCALEOUT_BENCH_CODECS_REPS", 20))
RATES = ["1gbit", "10gbit"]
CHUNK = 1 << 20
MODES = ["raw", "8-bit", "8-bit pipelined"]
PORT = 29517


def testnet_path() -> Path:
    default = Path(__file__).resolve().parents[4] / "shared" / "tools" / "testnet"
    return Path(os.environ.get("SCALEOUT_TESTNET", default))


# --- the two processes --------------------------------------------------------------------


def _send(mode: str, x: torch.Tensor, codec) -> None:  # noqa: ANN001 - a Codec
    from scaleout.compress.payload import pack

    if mode == "raw":
        dist.send(x, 1)
        return
    chunk = CHUNK if mode == "8-bit pipelined" else x.numel()
    works = [dist.isend(pack(codec.encode(part)), 1) for part in x.split(chunk)]
    for work in works:
        work.wait()


def _receive(mode: str, out: torch.Tensor, codec, templates: list) -> list[torch.Tensor]:  # noqa: ANN001
    """Receive one message (into `out` if raw); `templates`: one Encoded per chunk."""
    from scaleout.compress.payload import packed_size, unpack

    if mode == "raw":
        dist.recv(out, 0)
        return [out]
    buffers = [torch.empty(packed_size(t), dtype=torch.uint8) for t in templates]
    works = [dist.irecv(buffer, 0) for buffer in buffers]
    decoded = []
    for work, buffer, template in zip(works, buffers, templates, strict=True):
        work.wait()
        decoded.append(codec.decode(unpack(buffer, template)))
    return decoded


def _templates(mode: str, n: int, codec) -> list:  # noqa: ANN001
    """The layout of each chunk's payload, known to the receiver in advance."""
    chunk = CHUNK if mode == "8-bit pipelined" else n
    return [codec.encode(torch.zeros(min(chunk, n - start))) for start in range(0, n, chunk)]


def worker(rank: int, master: str, port: int, out: Path, sizes: list[int], reps: int) -> None:
    from scaleout.compress import get, kernels

    with kernels.compiling("always"):  # small messages too: the latency matters here
        _exchange(rank, master, port, out, sizes, reps, get("dynamic8"))


def _exchange(
    rank: int,
    master: str,
    port: int,
    out: Path,
    sizes: list[int],
    reps: int,
    codec,  # noqa: ANN001
) -> None:

    torch.set_num_threads(1)
    join_group(rank, 2, master, port, backend="gloo")
    ack = torch.zeros(1, dtype=torch.uint8)
    times: dict[str, dict[int, list[float]]] = {mode: {} for mode in MODES}
    try:
        for n in sizes:
            x = torch.randn(n, generator=torch.Generator().manual_seed(n))
            received = torch.empty(n)
            for mode in MODES:
                times[mode][n] = []
                templates = _templates(mode, n, codec) if mode != "raw" else []
                for rep in range(reps + 1):
                    dist.barrier()
                    start = time.perf_counter()
                    if rank == 0:
                        _send(mode, x, codec)
                        dist.recv(ack, 1)
                    else:
                        parts = _receive(mode, received, codec, templates)
                        dist.send(ack, 0)
                        if rep == 0 and mode != "raw":  # exact, outside the timing
                            expected = (
                                codec.roundtrip(x)
                                if mode == "8-bit"
                                else torch.cat([codec.roundtrip(p) for p in x.split(CHUNK)])
                            )
                            assert torch.equal(torch.cat(parts), expected), (mode, n)
                    if rep:
                        times[mode][n].append(time.perf_counter() - start)
        if rank == 0:
            out.write_text(json.dumps(times))
    finally:
        destroy_distributed()


# --- the driver ---------------------------------------------------------------------------


def run_pair(rate: str, sizes: list[int], reps: int) -> dict[str, dict[str, list[float]]]:
    """Bring up two hosts at `rate`, run the pair, always take the network down."""
    testnet = str(testnet_path())
    env = {**os.environ, "TESTNET_PREFIX": f"cq{os.getpid() % 10000}", "GLOO_SOCKET_IFNAME": "eth0"}
    subprocess.run([testnet, "up", "2", rate], check=True, env=env, capture_output=True)
    try:
        master = subprocess.run(
            [testnet, "addr", "0"], check=True, env=env, capture_output=True, text=True
        ).stdout.strip()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            args = ["--master", master, "--port", str(PORT), "--out", str(out), "--reps", str(reps)]
            args += ["--sizes", *map(str, sizes)]
            command = [sys.executable, "-m", __name__, *args]
            procs = [
                subprocess.Popen(
                    [testnet, "exec", str(rank), *command, "--rank", str(rank)], env=env
                )
                for rank in (0, 1)
            ]
            try:
                codes = [proc.wait(timeout=1800) for proc in procs]
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
            if any(codes):
                raise RuntimeError(f"transfer workers failed at {rate}: exit codes {codes}")
            return json.loads(out.read_text())
    finally:
        subprocess.run([testnet, "down"], env=env, capture_output=True)


def label(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k"


def rows_for(rate: str, times: dict[str, dict[str, list[float]]]) -> list[Row]:
    rows = []
    for n in SIZES:
        medians = {mode: statistics.median(times[mode][str(n)]) for mode in MODES}
        for mode in MODES:
            ms = 1e3 * medians[mode]
            rows.append(Row(f"transfer {rate} {label(n)} floats {mode}", ms, "ms", "lower"))
        for mode in MODES[1:]:
            target = 3.5 if n >= 1_000_000 else (1.0 if n == SIZES[0] else None)
            speedup = medians["raw"] / medians[mode]
            paper = 2.0 if n >= 250_000 else None
            name = f"transfer {rate} {label(n)} speed-up {mode} vs raw"
            rows.append(Row(name, speedup, "x", "higher", paper, target))
    return rows


def plot(results: dict[str, dict], ax) -> None:  # noqa: ANN001 - a matplotlib axis
    for rate, times in results.items():
        for mode, style in zip(MODES, ("-", "--", ":"), strict=True):
            ms = [1e3 * statistics.median(times[mode][str(n)]) for n in SIZES]
            ax.plot(SIZES, ms, style, marker="o", label=f"{rate} {mode}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message size (float32 values)")
    ax.set_ylabel("median transfer time (ms)")
    ax.set_title("Figure 6: transfer time, raw vs 8-bit")
    ax.legend(fontsize=6)


def measure() -> tuple[list[Row], list[str], dict]:
    if not testnet_path().exists() or os.geteuid() != 0:
        note = f"transfer skipped: needs root and {testnet_path()} (set SCALEOUT_TESTNET)"
        return [], [note], {}
    results = {rate: run_pair(rate, SIZES, REPS) for rate in RATES}
    rows = [row for rate in RATES for row in rows_for(rate, results[rate])]
    notes = [
        f"two testnet hosts (network namespaces, tc tbf both ways) at {', '.join(RATES)}; one "
        f"gloo process per host, 1 thread each; median of {REPS} repetitions after a warm-up; "
        "each includes a 1-byte acknowledgement; 8-bit = dynamic8 per tensor (pipelined: "
        f"chunks of {CHUNK:,} values, one absmax each).",
        "Both hosts share this machine's 2 cores (and other engineers' jobs): encode and "
        "decode compete for them, which a real pair of machines would not.",
    ]
    return rows, notes, results


@register_suite("codecs_transfer", "8-bit paper Figure 6: transfer time raw vs 8-bit, 2 hosts")
def run() -> SuiteResult:
    rows, notes, results = measure()

    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        plot(results, ax)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    return SuiteResult(rows, plot=draw, notes=notes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one side of the transfer benchmark")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    a = parser.parse_args()
    worker(a.rank, a.master, a.port, a.out, a.sizes, a.reps)
