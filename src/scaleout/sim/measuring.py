"""Measuring on this machine: medians of repeated calls, a fitted line, fresh processes.

The pieces every calibration step uses (`scaleout.sim.calibrate`,
`scaleout.sim.measure_compute`, `scaleout.sim.measure_calls`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from queue import Empty
from typing import Any

START_AND_STEP_S = 300.0  # a measuring process that has not answered by then failed


def timed(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """The median seconds of `fn()` over `repeats` runs after `warmup` runs."""
    from scaleout.compress.transfer import median_s  # imports torch: not at start-up

    return median_s(fn, repeats, warmup)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares `y = a + b x`; (a, b) with a >= 0 and b > 0."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    slope = max(slope, 1e-15)
    return max(mean_y - slope * mean_x, 0.0), slope


def in_processes(target: Callable[..., None], args: list[tuple], answers: int) -> list[Any]:
    """Run `target(*args[i], queue)` in fresh processes (spawned: no state of ours); the
    first `answers` values they put on the queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, queue)) for a in args]
    for proc in procs:
        proc.start()
    try:
        got: list[Any] = []
        deadline = time.monotonic() + START_AND_STEP_S
        while len(got) < answers:
            try:
                got.append(queue.get(timeout=1.0))
                continue
            except Empty:
                pass
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:  # a child that died answers nothing: say so now, not at the deadline
                raise RuntimeError(f"a measuring process exited with code {failed[0]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"measuring processes gave no answer in {START_AND_STEP_S} s")
        return got
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


class Filler:
    """A worker's compute between calls or collectives, in units of a matrix product
    (cache-bound) and a pass over 8 MB (memory-bound), as a network's layers mix them."""

    def __init__(self) -> None:
        import torch

        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        self.x = torch.randn(1_000_000)
        self.y = torch.empty_like(self.x)
        began = time.perf_counter()
        for _ in range(10):
            self.unit()
        self.unit_s = (time.perf_counter() - began) / 10

    def unit(self) -> None:
        import torch

        torch.mm(self.a, self.b)
        torch.mul(self.x, 1.0001, out=self.y)

    def run(self, seconds: float) -> None:
        for _ in range(max(1, round(seconds / self.unit_s))):
            self.unit()


class OtherCores:
    """`count` fresh processes that compute on one thread each (`Filler`) while
    `computing()` is entered, and sleep otherwise: the other replicas of a loaded machine.
    Started once (a spawn imports torch for seconds), stopped on exit."""

    def __init__(self, count: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._go = [ctx.Event() for _ in range(count)]  # one per process
        ready = [ctx.Event() for _ in range(count)]
        self._procs = [
            ctx.Process(target=_compute_while, args=(go, self._stop, r), daemon=True)
            for go, r in zip(self._go, ready, strict=True)
        ]
        for proc in self._procs:
            proc.start()
        if not all(r.wait(START_AND_STEP_S) for r in ready):
            self.close()
            raise TimeoutError(f"computing processes did not start in {START_AND_STEP_S} s")

    @contextlib.contextmanager
    def computing(self, count: int | None = None) -> Iterator[None]:
        """The first `count` of the processes (all by default) compute inside the block."""
        if count is not None and not 0 <= count <= len(self._go):
            raise ValueError(f"count must be in [0, {len(self._go)}], got {count}")
        chosen = self._go[:count]
        for go in chosen:
            go.set()
        time.sleep(0.2)  # each is computing before the block measures
        try:
            yield
        finally:
            for go in chosen:
                go.clear()

    def close(self) -> None:
        self._stop.set()
        for go in self._go:
            go.set()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> OtherCores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _compute_while(go: Any, stop: Any, ready: Any) -> None:  # noqa: ANN401 - mp Events
    import torch

    torch.set_num_threads(1)
    filler = Filler()
    ready.set()
    while not stop.is_set():
        if go.wait(0.1) and not stop.is_set():
            filler.unit()


def alone_and_together(
    work: Callable[[], float],
    rank: int,
    rounds: int,
    barrier: Any,  # noqa: ANN401 - a multiprocessing Barrier
) -> list[tuple[float, float]]:
    """In one of k processes: per round, rank 0 runs `work` alone, then all k at once;
    this process's (alone, together) seconds per round (alone is 0 but on rank 0). Both
    in the same processes, alternately: the ratio of the two is the machine's, not a
    process's memory layout (which alone can move a step's time)."""
    pairs = []
    for _ in range(rounds):
        barrier.wait()
        alone = work() if rank == 0 else 0.0
        barrier.wait()
        pairs.append((alone, work()))
    return pairs


def model_key(config: Any) -> str:  # noqa: ANN401 - a RunConfig
    """What identifies a model's compute: the model section and the data it reads."""
    model = config.model.model_dump(mode="json") if config.model is not None else None
    data = config.data.model_dump(mode="json") if config.data is not None else None
    name = data.get("dataset") if isinstance(data, dict) else None
    return f"{name}:{model}"
