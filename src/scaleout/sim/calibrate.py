"""`scaleout calibrate`: measure this machine's costs with the library's own code.

What is measured, each alone on a quiet machine (medians of repeats, in rounds where the
machine's speed drifts; calls by their mean, as a run pays the slow ones too):

- per config's model (`measure_compute`): a training step (the config's loader, forward,
  backward) per example at 1..all threads, the share of it that does not shrink with the
  batch, one 1-thread process among several stepping at once, DDP's own cost for a sync
  config, evaluation per test example, the loader alone, the optimizer's step;
- a shard's update per value, per optimizer (decode + `optimizer.step`, as `ParameterShard`
  applies a push: a new gradient, caches cold);
- each codec's encode and decode, ns per value, by message size;
- calls between processes (`measure_calls`): a pull and a push through a real one-shard
  `ParameterServer` on Ray (and what a replica's push adds: collecting the previous push's
  answers, zeroing its gradient buffer), and a gloo all-reduce between two processes, at
  fixed sizes and at the sizes the configs send, in wall time and in the core-seconds all
  of the machine's processes spend on them (a call keeps more than one core busy, which a
  loaded machine feels); a model-parallel exchange between two processes by size;
- what such a collective costs beyond that after the ranks computed for a while
  (`measure_lockstep`: waiting for the slower rank, gloo's threads waking up);
- per Downpour config's model, the CPU its 1-thread step takes more while another process
  makes calls to a shard (`measure_beside`: their copies share the caches), and the wall
  time it loses to each call with a core idle and with the other cores computing; and
  what a replica's pull + push costs after its compute beyond back to back
  (`measure_shard_calls_after_compute`: Ray's threads wake up), and what each of its
  calls waits for a core beside one and two computing processes (`hop_wait_s`);
- sync's weight averaging (`average_tensors`) between two processes by size;
- a checkpoint write per byte, and the local part of sync's weight averaging per byte
  (one process alone, for calibrations without the two-process measurement).

The simulator prices every event from these numbers (`Calibration`).
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from scaleout.sim.calibration import Calibration, CodecCost, MessageCost, ModelCost
from scaleout.sim.measure_beside import call_wait_busy_s, call_wait_s, measure_beside_calls
from scaleout.sim.measure_calls import (
    allreduce_sizes,
    average_sizes,
    measure_allreduce,
    measure_average,
    measure_collect,
    measure_exchange,
    measure_fsdp_collectives,
    measure_shard_messages,
    shard_message_sizes,
    shard_slices,
)
from scaleout.sim.measure_compute import measure_model
from scaleout.sim.measure_lockstep import measure_lockstep, measure_shard_calls_after_compute
from scaleout.sim.measuring import model_key, timed

OPTIMIZERS = ("sgd", "momentum", "adagrad", "rmsprop", "adam")
CONTENDED = 1.1  # two 1-thread processes stepping this much slower than one: a load ran
CODEC_SIZES = (10_000, 100_000, 1_000_000, 4_000_000)


EVICT_BYTES = 64 * 2**20  # more than any cache of this machine


def measure_apply(numel: int = 1_000_000, repeats: int = 30) -> dict[str, float]:
    """ns per value of a shard's update (copy the gradient in, step), per optimizer, as a
    shard meets it in a run: each gradient new and the caches cold (a replica's compute
    ran since the last push). Cold, because an update back to back on warm caches costs
    less than it does inside a shard actor between pulls, and would underprice a run."""
    from scaleout.nn.optim import build_optimizer
    from scaleout.train.config import TrainSection

    out = {}
    grad = torch.randn(numel)
    evict = torch.zeros(EVICT_BYTES // 4)
    for name in OPTIMIZERS:
        param = torch.nn.Parameter(torch.zeros(numel))
        param.grad = torch.zeros_like(param)
        optimizer = build_optimizer([param], TrainSection(optimizer=name, lr=0.01))
        times = []
        for _ in range(repeats + 2):  # the first two create the optimizer's state
            fresh = grad.clone()
            evict.add_(1.0)
            started = time.perf_counter()
            param.grad.copy_(fresh)
            optimizer.step()
            times.append(time.perf_counter() - started)
        out[name] = statistics.median(times[2:]) / numel * 1e9
    return out


def measure_codecs(
    sizes: Sequence[int] = CODEC_SIZES, names: Sequence[str] | None = None
) -> dict[str, CodecCost]:
    """Encode and decode ns per value by size, of `names` (None: every codec but fp32)."""
    from scaleout.compress import get
    from scaleout.compress.registry import CODEC_NAMES

    out = {}
    for name in CODEC_NAMES if names is None else names:
        if name == "fp32":
            continue
        codec = get(name)
        encode_ns, decode_ns = [], []
        for size in sizes:
            x = torch.randn(size)
            encoded = codec.encode(x)
            encode_ns.append(timed(lambda c=codec, x=x: c.encode(x), repeats=5) / size * 1e9)
            decode_ns.append(timed(lambda c=codec, e=encoded: c.decode(e), repeats=5) / size * 1e9)
        out[name] = CodecCost(sizes=list(sizes), encode_ns=encode_ns, decode_ns=decode_ns)
    return out


def measure_flatten(numel: int = 4_000_000, pieces: int = 8) -> float:
    """Bytes per second of flattening tensors, scaling and copying them back, one thread:
    `average_tensors` without its all-reduce."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    tensors = [torch.randn(numel // pieces) for _ in range(pieces)]

    def local_part() -> None:
        flat = _flatten_dense_tensors(tensors)
        flat.div_(2)
        for tensor, mean in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            tensor.copy_(mean)

    return 4 * numel / timed(local_part, repeats=7, warmup=2)


def measure_zero(numel: int = 4_000_000) -> float:
    """Bytes per second of zeroing a gradient buffer, one thread (a replica's after each
    push)."""
    buffer = torch.ones(numel)
    return 4 * numel / timed(buffer.zero_, repeats=7, warmup=2)


def measure_checkpoint(numel: int = 4_000_000) -> float:
    """Bytes per second of an atomic, verified checkpoint write."""
    from scaleout.checkpoint import save_checkpoint

    tensors = {"x": torch.randn(numel)}
    with tempfile.TemporaryDirectory() as tmp:
        seconds = timed(lambda: save_checkpoint(Path(tmp) / "c", tensors, {}), repeats=3)
    return 4 * numel / seconds


# --- the whole calibration -------------------------------------------------------------------


def contended(models: dict[str, ModelCost]) -> str | None:
    """Why the calibration was taken on a busy machine, or None: on a quiet one two
    1-thread processes step about as fast as one (memory bandwidth aside, a few per cent);
    much slower means another load ran and every cost here is off by as much."""
    slowdown = max((cost.slowdown(2) for cost in models.values()), default=1.0)
    if slowdown <= CONTENDED:
        return None
    return (
        f"two 1-thread processes stepped {slowdown:.2f}x slower than one: another load was "
        "running (or this machine's host was busy); calibrate again on a quiet machine"
    )


def configs_per_model(configs: Sequence[Any]) -> dict[str, Any]:  # noqa: ANN401 - RunConfigs
    """The config whose model `calibrate` measures, per model key: a sync one when any (it
    measures DDP's cost too)."""
    chosen: dict[str, Any] = {}
    for config in configs:
        key = model_key(config)
        if key not in chosen or config.train.strategy == "sync":
            chosen[key] = config
    return chosen


def downpour_slices(configs: Sequence[Any], models: dict[str, ModelCost]) -> list[int]:
    """Values per shard call of every Downpour config (what its replicas pull and push)."""
    sizes = set()
    for config in configs:
        if config.train.strategy == "downpour":
            sizes.update(shard_slices(config, models[model_key(config)].num_parameters))
    return sorted(sizes)


def with_beside_calls(
    configs: Sequence[Any],  # noqa: ANN401 - RunConfigs
    models: dict[str, ModelCost],
    pull: MessageCost,
    push: MessageCost,
    apply_ns: dict[str, float],
    idle_cores: float,
) -> dict[str, ModelCost]:
    """`models` with `ModelCost.beside_calls`, `call_wait_s` and (on 2 cores or more)
    `call_wait_busy_s` measured for each model a Downpour config trains, beside calls of
    its largest shard slice (Ray must be up), the calls priced as measured just before
    (`pull`, `push`)."""
    measured = dict(models)
    done = set()
    cores = os.cpu_count() or 1
    for config in configs:
        key = model_key(config)
        if config.train.strategy != "downpour" or key in done:
            continue
        done.add(key)
        numel = max(shard_slices(config, models[key].num_parameters))
        beside = measure_beside_calls(config, numel)
        step_s = models[key].step_s(config.train.batch_size, 1)
        # the measurement's shard runs Adagrad (`measure_beside._calls`)
        apply_s = numel * apply_ns["adagrad"] * 1e-9
        args = (pull, push, apply_s, 4 * numel, cores, idle_cores)
        wait = call_wait_s(step_s, beside, *args)
        busy_wait = None
        if cores >= 2:  # the other cores computing too, as the other replicas do
            busy = measure_beside_calls(config, numel, other_cores=cores - 1)
            slowdown = models[key].slowdown
            busy_wait = call_wait_busy_s(step_s, busy, wait, *args, slowdown=slowdown)
        measured[key] = models[key].model_copy(
            update={
                "beside_calls": beside.cpu_ratio,
                "call_wait_s": wait,
                "call_wait_busy_s": busy_wait,
            }
        )
    return measured


def recalibrate(
    calibration: Calibration,
    configs: Sequence[Any],  # noqa: ANN401 - RunConfigs
) -> Calibration:
    """`calibration` with what `configs`' runs lean on measured again now: their models'
    compute, and the calls and codecs their strategies use (a shard's pulls, pushes and
    updates for Downpour and Sandblaster; the all-reduce and the weight averaging for sync;
    the exchange for model parallel; a Downpour replica's calls after compute). The rest
    (collectives after compute, checkpoints) is kept. For a machine whose speed drifts
    between a calibration and a run (the calls more than the compute, a call's fixed cost
    from one calibration to the next), so that the held-out runs of `python -m benchmarks
    simulate` are priced by costs measured around each of them."""
    from scaleout.runtime import session

    fresh = calibration.model_copy(deep=True)
    cores = os.cpu_count() or 1
    for key, config in configs_per_model(configs).items():
        fresh.models[key] = measure_model(config, cores)
    strategies = {config.train.strategy for config in configs}
    shards = bool(strategies & {"downpour", "sandblaster"})  # a parameter server's calls
    codecs = sorted({config.compress.codec for config in configs} - {"fp32"})
    if "sync" in strategies:
        fresh.allreduce = measure_allreduce(allreduce_sizes(configs, fresh.models))
        fresh.average = measure_average(average_sizes(configs, fresh.models))
    if "model_parallel" in strategies:
        fresh.exchange = measure_exchange()
    threads = torch.get_num_threads()
    # As `calibrate` measures them: a shard's and a codec's one thread, and a caller of one
    # thread like a replica's (`run.num_threads = 1`). With torch's default threads, a
    # pull's copy wakes a second thread that spins after it, which would charge the
    # caller's side core-time that a one-thread replica does not spend.
    torch.set_num_threads(1)
    try:
        if codecs:
            fresh.codecs.update(measure_codecs(names=codecs))
        if shards:
            fresh.apply_ns = measure_apply()
            fresh.zero_bytes_per_s = measure_zero()
            with session(num_cpus=cores):
                sizes = shard_message_sizes(configs, fresh.models)
                fresh.pull, fresh.push, fresh.idle_cores = measure_shard_messages(
                    fresh.apply_ns["sgd"], sizes
                )
                fresh.collect_s, fresh.collect_shard_s = measure_collect()
                fresh.models = with_beside_calls(
                    configs, fresh.models, fresh.pull, fresh.push, fresh.apply_ns, fresh.idle_cores
                )
                slices = downpour_slices(configs, fresh.models)
                if slices:
                    after = measure_shard_calls_after_compute(slices)
                    fresh.lockstep = {**fresh.lockstep, "shard_calls": after}
    finally:
        torch.set_num_threads(threads)
    return fresh


def calibrate(
    configs: Sequence[Any],  # noqa: ANN401 - RunConfigs
    say: Callable[[str], None] = print,
) -> Calibration:
    """Measure everything the simulator prices; Ray is started (and stopped) here."""
    from scaleout.runtime import session

    cores = os.cpu_count() or 1
    models = {}
    for key, config in configs_per_model(configs).items():
        say(f"compute: {config.run.name} at 1..{cores} threads")
        models[key] = measure_model(config, cores)
    torch.set_num_threads(1)
    say("shard updates per optimizer")
    apply_ns = measure_apply()
    say("codecs")
    codecs = measure_codecs()
    # the collectives between bare processes first: Ray's processes take seconds to exit
    # after its session, and an all-reduce measured meanwhile would be slowed by them
    say("gloo all-reduce between two processes")
    allreduce = measure_allreduce(allreduce_sizes(configs, models))
    say("sync's weight averaging between two processes")
    average = measure_average(average_sizes(configs, models))
    allgather = reduce_scatter = None
    if any(c.train.strategy == "sync" for c in configs):
        say("FSDP's all-gather and reduce-scatter between two processes")
        allgather, reduce_scatter = measure_fsdp_collectives(allreduce_sizes(configs, models))
    say("model-parallel exchanges between two processes")
    exchange = measure_exchange()
    say("collectives after compute between two processes")
    lockstep = {kind: measure_lockstep(kind) for kind in ("allreduce", "exchange")}
    say("checkpoint writes")
    checkpoint = measure_checkpoint()
    flatten = measure_flatten()
    zero = measure_zero()
    say("pulls and pushes through a parameter-server shard")
    with session(num_cpus=cores):
        sizes = shard_message_sizes(configs, models)
        pull, push, idle_cores = measure_shard_messages(apply_ns["sgd"], sizes)
        collect = measure_collect()
        say("a replica's step beside a shard's calls, its calls after its compute")
        models = with_beside_calls(configs, models, pull, push, apply_ns, idle_cores)
        if downpour_slices(configs, models):
            lockstep["shard_calls"] = measure_shard_calls_after_compute(sizes)
    return Calibration(
        host=socket.gethostname(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        cores=cores,
        models=models,
        apply_ns=apply_ns,
        codecs=codecs,
        pull=pull,
        push=push,
        allreduce=allreduce,
        allgather=allgather,
        reduce_scatter=reduce_scatter,
        average=average,
        exchange=exchange,
        lockstep=lockstep,
        checkpoint_bytes_per_s=checkpoint,
        flatten_bytes_per_s=flatten,
        collect_s=collect[0],
        collect_shard_s=collect[1],
        zero_bytes_per_s=zero,
        idle_cores=idle_cores,
        notes={
            "torch": torch.__version__,
            "python": platform.python_version(),
            **({"contended": busy} if (busy := contended(models)) else {}),
        },
    )
