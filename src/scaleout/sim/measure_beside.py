"""A model's step beside a parameter server's calls, measured: how much more CPU a replica's
1-thread training step takes while another process pulls from and pushes to a shard.

A Downpour replica computes while the other replicas' pulls and pushes, and the shards
serving them, run on the same machine: Ray's threads in several processes copy megabytes
in and out of its object store and evict the step's weights from the caches they share.
The step then needs more CPU, not only less of the cores (the simulator shares those out
itself), and that extra CPU is what this module measures.

Beside the calls the step also waits longer than sharing the cores explains, while cores
stand idle: each call's threads wake up on some core, and the scheduler often hands them
the computing thread's. The simulator charges
that wait per call (`engine.Shared.call_wait`); `call_wait_s` finds the wait per call with
which the engine, running this measurement's schedule, gives the measured step (more with
torch's threads in the caller, whose copies then take another core too).

With every core computing the loss per call is larger: each hop of a call then takes a
computing thread's core, none is idle. Measured with a second process computing beside the
step (the other replica of a 2 x 2 run), the step takes longer beside the calls than the
engine gives when it charges the wait found with a core idle; `call_wait_busy_s` finds the
wait per call that gives the measured step there. The engine charges a call the one or
the other by how many units the computing jobs ask for (`Shared.call_wait_now`).

`measure_beside_calls` steps the model in a spawned process (one thread, thread CPU and
wall time per step) in rounds, alternately with this process idle and with it making
back-to-back pull + push calls through a real one-shard `ParameterServer` (in a thread, so
that the queue to the stepper stays served), counting the pairs; medians over rounds. With
`other_cores`, that many more processes compute throughout (`measuring.OtherCores`).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from scaleout.sim.calibration import MessageCost
from scaleout.sim.engine import Cluster, Link, Process
from scaleout.sim.measure_calls import shard_round_trip
from scaleout.sim.measuring import START_AND_STEP_S, OtherCores

ROUNDS = 16  # of each condition, alternately: the machine's speed drifts within seconds
STEPS = 12  # per round
SETTLE_S = 0.05  # after the calls start or stop, before a round
SIMULATED_STEPS = 60  # of the measurement's schedule in the engine, the first 10 left out
STALLED = 20  # a simulated step this many times its compute or longer: as good as never


@dataclass(frozen=True)
class BesideCalls:
    """A 1-thread step beside back-to-back pull + push pairs, against the same step alone
    (medians over rounds)."""

    cpu_ratio: float  # thread CPU per step beside over alone (>= 1)
    wall_ratio: float  # wall time per step beside over alone
    pairs_per_step: float  # pull + push pairs made during one step beside


def _stepper(raw: dict, commands: Any, answers: Any) -> None:  # noqa: ANN401 - mp queues
    """In a spawned process: the model's 1-thread step; per command, the mean thread CPU
    seconds and wall seconds of `STEPS` steps."""
    from scaleout.api import config_from_dict
    from scaleout.sim.measure_compute import _Stepper

    torch.set_num_threads(1)
    stepper = _Stepper(config_from_dict(raw))
    for _ in range(3):
        stepper.step()
    answers.put("ready")
    while commands.get() is not None:
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(STEPS):
            stepper.step()
        answers.put(((time.thread_time() - cpu) / STEPS, (time.perf_counter() - wall) / STEPS))


def _calls(
    numel: int,
    ready: threading.Event,
    running: threading.Event,
    stop: threading.Event,
    made: list[int],
) -> None:
    """Back-to-back pull + push through a one-shard server while `running` is set; counts
    them in `made[0]`. `ready` once the server is up and has made a round trip."""
    from scaleout.ps import ParameterServer
    from scaleout.train.config import TrainSection

    server = ParameterServer.create(torch.zeros(numel), 1, TrainSection(optimizer="adagrad"))
    try:
        values, grad = torch.empty(numel), torch.randn(numel)
        shard_round_trip(server, values, grad)
        ready.set()
        while not stop.is_set():
            if not running.wait(timeout=0.05):
                continue
            shard_round_trip(server, values, grad)
            made[0] += 1
    finally:
        server.kill()


def measure_beside_calls(
    config: Any,  # noqa: ANN401 - a RunConfig
    numel: int,
    other_cores: int = 0,
) -> BesideCalls:
    """`config`'s 1-thread training step while another process makes calls to a shard of
    `numel` values, against the same step without them; `other_cores` processes compute
    on one thread each throughout (both conditions). Needs Ray up (a session)."""
    if other_cores <= 0:
        return _beside_calls(config, numel)
    with OtherCores(other_cores) as others, others.computing():
        return _beside_calls(config, numel)


def _beside_calls(config: Any, numel: int) -> BesideCalls:  # noqa: ANN401 - a RunConfig
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    commands, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_stepper, args=(config.model_dump(mode="json"), commands, answers))
    ready, running, stop, made = threading.Event(), threading.Event(), threading.Event(), [0]
    caller = threading.Thread(target=_calls, args=(numel, ready, running, stop, made), daemon=True)
    proc.start()
    caller.start()
    try:
        answers.get(timeout=START_AND_STEP_S)
        if not ready.wait(timeout=START_AND_STEP_S):  # else the rounds would count no calls
            raise TimeoutError(f"the shard for the calls did not start in {START_AND_STEP_S} s")
        alone, beside, pairs = [], [], []
        for _ in range(ROUNDS):
            for calling, samples in ((False, alone), (True, beside)):
                running.set() if calling else running.clear()
                time.sleep(SETTLE_S)
                before = made[0]
                commands.put("step")
                samples.append(answers.get(timeout=START_AND_STEP_S))
                if calling:
                    pairs.append((made[0] - before) / STEPS)

        def median(samples: list[tuple[float, float]], which: int) -> float:
            return statistics.median(sample[which] for sample in samples)

        return BesideCalls(
            cpu_ratio=max(1.0, median(beside, 0) / median(alone, 0)),
            wall_ratio=median(beside, 1) / median(alone, 1),
            pairs_per_step=statistics.median(pairs),
        )
    finally:
        running.clear()
        stop.set()
        caller.join(timeout=30)
        commands.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _simulated_step(
    step_s: float,
    beside: BesideCalls | None,
    wait: float,
    pair: Callable[[Any], Process] | None,
    cores: float,
    idle_cores: float,
    other_cores: int = 0,
    busy_wait: float | None = None,
    slowdown: Callable[[int], float] | None = None,
) -> float:
    """Mean wall seconds of a `step_s` step in the engine beside one `pair` after another
    (none: `pair` None), slowed by `beside.cpu_ratio` while they run and by `wait` per call
    (`busy_wait` with every core computing); `other_cores` more jobs compute throughout,
    the computing jobs slowed by `slowdown` as the engine slows them."""
    cluster = Cluster(1, cores, Link(bandwidth=1e9), idle_cores=idle_cores)
    env, machine = cluster.env, cluster.machines[0]
    machine.cores.call_wait, machine.cores.call_wait_busy = wait, busy_wait
    machine.cores.beside_plain = beside.cpu_ratio if beside is not None else 1.0
    machine.cores.slowdown = slowdown
    walls: list[float] = []

    def calls(pair: Callable[[Any], Process]) -> Process:
        while True:
            yield from pair(machine)

    def other() -> Process:
        while True:
            yield from machine.compute(1.0)

    def steps() -> Process:
        for _ in range(SIMULATED_STEPS):
            began = env.now
            yield from machine.compute(step_s)
            walls.append(env.now - began)

    for _ in range(other_cores):
        env.process(other())
    if pair is not None:
        env.process(calls(pair))
    # A wait per call too long for the calls' rate leaves the step no time at all: each
    # call's wait then pushes its end out further than it got (the bisection's upper end)
    limit = env.timeout(SIMULATED_STEPS * step_s * STALLED)
    cluster.run(until=env.any_of([env.process(steps()), limit]))
    if len(walls) < SIMULATED_STEPS:
        return math.inf
    return statistics.mean(walls[10:])


def paced_pairs(
    pull: MessageCost, push: MessageCost, apply_s: float, nbytes: int, period_s: float
) -> Callable[[Any], Process]:
    """The measurement's pull + push pair of `nbytes` as `DownpourSim` prices it (the
    shard's side of the pull, the caller's, the caller's side of the push, the shard's, its
    update `apply_s`), one every `period_s` at most: the rate the measurement counted (a
    pair beside a computing process takes longer than the calls' quiet prices; the engine
    prices that wait at a replica's wake-up, not here)."""
    (caller, callee), (push_caller, push_callee) = pull.sides(nbytes), push.sides(nbytes)

    def pair(machine: Any) -> Process:  # noqa: ANN401 - an engine.Machine
        began = machine.env.now
        for wall, cpu in (callee, caller, push_caller, push_callee):
            yield from machine.call(wall, cpu)
        yield from machine.work(apply_s)
        if (rest := began + period_s - machine.env.now) > 0:
            yield machine.env.timeout(rest)

    return pair


def call_wait_s(
    step_s: float,
    beside: BesideCalls,
    pull: MessageCost,
    push: MessageCost,
    apply_s: float,
    nbytes: int,
    cores: float,
    idle_cores: float = 0.0,
) -> float:
    """The wait per call (`engine.Shared.call_wait`) with which the engine, running the
    measurement's schedule (a `step_s` step beside `beside.pairs_per_step` pairs a step,
    `paced_pairs`), gives the step the measured `beside.wall_ratio`: 0 where sharing the
    cores explains it already. Found by bisection; the step grows with the wait."""
    if beside.pairs_per_step <= 0:  # no pair ended within a round: nothing to charge
        return 0.0
    target = step_s * beside.wall_ratio
    pair = paced_pairs(pull, push, apply_s, nbytes, target / beside.pairs_per_step)

    def simulated(wait: float) -> float:
        return _simulated_step(step_s, beside, wait, pair, cores, idle_cores)

    return _bisect(simulated, target, step_s)


def call_wait_busy_s(
    step_s: float,
    beside: BesideCalls,
    wait: float,
    pull: MessageCost,
    push: MessageCost,
    apply_s: float,
    nbytes: int,
    cores: float,
    idle_cores: float = 0.0,
    slowdown: Callable[[int], float] | None = None,
) -> float:
    """`call_wait_s` with every core computing: the wait per call (`Shared.call_wait_busy`,
    `wait` the one found with a core idle) with which the engine, running the measurement
    with `cores - 1` other processes computing (`measure_beside_calls(other_cores=...)`),
    gives the step beside the calls `beside.wall_ratio` times the step beside those
    processes alone, both as the engine prices them (`slowdown`: processes computing at
    once). 0 where sharing the cores explains it."""
    others = max(round(cores) - 1, 0)
    if beside.pairs_per_step <= 0 or others == 0:
        return wait
    machine = (cores, idle_cores, others)
    without = _simulated_step(step_s, None, 0.0, None, *machine, slowdown=slowdown)
    target = without * beside.wall_ratio
    pair = paced_pairs(pull, push, apply_s, nbytes, target / beside.pairs_per_step)

    def simulated(busy_wait: float) -> float:
        return _simulated_step(
            step_s, beside, wait, pair, *machine, busy_wait=busy_wait, slowdown=slowdown
        )

    return _bisect(simulated, target, step_s)


def _bisect(simulated: Callable[[float], float], target: float, step_s: float) -> float:
    """The wait at which `simulated(wait)` (growing with it) reaches `target`; 0 where
    no wait is needed. Waits beyond `step_s` are not searched."""
    if simulated(0.0) >= target:
        return 0.0
    low, high = 0.0, step_s / 16
    while simulated(high) < target and high < step_s:
        low, high = high, 2 * high
    for _ in range(20):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < target else (low, middle)
    return (low + high) / 2
