"""Calls between processes of this machine, measured: pulls and pushes through a real
parameter-server shard on Ray, a gloo all-reduce and a model-parallel exchange between two
processes, by size, in wall time and in the core-seconds all processes spend on them
(`MessageCost`)."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scaleout.sim.calibration import MessageCost, ModelCost
from scaleout.sim.measuring import fit_line, in_processes, model_key

if TYPE_CHECKING:
    from scaleout.ps import ParameterServer

MESSAGE_SIZES = (65_536, 1_048_576, 4_194_304)  # values (float32)
ALLREDUCE_SIZES = (16_384, 65_536, 262_144, 1_048_576, 4_194_304)
COLLECTIVE_MIN_S = 1.0  # of two-process collectives per size, in all rounds together
COLLECTIVE_ROUNDS = 4
SHARD_MESSAGE_MIN_S = 1.0  # per call and size, over all rounds
AVERAGE_SIZES = (262_144, 1_048_576, 4_194_304)
AVERAGE_PIECES = 8  # tensors averaged together (a small network's weights and state)


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
    """One call's wall seconds (mean), and core-seconds: all processes', the caller's."""

    wall_s: float
    cpu_s: float | None
    caller_cpu_s: float
    caller_wall_s: float | None = None  # until the caller went on, when `fn` says


@dataclass
class Timed:
    """A call to measure (`measure_calls`): `fn` may return the seconds its caller was held
    up; `before` runs ahead of each call, its own thread CPU not counted (a caller's
    compute); `around` holds while the call is timed (other processes computing)."""

    fn: Callable[[], float | None]
    before: Callable[[], None] | None = None
    around: Callable[[], AbstractContextManager[Any]] = nullcontext


def measure_calls(
    calls: Sequence[Timed], idle: float, min_s: float = 0.8, warmup: int = 20, rounds: int = 5
) -> list[CallCost]:
    """Each call repeated for at least `min_s` (the CPU counters tick at 100 Hz), after
    `warmup` calls (Ray's object store is slower until its memory has been used once); the
    machine's busy cores less `idle` cores of background.

    The calls take turns over `rounds` rounds of `min_s / rounds` each, and each cost is
    the median over the rounds of the round's mean. Means within a round, not medians: a
    call's times have a long tail, and a run pays every call. Medians over rounds, and
    rounds rather than one run per call: a shared machine disturbs one second in a few,
    and such a run would set the size's price outright."""
    for call in calls:
        with call.around():
            for _ in range(warmup):
                call.fn()
    per_round: list[list[CallCost]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, costs in zip(calls, per_round, strict=True):
            with call.around():
                costs.append(_run(call, idle, min_s / rounds, max(3, math.ceil(9 / rounds))))
    return [_median(costs) for costs in per_round]


def _run(call: Timed, idle: float, min_s: float, min_calls: int) -> CallCost:
    times: list[float] = []
    held: list[float] = []
    excluded = 0.0  # thread CPU of `before`
    busy, own, started = busy_cores_s(), time.process_time(), time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - started < min_s:
        if call.before is not None:
            began = time.thread_time()
            call.before()
            excluded += time.thread_time() - began
        begin = time.perf_counter()
        caller = call.fn()
        times.append(time.perf_counter() - begin)
        if caller is not None:
            held.append(caller)
    elapsed, count = time.perf_counter() - started, len(times)
    caller_cpu = (time.process_time() - own - excluded) / count
    after = busy_cores_s()
    total = None
    if busy is not None and after is not None:
        total = (after - busy - excluded - idle * elapsed) / count
    caller_wall = statistics.mean(held) if held else None
    return CallCost(statistics.mean(times), total, caller_cpu, caller_wall)


def _median(costs: Sequence[CallCost]) -> CallCost:
    """Each field's median over the rounds."""
    cpus = [c.cpu_s for c in costs]
    held = [c.caller_wall_s for c in costs]
    return CallCost(
        statistics.median(c.wall_s for c in costs),
        None if None in cpus else statistics.median(cpus),  # type: ignore[type-var]
        statistics.median(c.caller_cpu_s for c in costs),
        None if None in held else statistics.median(held),  # type: ignore[type-var]
    )


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


def shard_slices(config: Any, numel: int) -> list[int]:  # noqa: ANN401 - a RunConfig
    """fp32 values of each shard's call for `config`'s model of `numel` parameters
    (Downpour's fp32 slices; Sandblaster's float64 vectors as twice as many fp32 values);
    none for a strategy without shards."""
    from scaleout.ps.layout import shard_ranges

    section = getattr(config, config.train.strategy, None)
    num_shards = getattr(section, "num_shards", None)
    if not num_shards:
        return []
    width = 2 if config.train.strategy == "sandblaster" else 1
    return [width * (stop - start) for start, stop in shard_ranges(numel, min(num_shards, numel))]


def shard_message_sizes(configs: Sequence[Any], models: dict[str, ModelCost]) -> list[int]:  # noqa: ANN401
    """Values per call to measure: `MESSAGE_SIZES` and every shard slice the configs send
    (`shard_slices`)."""
    sizes = set(MESSAGE_SIZES)
    for config in configs:
        sizes.update(shard_slices(config, models[model_key(config)].num_parameters))
    return sorted(sizes)


def measure_shard_messages(
    apply_ns: float, sizes: Sequence[int] = MESSAGE_SIZES, resource: str | None = None
) -> tuple[MessageCost, MessageCost, float]:
    """(pull, push, idle cores) through a real one-shard `ParameterServer` on this machine's
    Ray (on the node offering `resource`, when given). A push is timed to its
    acknowledgement; the shard's SGD update (`apply_ns` per value, priced on its own) is
    taken out."""
    from scaleout.ps import ParameterServer
    from scaleout.train.config import TrainSection

    servers: list[ParameterServer] = []
    try:
        calls = []
        for size in sizes:  # every size's shard up at once: their calls take turns
            server = ParameterServer.create(
                torch.zeros(size), 1, TrainSection(optimizer="sgd"), resource=resource
            )
            servers.append(server)
            out = torch.empty(size)
            server.pull_into(out)
            # a replica's gradient: in the buffer the server shares with the shard on this
            # node, which a push names where it lies (elsewhere: copied or sent)
            buffer = server.gradient_buffer()
            grad = (buffer if buffer is not None else torch.empty(size)).normal_()

            def pull(s: ParameterServer = server, o: torch.Tensor = out) -> None:
                s.pull_into(o)  # the caller waits for all of it

            def push(s: ParameterServer = server, g: torch.Tensor = grad) -> float:
                started = time.perf_counter()
                pushes, _ = s.push(g, [0])
                held = time.perf_counter() - started  # the replica goes on from here
                s.settle(pushes)
                return held

            calls += [Timed(pull), Timed(push)]
        idle = measure_idle()
        costs = measure_calls(calls, idle, min_s=SHARD_MESSAGE_MIN_S)
    finally:
        for server in servers:
            server.kill()
    pulls, pushes = costs[0::2], costs[1::2]
    for size, call in zip(sizes, pushes, strict=True):
        update = apply_ns * 1e-9 * size
        call.wall_s = max(call.wall_s - update, 1e-6)
        if call.cpu_s is not None:
            call.cpu_s = max(call.cpu_s - update, 1e-6)
    nbytes = [4 * size for size in sizes]
    return message_cost(nbytes, pulls), message_cost(nbytes, pushes), idle


def shard_round_trip(server: ParameterServer, values: torch.Tensor, grad: torch.Tensor) -> None:
    """A replica's pull into `values`, then its push of `grad`, waited for until every
    shard applied it: the pair the after-compute and beside-calls measurements repeat."""
    server.pull_into(values)
    pushes, _ = server.push(grad, [0] * len(server.shards))
    server.settle(pushes)


def measure_collect(
    shard_counts: Sequence[int] = (1, 4), numel: int = 65_536, pushes: int = 60, warmup: int = 10
) -> tuple[float, float]:
    """(seconds per push, seconds per shard) a replica spends collecting the answers of a
    push the shards have applied: `ReplicaClient._collect` as its next push calls it (a
    `ray.get` per shard, the staleness and the push's record), measured through a real
    client and server with 1 and with 4 shards, a line through the two. Priced apart from
    the push's calls: a call's measurement settles its push at once, waiting for it."""
    import ray
    from torch import nn

    from scaleout.ps import ParameterServer
    from scaleout.ps.client import ReplicaClient
    from scaleout.train.config import TrainSection

    medians = []
    for count in shard_counts:
        param = nn.Parameter(torch.zeros(numel))
        server = ParameterServer.create(torch.zeros(numel), count, TrainSection(optimizer="sgd"))
        try:
            client = ReplicaClient([([param], server)])
            times = []
            for _ in range(warmup + pushes):
                client.push()
                futures = [p.future for ps, _ in client._pending for _, group in ps for p in group]
                ray.wait(futures, num_returns=len(futures))  # every shard has applied it
                started = time.perf_counter()
                client._collect(wait=True)  # what the next push calls first
                times.append(time.perf_counter() - started)
            client.take_records()
            medians.append(statistics.median(times[warmup:]))
        finally:
            server.kill()
    fixed, per_shard = fit_line(list(shard_counts), medians)
    return max(fixed, 0.0), max(per_shard, 0.0)


def _calls_for(once: Callable[[], None], seconds: float) -> int:
    """How many calls of `once()` (a collective of two gloo ranks) last `seconds`, at
    least 9, agreed by both ranks (each makes as many)."""
    import torch.distributed as dist

    for _ in range(3):
        once()
    began = time.perf_counter()
    for _ in range(3):
        once()
    each = max((time.perf_counter() - began) / 3, 1e-6)
    count = torch.tensor([max(9, math.ceil(seconds / each))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@contextmanager
def gloo_pair(rank: int, port: int) -> Iterator[None]:
    """Rank `rank` of a two-process gloo group on this machine, one torch thread."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def on_two_ranks(target: Callable[..., None], *args: Any) -> list[Any]:  # noqa: ANN401
    """`target(rank, port, *args, queue)` in two spawned processes (which meet in
    `gloo_pair(rank, port)` and put `(rank, answer)`); the answers in rank order."""
    from scaleout.comm import free_port

    port = free_port()
    answers = in_processes(target, [(rank, port, *args) for rank in range(2)], 2)
    return [answer for _, answer in sorted(answers, key=lambda a: a[0])]


def _two_ranks(
    rank: int,
    port: int,
    sizes: Sequence[int],
    call_for: Callable[[int, int], Callable[[], None]],
    out: Any,  # noqa: ANN401
) -> None:
    """One of two gloo ranks: per size, the mean wall seconds of a call of `call_for(rank,
    size)` and this process's CPU seconds per call, gloo's threads included. Means, not
    medians: gloo's threads poll, so a median call's wall time against the mean CPU would
    claim more cores than the machine has. The sizes take turns over `COLLECTIVE_ROUNDS`
    rounds of `COLLECTIVE_MIN_S / COLLECTIVE_ROUNDS` each: a call's mean drifts from one
    round to the next, and the sizes' costs are compared with one another, so each size
    must see every part of the drift."""
    with gloo_pair(rank, port):
        calls = [call_for(rank, size) for size in sizes]
        counts = [_calls_for(once, COLLECTIVE_MIN_S / COLLECTIVE_ROUNDS) for once in calls]
        walls, cpus = [0.0] * len(sizes), [0.0] * len(sizes)
        for _ in range(COLLECTIVE_ROUNDS):
            for i, (once, count) in enumerate(zip(calls, counts, strict=True)):
                own, started = time.process_time(), time.perf_counter()
                for _ in range(count):
                    once()
                walls[i] += time.perf_counter() - started
                cpus[i] += time.process_time() - own
        total = [count * COLLECTIVE_ROUNDS for count in counts]
        per_call = lambda sums: [v / n for v, n in zip(sums, total, strict=True)]  # noqa: E731
        out.put((rank, (per_call(walls), per_call(cpus))))


def allreduce_call(rank: int, size: int) -> Callable[[], None]:
    """An all-reduce of `size` values."""
    import torch.distributed as dist

    x = torch.randn(size)
    return lambda: dist.all_reduce(x)


def allgather_call(rank: int, size: int) -> Callable[[], None]:
    """FSDP's all-gather: each of two ranks gives half of `size` values, both get all."""
    from scaleout.compress.flat_collectives import all_gather_flat

    whole, half = torch.empty(size - size % 2), torch.randn(size // 2)
    return lambda: all_gather_flat(whole, half)


def reduce_scatter_call(rank: int, size: int) -> Callable[[], None]:
    """FSDP's reduce-scatter: `size` values summed over two ranks, each keeps half."""
    from scaleout.compress.flat_collectives import reduce_scatter_flat

    whole, half = torch.randn(size - size % 2), torch.empty(size // 2)
    return lambda: reduce_scatter_flat(half, whole)


def average_call(rank: int, size: int) -> Callable[[], None]:
    """Sync "average" mode's `average_tensors` of `size` values in `AVERAGE_PIECES`
    tensors: flattened, all-reduced, scaled and copied back."""
    from scaleout.parallel import average_tensors

    base, extra = divmod(size, AVERAGE_PIECES)
    tensors = [torch.randn(base + (1 if i < extra else 0)) for i in range(AVERAGE_PIECES)]
    return lambda: average_tensors(tensors)


def exchange_call(rank: int, size: int) -> Callable[[], None]:
    """An exchange of a (1, 1, 2, size) distributed array: each rank holds a row and needs
    both, so it sends `size` values to the other, as a model-parallel exchange moves a
    halo (`scaleout.comm.darray.exchange`: cutting, the all-to-all, placing)."""
    from scaleout.comm.darray import ExchangePlan, exchange
    from scaleout.comm.windows import Window

    rows = [Window(range(0, 1), range(size)), Window(range(1, 2), range(size))]
    whole = Window(range(0, 2), range(size))
    plan = ExchangePlan.build(rank, rows, [whole, whole])
    local = torch.randn(1, 1, 1, size)
    return lambda: exchange(local, plan)


def _measure_two_ranks(
    call_for: Callable[[int, int], Callable[[], None]], sizes: Sequence[int]
) -> MessageCost:
    """`call_for`'s collective between two processes of this machine, by bytes of `sizes`
    values: wall time, and the core-seconds of both processes (the caller's share: one
    rank's)."""
    (walls, cpus0), (_, cpus1) = on_two_ranks(_two_ranks, list(sizes), call_for)
    calls = [CallCost(wall, c0 + c1, c0) for wall, c0, c1 in zip(walls, cpus0, cpus1, strict=True)]
    return message_cost([4 * s for s in sizes], calls)


EXCHANGE_SIZES = (100, 1_000, 10_000, 100_000, 1_000_000)  # values each rank sends the other


def measure_exchange(sizes: Sequence[int] = EXCHANGE_SIZES) -> MessageCost:
    """A model-parallel exchange between two processes of this machine, by bytes each
    sends the other (`exchange_call`)."""
    return _measure_two_ranks(exchange_call, sizes)


def allreduce_sizes(configs: Sequence[Any], models: dict[str, ModelCost]) -> list[int]:  # noqa: ANN401
    """Values per all-reduce to measure: `ALLREDUCE_SIZES`, and what the configs' sync runs
    reduce (the whole gradient, DDP's buckets, the averaged weights and optimizer state)."""
    from scaleout.nn.optim import state_buffers
    from scaleout.sim.sync import ddp_buckets

    sizes = set(ALLREDUCE_SIZES)
    for config in configs:
        if config.train.strategy != "sync":
            continue
        cost = models[model_key(config)]
        numel = cost.num_parameters
        sizes.update({numel, numel * (1 + state_buffers(config.train.optimizer))})
        sizes.update(ddp_buckets(cost.parameter_numels or [numel]))
    return sorted(sizes)


def measure_allreduce(sizes: Sequence[int] = ALLREDUCE_SIZES) -> MessageCost:
    """A gloo all-reduce between two processes of this machine, by tensor bytes."""
    return _measure_two_ranks(allreduce_call, sizes)


def measure_fsdp_collectives(sizes: Sequence[int]) -> tuple[MessageCost, MessageCost]:
    """FSDP's all-gather and reduce-scatter between two processes of this machine, by
    bytes of the whole (gathered) tensor: gloo's are not the ring halves of an all-reduce
    (on CPU its reduce-scatter costs more than a whole all-reduce)."""
    return _measure_two_ranks(allgather_call, sizes), _measure_two_ranks(reduce_scatter_call, sizes)


def average_sizes(configs: Sequence[Any], models: dict[str, ModelCost]) -> list[int]:  # noqa: ANN401
    """Values per `average_tensors` to measure: `AVERAGE_SIZES`, and what the configs' sync
    runs in "average" mode average (weights and optimizer state every step; the weights for
    an evaluation)."""
    from scaleout.nn.optim import state_buffers

    sizes = set(AVERAGE_SIZES)
    for config in configs:
        if config.train.strategy == "sync" and config.sync.mode == "average":
            numel = models[model_key(config)].num_parameters
            sizes.update({numel, numel * (1 + state_buffers(config.train.optimizer))})
    return sorted(sizes)


def measure_average(sizes: Sequence[int] = AVERAGE_SIZES) -> MessageCost:
    """Sync's `average_tensors` between two processes of this machine, by tensor bytes:
    the all-reduce and the local work around it, both ranks' copies at once."""
    return _measure_two_ranks(average_call, sizes)
