"""A model's compute on this machine, measured with the library's own code: a training
step per example at 1..all threads, one 1-thread process among several stepping at once,
the share of a step that does not shrink with the batch, DDP's own cost, evaluation, the
loader and the optimizer's step (`ModelCost`)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from scaleout.sim.calibration import ModelCost
from scaleout.sim.measuring import alone_and_together, in_processes, timed

MAX_FIXED_FRACTION = 0.9
THREAD_ROUNDS = 5
SAMPLE_S = 0.25  # at least, per timed sample of steps: a small model's few-ms steps drift
MAX_STEPS = 400


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

    def step(self, parts: int = 1, phase: int = 0) -> None:
        """One step on the first `1 / parts` of the next minibatch (a sync worker's slice of
        it: the loader still makes the whole minibatch), of `phase` (a layer-wise model's)."""
        batch = self.next_batch()
        if parts > 1:
            batch = tuple(t[: len(t) // parts] for t in batch)
        loss, _ = self.objective.step(self.model, self.model, batch, phase)
        loss.backward()

    def backward_fraction(self, steps: int) -> float:
        """The share of a step (at the threads set now) that backward takes: loading, the
        forward pass and the loss, then backward, each timed (medians over `steps`).
        Measured rather than taken from FLOPs: in a small MLP, loading, the forward pass and
        the loss take much more of the step than the third a FLOP count gives the forward."""
        before, after = [], []
        for _ in range(steps + 1):
            started = time.perf_counter()
            loss, _ = self.objective.step(self.model, self.model, self.next_batch(), 0)
            computed = time.perf_counter()
            loss.backward()
            before.append(computed - started)
            after.append(time.perf_counter() - computed)
        forward, backward = statistics.median(before[1:]), statistics.median(after[1:])
        return backward / (forward + backward)

    @property
    def num_phases(self) -> int:
        return getattr(self.model, "num_phases", 1)

    def evaluate_s(self, phase: int = 0) -> float:
        """Seconds per test example of an evaluation (of `phase`: its objective, through
        the frozen stacks below it), as a worker's `evaluate` runs it."""
        batch_size, cpu = self.job.train.eval_batch_size, torch.device("cpu")
        evaluate = lambda: self.objective.evaluate(  # noqa: E731
            self.model, self.test_set, batch_size, cpu, phase
        )
        return timed(evaluate, repeats=3) / len(self.test_set)

    def phase_costs(self, steps: int) -> tuple[list[float], list[float], list[float]]:
        """Per phase of a layer-wise model (greedy training: phase k runs the frozen stacks
        below it too), at the threads set now: seconds per example of a step, the share of
        the step that does not shrink with the work (`fixed_fraction`; a stack of small
        maps is mostly fixed costs), and seconds per test example of its evaluation."""
        seconds, fixed, evaluations = [], [], []
        for phase in range(self.num_phases):
            self.objective.parameter_groups(self.model, phase, 0.0)  # trains phase k only
            self.objective.begin_phase(self.model, self.next_batch(), phase)
            step = lambda phase=phase: self.step(phase=phase)  # noqa: E731
            seconds.append(timed(step, repeats=steps, warmup=1) / self.batch)
            fixed.append(fixed_fraction(self, steps, phase=phase) if self.batch >= 2 else 0.0)
            evaluations.append(self.evaluate_s(phase))
        self.objective.parameter_groups(self.model, 0, 0.0)
        return seconds, fixed, evaluations


def fixed_fraction(stepper: _Stepper, steps: int, rounds: int = 7, phase: int = 0) -> float:
    """The share of a 1-thread step (of `phase`) that does not shrink with the batch: steps
    on the whole minibatch and on half of it, alternately (`t(B) = a + c B`;
    `a = 2 t(B/2) - t(B)`), the median of the rounds' shares (each round's pair is timed
    close together: a shared machine's speed drifts within a minute, which a median of
    all whole and of all half steps would fold into `a`)."""
    shares = []
    for _ in range(rounds):
        whole = timed(lambda: stepper.step(phase=phase), repeats=steps, warmup=1)
        half = timed(lambda: stepper.step(2, phase), repeats=steps, warmup=1)
        shares.append(max(2 * half - whole, 0.0) / whole)
    return min(statistics.median(shares), MAX_FIXED_FRACTION)


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
    work = lambda: timed(stepper.step, repeats=steps, warmup=1)  # noqa: E731
    pairs = alone_and_together(work, rank, rounds, barrier)
    if rank == 0:
        out.put(tuple(statistics.median(column) for column in zip(*pairs, strict=True)))


def measure_concurrent(
    config: Any,  # noqa: ANN401
    processes: int,
    steps: int,
    rounds: int = 5,
) -> tuple[float, float]:
    """Seconds per example of one 1-thread process's step alone and while `processes` step
    at once (memory bandwidth and caches are shared: the machine's real ceiling). Both in
    the same processes, alternately: a process's memory layout alone moves its step by
    several percent, which is not the slow-down sought."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    raw = config.model_dump(mode="json")
    args = [(raw, rank, steps, rounds, barrier) for rank in range(processes)]
    alone, together = in_processes(_alone_and_together, args, 1)[0]
    return alone / config.train.batch_size, together / config.train.batch_size


def _added_s(
    alone: Callable[[], Any], wrapped: Callable[[], Any], rounds: int, repeats: int
) -> float:
    """Seconds `wrapped()` takes beyond `alone()`: each timed in turn (`repeats` after 2
    warm-ups) for `rounds`, the median difference, at least 0."""
    differences = []
    for _ in range(rounds):
        plain = timed(alone, repeats=repeats, warmup=2)
        differences.append(timed(wrapped, repeats=repeats, warmup=2) - plain)
    return max(statistics.median(differences), 0.0)


def _ddp_overhead(raw: dict, port: int, rounds: int, out: Any) -> None:  # noqa: ANN401
    """In a one-process gloo group: a step of one example through DDP less the same step
    without it, alternately (`rounds`); the median difference."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from scaleout.api import config_from_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        stepper = _Stepper(config_from_dict(raw))
        model, objective = stepper.model, stepper.objective
        network = DistributedDataParallel(model)
        batch = tuple(t[:1] for t in stepper.next_batch())

        def step(through: torch.nn.Module) -> None:
            loss, _ = objective.step(model, through, batch, 0)
            loss.backward()

        out.put(_added_s(lambda: step(model), lambda: step(network), rounds, repeats=20))
    finally:
        dist.destroy_process_group()


def measure_ddp(config: Any, rounds: int = 7) -> float:  # noqa: ANN401
    """Seconds per step DDP adds to a config's model besides the all-reduce itself: its
    hooks, copying gradients into buckets, scaling and copying them back (measured on one
    example in a one-process group, where the all-reduce is a local copy)."""
    from scaleout.comm import free_port

    args = [(config.model_dump(mode="json"), free_port(), rounds)]
    return in_processes(_ddp_overhead, args, 1)[0]


def _fsdp_overhead(raw: dict, port: int, rounds: int, out: Any) -> None:  # noqa: ANN401
    """In a one-process gloo group: a sync worker's step (its slice of the batch, forward,
    backward, the optimizer) with the model sharded by `fsdp.shard` as the config asks,
    less the same step of an unsharded copy, alternately (`rounds`); the median
    difference. One rank's collectives are local copies, so this is FSDP2's own work: its
    hooks, the copies into and out of its flat buffers, DTensor's dispatch."""
    import copy

    import torch.distributed as dist

    from scaleout.api import config_from_dict
    from scaleout.nn.optim import build_optimizer
    from scaleout.parallel import fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        config = config_from_dict(raw)
        stepper = _Stepper(config)
        plain, objective = stepper.model, stepper.objective
        sharded = copy.deepcopy(plain)
        fsdp.shard(sharded, config.sync.fsdp_blocks)
        options = stepper.job.optimizer_options()
        optimizers = {id(m): build_optimizer(m.parameters(), options) for m in (plain, sharded)}
        slice_ = max(1, stepper.batch // config.sync.num_workers)
        batch = tuple(t[:slice_] for t in stepper.next_batch())

        def step(model: torch.nn.Module) -> None:
            optimizer = optimizers[id(model)]
            optimizer.zero_grad(set_to_none=True)
            loss, _ = objective.step(model, model, batch, 0)
            loss.backward()
            optimizer.step()

        out.put(_added_s(lambda: step(plain), lambda: step(sharded), rounds, repeats=10))
    finally:
        dist.destroy_process_group()


def measure_fsdp(config: Any, rounds: int = 5) -> float | None:  # noqa: ANN401
    """Seconds per step FSDP2 adds to a sync worker of `config` besides its collectives
    (`_fsdp_overhead`); None for a model `fsdp.shard` cannot shard."""
    from scaleout.comm import free_port

    args = [(config.model_dump(mode="json"), free_port(), rounds)]
    try:
        return in_processes(_fsdp_overhead, args, 1)[0]
    except Exception:  # a model FSDP cannot shard: the simulator prices copies instead
        return None


def _after_steps(
    stepper: _Stepper, steps: int, work: Callable[[], Any], before: Callable[[], Any] | None = None
) -> float:
    """Median seconds of `work()` right after each of `steps` training steps (`before()`
    ahead of each step); one more step and its `work` first, left out (a warm-up)."""
    times = []
    for _ in range(steps + 1):
        if before is not None:
            before()
        stepper.step()
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def optimizer_after_step(stepper: _Stepper, steps: int) -> float:
    """Median seconds of the config's optimizer step right after a training step, as a
    sync worker runs it (zero the gradients, step, then the optimizer): its state comes
    cold from memory the forward and backward passes went through. Back to back on one
    gradient it runs from the caches and costs less, which would underprice a run. The
    first step, left out, builds the optimizer's state."""
    from scaleout.nn.optim import build_optimizer

    optimizer = build_optimizer(stepper.model.parameters(), stepper.job.train)
    return _after_steps(
        stepper, steps, optimizer.step, lambda: optimizer.zero_grad(set_to_none=True)
    )


def zero_after_step(stepper: _Stepper, steps: int) -> float:
    """Median seconds to zero a gradient buffer of the model's size right after a training
    step, as a Downpour replica zeroes its flat gradient after each push: the step has
    evicted it from the caches. Back to back it stays in them and costs less, which would
    underprice a run."""
    flat = torch.ones(sum(p.numel() for p in stepper.model.parameters() if p.requires_grad))
    return _after_steps(stepper, steps, flat.zero_)


def measure_model(config: Any, cores: int, steps: int = 20) -> ModelCost:  # noqa: ANN401
    """A training step per example of `config`'s model at 1..`cores` threads, and of one
    1-thread process among 1..`cores` stepping at once; DDP's own cost for a sync config.
    `steps`: at least, per measurement; more for a fast model, so that each timed sample
    lasts `SAMPLE_S` (half of them per sample)."""
    from scaleout.info import describe_model

    stepper = _Stepper(config)
    model, batch = stepper.model, stepper.batch
    saved = torch.get_num_threads()
    try:
        model.train()
        torch.set_num_threads(1)
        probe = timed(stepper.step, repeats=3, warmup=1)
        steps = min(max(steps, 2 * math.ceil(SAMPLE_S / probe)), MAX_STEPS)
        # rounds over the thread counts: the machine's step drifts within seconds, so
        # every count is sampled across the same span
        samples: dict[int, list[float]] = {t: [] for t in range(1, cores + 1)}
        for _ in range(THREAD_ROUNDS):
            for threads in samples:
                torch.set_num_threads(threads)
                samples[threads].append(timed(stepper.step, repeats=steps // 2, warmup=1))
        train_s = {t: statistics.median(times) / batch for t, times in samples.items()}
        torch.set_num_threads(1)
        phase_s, phase_fixed, phase_eval_s = (
            stepper.phase_costs(steps // 2) if stepper.num_phases > 1 else ([], [], [])
        )
        fixed = fixed_fraction(stepper, steps) if batch >= 2 else 0.0
        load_s = timed(stepper.next_batch, repeats=steps) / batch
        optimizer_s = optimizer_after_step(stepper, steps)
        zero_s = zero_after_step(stepper, min(steps, 10))
        backward_fraction = stepper.backward_fraction(steps)
        eval_s = stepper.evaluate_s()
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
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    ddp_s = fsdp_s = None
    if config.train.strategy == "sync":
        ddp_s = measure_ddp(config)
        fsdp_s = measure_fsdp(config)  # (either mode: the calibration prices both)
    return ModelCost(
        ddp_s=ddp_s,
        fsdp_s=fsdp_s,
        num_parameters=sum(numels),
        parameter_numels=numels,
        fixed_fraction=fixed,
        forward_flops=flops,
        batch_size=batch,
        train_s=train_s,
        phase_s=phase_s,
        phase_fixed_fraction=phase_fixed,
        phase_eval_s=phase_eval_s,
        concurrent_s=concurrent_s,
        eval_s=eval_s,
        load_s=load_s,
        optimizer_s=optimizer_s,
        zero_s=zero_s,
        backward_fraction=backward_fraction,
        train_size=stepper.train_size,
        test_size=stepper.test_size,
    )
