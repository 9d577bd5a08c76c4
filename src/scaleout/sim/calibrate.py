"""`scaleout calibrate`: measure this machine's costs with the library's own code.

What is measured, each alone on a quiet machine (the median of several repeats):

- per config's model: a training step (the config's loader, forward, backward) per example
  at 1..all threads, evaluation per test example, the loader alone, the optimizer's step;
- a shard's update per value, per optimizer (decode + `optimizer.step`, as `ParameterShard`
  applies a push);
- each codec's encode and decode, ns per value, by message size;
- a pull and a push through a real one-shard `ParameterServer` on Ray, by size, fitted as
  `fixed + bytes / bandwidth`, both in wall time and in the core-seconds all of the
  machine's processes spend on it (Linux's /proc/stat, less what Ray uses when idle; a call
  keeps more than one core busy, which a loaded machine feels);
- a gloo all-reduce between two processes by size, fitted the same way;
- a checkpoint write per byte, and the local part of sync's weight averaging per byte.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scaleout.sim.calibration import Calibration, CodecCost, MessageCost, ModelCost

OPTIMIZERS = ("sgd", "momentum", "adagrad", "rmsprop", "adam")
CODEC_SIZES = (10_000, 100_000, 1_000_000, 4_000_000)
MESSAGE_SIZES = (65_536, 1_048_576, 4_194_304)  # values (float32)
START_AND_STEP_S = 300.0  # a measuring process that has not answered by then failed


def timed(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """The median seconds of `fn()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares `y = a + b x`; (a, b) with a >= 0 and b > 0."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    slope = max(slope, 1e-15)
    return max(mean_y - slope * mean_x, 0.0), slope


def model_key(config: Any) -> str:  # noqa: ANN401 - a RunConfig
    """What identifies a model's compute: the model section and the data it reads."""
    model = config.model.model_dump(mode="json") if config.model is not None else None
    data = config.data.model_dump(mode="json") if config.data is not None else None
    name = data.get("dataset") if isinstance(data, dict) else None
    return f"{name}:{model}"


# --- compute -------------------------------------------------------------------------------


class _Stepper:
    """Training steps of a config's model as a worker runs them (the config's loader, the
    objective's forward and loss, backward), without an optimizer or communication."""

    def __init__(self, config: Any) -> None:  # noqa: ANN401 - a RunConfig
        from scaleout.api import build_job
        from scaleout.data import make_loader
        from scaleout.train.objective import objective_for

        self.job = job = build_job(config)
        torch.manual_seed(job.run.seed)
        train_set, self.test_set = job.build_data()
        self.model = job.build_model(train_set)
        self.train_size, self.test_size = len(train_set), len(self.test_set)
        self.objective = objective_for(self.model, job.loss_fn(), self.test_set)
        self.batch = job.train.batch_size
        self.loader = make_loader(
            train_set, self.batch, seed=0, drop_last=len(train_set) >= self.batch
        )
        self._batches = iter(self.loader)

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.loader)
            return next(self._batches)

    def step(self) -> None:
        loss, _ = self.objective.step(self.model, self.model, self.next_batch(), 0)
        loss.backward()


def _alone_and_together(
    raw: dict,
    rank: int,
    steps: int,
    rounds: int,
    barrier: Any,  # noqa: ANN401
    out: Any,  # noqa: ANN401
) -> None:
    """One of k processes (1 thread each): rounds of rank 0 stepping alone, then all k
    stepping at once; rank 0 answers its median seconds per step alone and together."""
    from scaleout.api import config_from_dict

    torch.set_num_threads(1)
    stepper = _Stepper(config_from_dict(raw))
    stepper.step()
    alone, together = [], []
    for _ in range(rounds):
        barrier.wait()
        if rank == 0:
            alone.append(timed(stepper.step, repeats=steps, warmup=1))
        barrier.wait()
        together.append(timed(stepper.step, repeats=steps, warmup=1))
    if rank == 0:
        out.put((statistics.median(alone), statistics.median(together)))


def measure_concurrent(
    config: Any,  # noqa: ANN401
    processes: int,
    steps: int,
    rounds: int = 5,
) -> tuple[float, float]:
    """Seconds per example of one 1-thread process's step alone and while `processes` step
    at once (memory bandwidth and caches are shared: the machine's real ceiling). Both in
    the same processes, alternately: a process's memory layout alone moves its step by
    several percent on this box, which is not the slow-down sought."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    raw = config.model_dump(mode="json")
    args = [(raw, rank, steps, rounds, barrier) for rank in range(processes)]
    alone, together = in_processes(_alone_and_together, args, 1)[0]
    return alone / config.train.batch_size, together / config.train.batch_size


def measure_model(config: Any, cores: int, steps: int = 20) -> ModelCost:  # noqa: ANN401
    """A training step per example of `config`'s model at 1..`cores` threads, and of one
    1-thread process among 1..`cores` stepping at once."""
    from scaleout.info import describe_model
    from scaleout.nn.optim import build_optimizer

    stepper = _Stepper(config)
    model, batch = stepper.model, stepper.batch
    saved = torch.get_num_threads()
    train_s: dict[int, float] = {}
    try:
        model.train()
        for threads in range(1, cores + 1):
            torch.set_num_threads(threads)
            train_s[threads] = timed(stepper.step, repeats=steps, warmup=2) / batch
        torch.set_num_threads(1)
        load_s = timed(stepper.next_batch, repeats=steps) / batch
        optimizer = build_optimizer(model.parameters(), stepper.job.train)
        optimizer_s = timed(optimizer.step, repeats=steps)
        test_set, cfg = stepper.test_set, stepper.job.train
        device = torch.device("cpu")
        evaluate = lambda: stepper.objective.evaluate(  # noqa: E731
            model, test_set, cfg.eval_batch_size, device, 0
        )
        eval_s = timed(evaluate, repeats=3) / len(test_set)
    finally:
        torch.set_num_threads(saved)
    concurrent_s: dict[int, float] = {}
    for processes in range(2, cores + 1):
        alone, concurrent_s[processes] = measure_concurrent(config, processes, steps)
        concurrent_s.setdefault(1, alone)
    concurrent_s = dict(sorted(concurrent_s.items()))
    try:
        flops = describe_model(config).forward_flops
    except Exception:  # a model the FLOP counter cannot trace: its measured time stands
        flops = 0
    return ModelCost(
        num_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        forward_flops=flops,
        batch_size=batch,
        train_s=train_s,
        concurrent_s=concurrent_s,
        eval_s=eval_s,
        load_s=load_s,
        optimizer_s=optimizer_s,
        train_size=stepper.train_size,
        test_size=stepper.test_size,
    )


def measure_apply(numel: int = 1_000_000) -> dict[str, float]:
    """ns per value of a shard's update (copy the gradient in, step), per optimizer."""
    from scaleout.nn.optim import build_optimizer
    from scaleout.train.config import TrainSection

    out = {}
    grad = torch.randn(numel)
    for name in OPTIMIZERS:
        param = torch.nn.Parameter(torch.zeros(numel))
        param.grad = torch.zeros_like(param)
        optimizer = build_optimizer([param], TrainSection(optimizer=name, lr=0.01))

        def apply(param: torch.nn.Parameter = param, opt: Any = optimizer) -> None:  # noqa: ANN401
            param.grad.copy_(grad)
            opt.step()

        out[name] = timed(apply, repeats=7) / numel * 1e9
    return out


def measure_codecs(sizes: Sequence[int] = CODEC_SIZES) -> dict[str, CodecCost]:
    from scaleout.compress import get
    from scaleout.compress.registry import CODEC_NAMES

    out = {}
    for name in CODEC_NAMES:
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
        return [queue.get(timeout=START_AND_STEP_S) for _ in range(answers)]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


# --- messages ------------------------------------------------------------------------------


def busy_cores_s() -> float | None:
    """Core-seconds all processes of this machine have used since boot (Linux's
    /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait (steal, a VM's lost time, is left out)
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def measure_idle(seconds: float = 2.0) -> float:
    """Cores this machine keeps busy while we wait (Ray's own processes, when it is up)."""
    before = busy_cores_s()
    time.sleep(seconds)
    after = busy_cores_s()
    return 0.0 if before is None or after is None else max(0.0, (after - before) / seconds)


@dataclass
class CallCost:
    """One call's wall seconds (median), and core-seconds: all processes', the caller's."""

    wall_s: float
    cpu_s: float | None
    caller_cpu_s: float
    caller_wall_s: float | None = None  # until the caller went on, when `fn` says


def measure_call(
    fn: Callable[[], float | None], idle: float, min_s: float = 0.8, warmup: int = 20
) -> CallCost:
    """`fn()` repeated for at least `min_s` (the CPU counters tick at 100 Hz), after
    `warmup` calls (Ray's object store is slower until its memory has been used once); the
    machine's busy cores less `idle` cores of background. `fn` may return the seconds its
    caller was held up, when that is less than the whole call."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    held: list[float] = []
    busy, own, started = busy_cores_s(), time.process_time(), time.perf_counter()
    while len(times) < 9 or time.perf_counter() - started < min_s:
        begin = time.perf_counter()
        caller = fn()
        times.append(time.perf_counter() - begin)
        if caller is not None:
            held.append(caller)
    elapsed, calls = time.perf_counter() - started, len(times)
    caller_cpu = (time.process_time() - own) / calls
    after = busy_cores_s()
    total = None if busy is None or after is None else (after - busy - idle * elapsed) / calls
    caller_wall = statistics.median(held) if held else None
    return CallCost(statistics.median(times), total, caller_cpu, caller_wall)


def message_cost(nbytes: Sequence[int], calls: Sequence[CallCost]) -> MessageCost:
    """`fixed + bytes / rate` fitted to the wall times and to the core-seconds, and the
    measured points themselves."""
    walls = [c.wall_s for c in calls]
    fixed, per_byte = fit_line(nbytes, walls)
    fields: dict[str, Any] = {
        "fixed_s": fixed,
        "bytes_per_s": 1 / per_byte,
        "measured_bytes": list(nbytes),
        "measured_s": walls,
    }
    held = [c.caller_wall_s for c in calls]
    if all(h is not None for h in held):
        fields["measured_caller_s"] = [max(h, 1e-6) for h in held]  # type: ignore[type-var]
    cpus = [c.cpu_s for c in calls]
    if all(cpu is not None for cpu in cpus):
        cores = [max(cpu, 1e-6) for cpu in cpus]  # type: ignore[type-var]
        cpu_fixed, cpu_per_byte = fit_line(nbytes, cores)
        fields.update(
            cpu_fixed_s=cpu_fixed,
            cpu_bytes_per_s=1 / cpu_per_byte,
            caller_share=min(sum(c.caller_cpu_s for c in calls) / sum(cores), 1.0),
            measured_core_s=cores,
            measured_caller_core_s=[c.caller_cpu_s for c in calls],
        )
    return MessageCost(**fields)


def shard_message_sizes(configs: Sequence[Any], models: dict[str, ModelCost]) -> list[int]:  # noqa: ANN401
    """Values per call to measure: `MESSAGE_SIZES` and every shard slice the configs send
    (Downpour's fp32 slices; Sandblaster's float64 vectors as twice as many fp32 values)."""
    from scaleout.ps.layout import shard_ranges

    sizes = set(MESSAGE_SIZES)
    for config in configs:
        section = getattr(config, config.train.strategy, None)
        num_shards = getattr(section, "num_shards", None)
        if not num_shards:
            continue
        numel = models[model_key(config)].num_parameters
        width = 2 if config.train.strategy == "sandblaster" else 1
        for start, stop in shard_ranges(numel, min(num_shards, numel)):
            sizes.add(width * (stop - start))
    return sorted(sizes)


def measure_shard_messages(
    apply_ns: float, sizes: Sequence[int] = MESSAGE_SIZES
) -> tuple[MessageCost, MessageCost, float]:
    """(pull, push, idle cores) through a real one-shard `ParameterServer` on this machine's
    Ray. A push is timed to its acknowledgement; the shard's SGD update (`apply_ns` per
    value, priced on its own) is taken out."""
    from scaleout.ps import ParameterServer
    from scaleout.train.config import TrainSection

    pulls, pushes, nbytes, idles = [], [], [], []
    for size in sizes:
        server = ParameterServer.create(torch.zeros(size), 1, TrainSection(optimizer="sgd"))
        try:
            out, grad = torch.empty(size), torch.randn(size)
            server.pull_into(out)
            idle = measure_idle()
            idles.append(idle)

            def pull(s: ParameterServer = server, o: torch.Tensor = out) -> None:
                s.pull_into(o)  # the caller waits for all of it

            pulls.append(measure_call(pull, idle))

            def push(s: ParameterServer = server, g: torch.Tensor = grad) -> float:
                started = time.perf_counter()
                pushes, _ = s.push(g, [0])
                held = time.perf_counter() - started  # the replica goes on from here
                s.settle(pushes)
                return held

            call = measure_call(push, idle)
            update = apply_ns * 1e-9 * size
            call.wall_s = max(call.wall_s - update, 1e-6)
            if call.cpu_s is not None:
                call.cpu_s = max(call.cpu_s - update, 1e-6)
            pushes.append(call)
            nbytes.append(4 * size)
        finally:
            server.kill()
    return message_cost(nbytes, pulls), message_cost(nbytes, pushes), statistics.median(idles)


def _allreduce_worker(rank: int, port: int, sizes: Sequence[int], out: Any) -> None:  # noqa: ANN401
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        times = []
        for size in sizes:
            x = torch.randn(size)
            times.append(timed(lambda x=x: dist.all_reduce(x), repeats=7, warmup=2))
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def measure_allreduce(sizes: Sequence[int] = MESSAGE_SIZES) -> MessageCost:
    """A gloo all-reduce between two processes of this machine, by tensor bytes."""
    from scaleout.comm import free_port

    port = free_port()
    times = in_processes(_allreduce_worker, [(rank, port, list(sizes)) for rank in range(2)], 1)[0]
    fixed, per_byte = fit_line([4 * s for s in sizes], times)
    return MessageCost(fixed_s=fixed, bytes_per_s=1 / per_byte)


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


def measure_checkpoint(numel: int = 4_000_000) -> float:
    """Bytes per second of an atomic, verified checkpoint write."""
    from scaleout.checkpoint import save_checkpoint

    tensors = {"x": torch.randn(numel)}
    with tempfile.TemporaryDirectory() as tmp:
        seconds = timed(lambda: save_checkpoint(Path(tmp) / "c", tensors, {}), repeats=3)
    return 4 * numel / seconds


# --- the whole calibration -------------------------------------------------------------------


def calibrate(
    configs: Sequence[Any],  # noqa: ANN401 - RunConfigs
    say: Callable[[str], None] = print,
) -> Calibration:
    """Measure everything the simulator prices; Ray is started (and stopped) here."""
    from scaleout.runtime import session

    cores = os.cpu_count() or 1
    models = {}
    for config in configs:
        say(f"compute: {config.run.name} at 1..{cores} threads")
        models[model_key(config)] = measure_model(config, cores)
    torch.set_num_threads(1)
    say("shard updates per optimizer")
    apply_ns = measure_apply()
    say("codecs")
    codecs = measure_codecs()
    say("pulls and pushes through a parameter-server shard")
    with session(num_cpus=cores):
        sizes = shard_message_sizes(configs, models)
        pull, push, idle_cores = measure_shard_messages(apply_ns["sgd"], sizes)
    say("gloo all-reduce between two processes")
    allreduce = measure_allreduce()
    say("checkpoint writes")
    checkpoint = measure_checkpoint()
    flatten = measure_flatten()
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
        checkpoint_bytes_per_s=checkpoint,
        flatten_bytes_per_s=flatten,
        idle_cores=idle_cores,
        notes={"torch": torch.__version__, "python": platform.python_version()},
    )
