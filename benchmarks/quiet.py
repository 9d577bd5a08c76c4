"""Is this machine quiet? Two independent single-thread processes against one.

A benchmark here compares figures taken side by side, but another load on the machine
(or on its host) slows some of them and not others. Before and after every suite,
`check()` runs a compute-bound probe (a small matrix product that stays in cache, so the
ratio is about the cores and not about memory bandwidth) in two spawned processes with
one thread each: rounds of one of them alone, then both at once. On a quiet machine with
two free cores two processes do twice the work of one; below `QUIET_RATIO` times, another
load took a core for part of the time and the suite's results are marked `contended`
(`run_suite` then writes them beside the published ones, not over them).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

QUIET_RATIO = 1.8  # two processes' work over one's, below which another load was running
ROUNDS = 5
PROBE_S = 0.2  # per timed sample
SIZE = 160  # (SIZE, SIZE) float32 matrices: 100 KB each, in every core's L2


@dataclass(frozen=True)
class MachineCheck:
    ratio: float  # two processes' throughput over one's (2.0: two free cores)
    alone_s: float  # median seconds of a probe sample alone
    together_s: float  # ... while the other process ran its own
    ratios: tuple[float, ...]  # per round

    @property
    def quiet(self) -> bool:
        return self.ratio >= QUIET_RATIO

    def describe(self) -> str:
        rounds = ", ".join(f"{r:.2f}" for r in self.ratios)
        return f"2 independent 1-thread processes vs 1: {self.ratio:.2f}x (rounds {rounds})"

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "quiet": self.quiet}


def _probe(rank: int, rounds: int, barrier: Any, out: Any) -> None:  # noqa: ANN401
    """One of two processes: per round, rank 0 alone, then both; rank 0 answers its
    (alone, together) seconds per round."""
    import torch

    from scaleout.sim.measuring import alone_and_together

    torch.set_num_threads(1)
    a = torch.randn(SIZE, SIZE)
    b = torch.empty(SIZE, SIZE)

    def work(count: int) -> float:
        started = time.perf_counter()
        for _ in range(count):
            torch.mm(a, a, out=b)
        return time.perf_counter() - started

    work(20)
    count = max(1, round(20 * PROBE_S / max(work(20), 1e-6)))
    pairs = alone_and_together(lambda: work(count), rank, rounds, barrier)
    if rank == 0:
        out.put(pairs)


def check(rounds: int = ROUNDS) -> MachineCheck:
    """Measure whether two single-thread processes run at twice the speed of one."""
    import multiprocessing as mp

    from scaleout.sim.measuring import in_processes

    barrier = mp.get_context("spawn").Barrier(2)
    pairs = in_processes(_probe, [(rank, rounds, barrier) for rank in range(2)], 1)[0]
    ratios = tuple(2 * alone / together for alone, together in pairs)
    return MachineCheck(
        ratio=statistics.median(ratios),
        alone_s=statistics.median(alone for alone, _ in pairs),
        together_s=statistics.median(together for _, together in pairs),
        ratios=ratios,
    )


def wait_idle(max_s: float = 15.0, busy_cores: float = 0.15, window_s: float = 0.5) -> float:
    """Wait until the whole machine is idle (< `busy_cores` cores busy over `window_s`), at
    most `max_s`; the seconds waited. A run's processes (Ray's daemons, its workers) take
    seconds to exit after it returns, and a measurement taken meanwhile is slowed."""
    from scaleout.sim.measure_calls import measure_idle  # 0 busy cores without /proc/stat

    started = time.monotonic()
    while time.monotonic() - started < max_s and measure_idle(window_s) >= busy_cores:
        pass
    return time.monotonic() - started
