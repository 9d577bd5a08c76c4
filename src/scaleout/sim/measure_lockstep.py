"""What a lock-step collective costs after compute, beyond its back-to-back price.

`Calibration.allreduce` and `Calibration.exchange` are measured with calls back to back.
In a run the workers compute between collectives (a layer between two model-parallel
exchanges, a backward pass before DDP's all-reduce), and then a collective costs more: a
rank that finished its compute first waits for the other (two processes on two cores do
not run at one pace), and gloo's threads, asleep while the ranks computed, wake up first.
The extra grows with the compute before the call, and moves with the machine's load from
one measurement to the next, so it is measured rather than derived.

`measure_lockstep` has two gloo ranks compute for a gap (matrix products and passes over
memory on one thread, `Filler`), then call the collective, over and over: gloo's
all-reduce (sync's), or the library's model-parallel exchange (`exchange_call`: cutting,
the all-to-all, placing). Per gap and message size the extra is the mean seconds of the
collective, over both ranks, less the mean of the same collective back to back. A step's
wall time is each rank's compute plus its wait, so the mean over ranks of the waits is what
a simulated collective adds to the simulated (mean) compute before it.

A Downpour replica's calls after its compute cost more than back to back too: Ray's
threads in the replica, the raylet and the shard slept meanwhile and their caches went
cold. `measure_shard_calls_after_compute` has this process compute for a gap, then pull
from and push to a real one-shard server (waiting for the update, as back to back), over
and over; per size and gap, the pair's mean wall seconds and all-process core-seconds (the
compute's own CPU taken out) less the same pair back to back.

While other processes compute on the machine, the pair takes longer still, and more than
its share of the cores explains: its hops between processes (caller, raylet, shard) each
wait for a core to be handed over. The same pair after `SHARD_CALL_LOADED_GAP_S` of
compute, with k computing processes beside it (`OtherCores`: k = cores - 1 and k = cores),
less what processor sharing gives it (`shared_wall`: its measured cores beside those
processes, as `Machine.call` prices it), is what its `CALLS_PER_PAIR` calls waited, each
`hop_wait * k / cores` as the simulation charges it (k / cores: the busy fraction of the
cores as the call starts); `LockstepCost.hop_wait_s` is the least-squares `hop_wait`
through both points. All the pairs take turns over rounds (`measure_calls`), so that a
drift of the machine's speed touches every point alike.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from scaleout.sim.calibration import LockstepCost
from scaleout.sim.measure_calls import (
    CallCost,
    Timed,
    allreduce_call,
    exchange_call,
    gloo_pair,
    measure_calls,
    measure_idle,
    on_two_ranks,
    shard_round_trip,
)
from scaleout.sim.measuring import Filler, OtherCores

COLLECTIVES = {"allreduce": allreduce_call, "exchange": exchange_call}

LOCKSTEP_SIZES = (1_000, 300_000)  # values all-reduced (4 KB, 1.2 MB)
LOCKSTEP_GAPS_S = (1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3)
SHARD_CALL_GAPS_S = (2e-3, 8e-3, 32e-3)  # a small model's step to a big one's window
SHARD_CALL_LOADED_GAP_S = 8e-3  # the loaded pair's compute before it
CALLS_PER_PAIR = 4  # the simulation's calls in a pull and a push: each one's two sides
SHARD_CALL_SAMPLE_S = 1.0  # at least, per (size, gap): the CPU counters tick at 100 Hz
SAMPLE_S = 1.0  # at least, per (size, gap), over all rounds: a mean holds rare long stalls
ROUNDS = 4  # every point sampled in each round: the machine's speed drifts within seconds
MIN_CALLS, BACK_TO_BACK_CALLS = 10, 75  # per round
WARMUP = 3  # per round and point


def _calls(gap_s: float) -> int:
    return max(MIN_CALLS, round(SAMPLE_S / ROUNDS / (gap_s + 1e-3)))


def _rank(
    rank: int,
    port: int,
    kind: str,
    sizes: Sequence[int],
    gaps_s: Sequence[float],
    out: Any,  # noqa: ANN401 - a multiprocessing queue
) -> None:
    """One of two ranks: per size, the collective's mean seconds back to back, then per
    gap its mean seconds after that much compute, and the compute's mean seconds; every
    point sampled in each of `ROUNDS` rounds."""
    with gloo_pair(rank, port):
        filler = Filler()
        collectives = [COLLECTIVES[kind](rank, size) for size in sizes]
        back_to_back: list[list[float]] = [[] for _ in sizes]
        waits = [[[] for _ in gaps_s] for _ in sizes]  # [size][gap] -> seconds
        computes = [[[] for _ in gaps_s] for _ in sizes]
        for _ in range(ROUNDS):
            for s, collective in enumerate(collectives):
                for i in range(WARMUP + BACK_TO_BACK_CALLS):
                    started = time.perf_counter()
                    collective()
                    if i >= WARMUP:
                        back_to_back[s].append(time.perf_counter() - started)
                for g, gap in enumerate(gaps_s):
                    for i in range(WARMUP + _calls(gap)):
                        started = time.perf_counter()
                        filler.run(gap)
                        computed = time.perf_counter()
                        collective()
                        if i >= WARMUP:
                            computes[s][g].append(computed - started)
                            waits[s][g].append(time.perf_counter() - computed)
        out.put(
            (
                rank,
                {
                    "back_to_back": [statistics.mean(c) for c in back_to_back],
                    "waits": [[statistics.mean(w) for w in row] for row in waits],
                    "computes": [[statistics.mean(c) for c in row] for row in computes],
                },
            )
        )


def measure_lockstep(
    kind: str,
    sizes: Sequence[int] = LOCKSTEP_SIZES,
    gaps_s: Sequence[float] = LOCKSTEP_GAPS_S,
) -> LockstepCost:
    """The extra seconds of a two-process collective `kind` ("allreduce" or "exchange")
    after compute, by bytes each rank sends and the compute's measured seconds (see the
    module docstring)."""
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {sorted(COLLECTIVES)}, got {kind!r}")
    answers = on_two_ranks(_rank, kind, list(sizes), list(gaps_s))
    extra, measured_gaps = [], []
    for s in range(len(sizes)):
        alone = statistics.mean(a["back_to_back"][s] for a in answers)
        waits = [statistics.mean(a["waits"][s][g] for a in answers) for g in range(len(gaps_s))]
        gaps = [statistics.mean(a["computes"][s][g] for a in answers) for g in range(len(gaps_s))]
        extra.append([max(w - alone, 0.0) for w in waits])
        measured_gaps.append(gaps)
    # one gap axis for all sizes: the gaps as computed, averaged over the sizes
    gap_axis = [statistics.mean(g[i] for g in measured_gaps) for i in range(len(gaps_s))]
    order = sorted(range(len(gap_axis)), key=gap_axis.__getitem__)
    return LockstepCost(
        measured_bytes=[4 * s for s in sizes],
        gaps_s=[gap_axis[i] for i in order],
        extra_s=[[row[i] for i in order] for row in extra],
    )


def shared_wall(call: CallCost, computing: int, cores: int) -> float:
    """`call`'s wall seconds beside `computing` one-thread processes on `cores` cores, as
    processor sharing prices it (`Machine.call`): its measured cores and theirs share them."""
    units = min((call.cpu_s or call.wall_s) / call.wall_s, cores)
    return call.wall_s * max(1.0, (computing + units) / cores)


def hop_wait(walls: Sequence[float], computing: Sequence[int], cores: int) -> float:
    """The wait per call at a busy fraction of 1 with which `CALLS_PER_PAIR` calls, each
    waiting `hop_wait * k / cores`, add up to the pair's `walls` beyond processor sharing
    beside `computing` (k) processes: least squares through the origin, at least 0."""
    busy = [CALLS_PER_PAIR * min(k / cores, 1.0) for k in computing]
    fit = sum(b * w for b, w in zip(busy, walls, strict=True)) / sum(b * b for b in busy)
    return max(fit, 0.0)


def measure_shard_calls_after_compute(
    sizes: Sequence[int], gaps_s: Sequence[float] = SHARD_CALL_GAPS_S
) -> LockstepCost:
    """A replica's pull + push of `sizes` values (float32) through a real one-shard server
    after `gaps_s` of compute, beyond the same pair back to back: extra seconds and extra
    core-seconds; and what each of its calls waits for cores on a busy machine (see the
    module docstring). Needs Ray up (a session)."""
    from scaleout.ps import ParameterServer
    from scaleout.train.config import TrainSection

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a replica of one thread
    filler = Filler()
    cores = os.cpu_count() or 1
    gaps = (*gaps_s, SHARD_CALL_LOADED_GAP_S)  # the loaded gap once
    others = OtherCores(cores) if cores > 1 else None
    computing = (cores - 1, cores)  # processes beside the loaded pairs
    servers: list[ParameterServer] = []
    try:
        calls: list[Timed] = []
        for size in sizes:  # every size's shard up at once: their calls take turns
            server = ParameterServer.create(torch.zeros(size), 1, TrainSection(optimizer="sgd"))
            servers.append(server)
            values, grad = torch.empty(size), torch.randn(size)
            pair = functools.partial(shard_round_trip, server, values, grad)
            for _ in range(WARMUP * 5):  # the object store's memory used once
                pair()
            calls.append(Timed(pair))
            calls += [Timed(pair, functools.partial(filler.run, gap)) for gap in gaps]
            if others is not None:
                gap = functools.partial(filler.run, SHARD_CALL_LOADED_GAP_S)
                calls += [
                    Timed(pair, gap, functools.partial(others.computing, k)) for k in computing
                ]
        idle = measure_idle(1.0)
        costs = measure_calls(calls, idle, SHARD_CALL_SAMPLE_S, warmup=0)
    finally:
        for server in servers:
            server.kill()
        if others is not None:
            others.close()
        torch.set_num_threads(threads)
    extra, extra_core, waits = [], [], []
    per_size = len(calls) // len(sizes)  # the pair alone, after each gap, loaded
    for first in range(0, len(calls), per_size):
        alone, *after = costs[first : first + per_size]
        cores_used = alone.cpu_s or 0.0  # none without /proc: no extra core-seconds
        extra.append([max(a.wall_s - alone.wall_s, 0.0) for a in after[: len(gaps_s)]])
        extra_core.append([max((a.cpu_s or 0.0) - cores_used, 0.0) for a in after[: len(gaps_s)]])
        if others is not None:
            unloaded, loaded = after[len(gaps_s)], after[len(gaps) :]
            beyond = [
                c.wall_s - shared_wall(unloaded, k, cores)
                for c, k in zip(loaded, computing, strict=True)
            ]
            waits.append(hop_wait(beyond, computing, cores))
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    return LockstepCost(
        measured_bytes=[4 * sizes[i] for i in order],
        gaps_s=list(gaps_s),
        extra_s=[extra[i] for i in order],
        extra_core_s=[extra_core[i] for i in order],
        hop_wait_s=[waits[i] for i in order] if waits else [],
    )
