"""A model's step beside a parameter server's calls, measured: how much more CPU a replica's
1-thread training step takes while another process pulls from and pushes to a shard.

A Downpour replica computes while the other replicas' pulls and pushes, and the shards
serving them, run on the same machine: Ray's threads in several processes copy megabytes
in and out of its object store and evict the step's weights from the caches they share.
The step then needs more CPU, not only less of the cores (the simulator shares those out
itself). Measured on this box for the demo's MLP beside calls of its 0.93M-value shards:
+3 to +10% CPU a step across calibrations (wall +8 to +19% in one, the rest being the
cores the calls take); a real 2x2 run's steps took +3.6% against its warm start's, where
one replica computed with no other calls in flight.

`measure_beside_calls` steps the model in a spawned process (one thread, thread CPU per
step) in rounds, alternately with this process idle and with it making back-to-back
pull + push calls through a real one-shard `ParameterServer` (in a thread, so that the
queue to the stepper stays served); the ratio of the medians over rounds.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch

from scaleout.sim.measure_calls import shard_round_trip
from scaleout.sim.measuring import START_AND_STEP_S

ROUNDS = 6  # of each condition, alternately: the box drifts within seconds
STEPS = 12  # per round
SETTLE_S = 0.05  # after the calls start or stop, before a round


def _stepper(raw: dict, commands: Any, answers: Any) -> None:  # noqa: ANN401 - mp queues
    """In a spawned process: the model's 1-thread step; per command, the mean thread CPU
    seconds of `STEPS` steps."""
    from scaleout.api import config_from_dict
    from scaleout.sim.measure_compute import _Stepper

    torch.set_num_threads(1)
    stepper = _Stepper(config_from_dict(raw))
    for _ in range(3):
        stepper.step()
    answers.put("ready")
    while commands.get() is not None:
        spent = []
        for _ in range(STEPS):
            began = time.thread_time()
            stepper.step()
            spent.append(time.thread_time() - began)
        answers.put(statistics.mean(spent))


def _calls(numel: int, running: threading.Event, stop: threading.Event) -> None:
    """Back-to-back pull + push through a one-shard server while `running` is set."""
    from scaleout.ps import ParameterServer
    from scaleout.train.config import TrainSection

    server = ParameterServer.create(torch.zeros(numel), 1, TrainSection(optimizer="adagrad"))
    try:
        values, grad = torch.empty(numel), torch.randn(numel)
        while not stop.is_set():
            if not running.wait(timeout=0.05):
                continue
            shard_round_trip(server, values, grad)
    finally:
        server.kill()


def measure_beside_calls(config: Any, numel: int) -> float:  # noqa: ANN401 - a RunConfig
    """CPU of `config`'s 1-thread training step while another process makes calls to a
    shard of `numel` values, over the same step alone (>= 1). Needs Ray up (a session)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    commands, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_stepper, args=(config.model_dump(mode="json"), commands, answers))
    running, stop = threading.Event(), threading.Event()
    caller = threading.Thread(target=_calls, args=(numel, running, stop), daemon=True)
    proc.start()
    caller.start()
    try:
        answers.get(timeout=START_AND_STEP_S)
        alone, beside = [], []
        for _ in range(ROUNDS):
            for calling, samples in ((False, alone), (True, beside)):
                running.set() if calling else running.clear()
                time.sleep(SETTLE_S)
                commands.put("step")
                samples.append(answers.get(timeout=START_AND_STEP_S))
        return max(1.0, statistics.median(beside) / statistics.median(alone))
    finally:
        running.clear()
        stop.set()
        caller.join(timeout=30)
        commands.put(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
