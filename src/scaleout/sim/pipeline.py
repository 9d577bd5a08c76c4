"""Pipeline stages (`model_parallel.stages`) as a simulation: the schedules' bubbles, with
the stages and their messages from the library's own plan.

The plan is `scaleout.parallel.stages.split` of the config's model (built on PyTorch's meta
device); one example run through the stages one after another (`torch.utils.flop_counter`)
gives each stage's share of the forward FLOPs, hence of the step's compute, and the values
each stage sends on per example. Under strategy "model_parallel" there is one pipeline;
under "sync", `sync.num_workers` pipelines side by side, each on its slice of the batch.

One step of a pipeline, as `torch.distributed.pipelining` runs it: the batch is cut into
`model_parallel.microbatches`; each stage runs its schedule's order of forward (F) and
backward (B) micro-batches:

- "gpipe": every F, then every B;
- "1f1b": min(M, S - s) F on stage s, then B and F in turn, then the B left;

a stage's F of micro-batch m waits for stage s - 1's activation of m, its B for stage
s + 1's gradient of m (a message the size of the activation, fp32; bf16 under autocast;
with `[compress]`, the codec's payload, and an encode and a decode on either side);
sending does not hold the sender. Compute per micro-batch is the model's step at the
micro-batch's size (`ModelCost.step_s`: its fixed share is paid per micro-batch, as the
schedule calls forward per micro-batch) times the stage's share, forward and backward as
measured. After the schedule, the gradients of parameters that several stages hold (tied
weights) are summed over each pipeline, each stage's gradient is all-reduced with the same
stage of the other pipelines (rings, fp32), and each stage steps its share of the optimizer. An
evaluation relays the test batches through the first pipeline; a checkpoint writes the
whole model's state.

Placement: on one machine every stage worker shares its cores; on N machines rank r
(stage r % S of pipeline r // S) is on machine r % N.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from scaleout.compress.activations import activation_codec, payload_numel
from scaleout.errors import ConfigError
from scaleout.parallel import stages as pipeline_stages
from scaleout.sim.engine import Process
from scaleout.sim.setting import Setting, compute_shares, model_cost
from scaleout.sim.sync import (
    BACKWARD_FRACTION,
    LockstepSim,
    checkpoint_bytes,
    ring_allreduce,
    ring_send,
)
from scaleout.sim.wire import link_codec_speed
from scaleout.strategies.layout import ModelParallelSection


@dataclass(frozen=True)
class StagePlan:
    """One stage: its part names, share of the forward FLOPs (else of the parameters),
    parameters, and the values it sends on per example (0 for the last) and their shape."""

    names: tuple[str, ...]
    share: float
    params: int
    sends_per_example: int
    sends_shape: tuple[int, ...] = ()  # of one example's activation, (C, H, W) say
    tied: int = 0  # values of the model's tied parameters, summed over the stages each step


def stage_plans(config: Any, stages: int) -> list[StagePlan]:  # noqa: ANN401 - a RunConfig
    """`split` of the config's model into `stages`, each stage measured on one example."""
    from scaleout.info import example_input

    with torch.device("meta"):
        model = config.model.build()
    try:
        plan = pipeline_stages.split(model, stages)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    x = example_input(config, model)
    flops, sends, params, shapes = [], [], [], []
    with torch.no_grad():
        model.eval()
        for names in plan:
            stage = pipeline_stages.stage_module(model, names)
            counter = FlopCounterMode(display=False)
            with counter:
                x = stage(x)
            flops.append(counter.get_total_flops())
            sends.append(x.numel())
            shapes.append(tuple(x.shape[1:]))
            params.append(sum(p.numel() for p in stage.parameters()))
    sends[-1] = 0  # the last stage's output stays (the loss)
    shares = compute_shares(flops, params)
    tied = sum(math.prod(t.shape) for t in pipeline_stages.tied_parameters(model, plan))
    return [
        StagePlan(tuple(names), share, p, s, shape, tied)
        for names, share, p, s, shape in zip(plan, shares, params, sends, shapes, strict=True)
    ]


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[str]:
    """The order stage `stage` runs its forward ("F<m>") and backward ("B<m>") passes."""
    m = microbatches
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    warmup = min(m, stages - stage)
    order = [f"F{i}" for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        order.append(f"B{backward}")
        backward += 1
        if forward < m:
            order.append(f"F{forward}")
            forward += 1
    return order


class PipelineSim(LockstepSim):
    """One simulated run of `config`'s pipelines in `setting`."""

    def __init__(self, config: Any, setting: Setting) -> None:  # noqa: ANN401
        self.config, self.setting = config, setting
        self.cal = setting.calibration
        self.train = config.train
        self.opts: ModelParallelSection = config.model_parallel
        self.stages = self.opts.stages
        self.microbatches = self.opts.num_microbatches
        self.pipelines = config.sync.num_workers if config.train.strategy == "sync" else 1
        batch = self.train.batch_size
        if batch % (self.pipelines * self.microbatches):
            raise ConfigError(
                f"model_parallel.microbatches = {self.microbatches} does not divide "
                f"train.batch_size = {batch} over {self.pipelines} pipelines"
            )
        self.micro = batch // self.pipelines // self.microbatches  # examples per micro-batch
        self.plans = stage_plans(config, self.stages)
        self.cost = model_cost(config, self.cal)
        self.threads = config.run.num_threads or 1
        self.cluster = setting.cluster()
        workers = self.pipelines * self.stages
        for machine in self.cluster.machines:
            machine.cores.slowdown = self.cost.slowdown
        self.env = self.cluster.env
        self.where = [r % setting.machines for r in range(workers)]
        micro_s = self.cost.step_s(self.micro, self.threads)
        backward = self.cost.backward_fraction or BACKWARD_FRACTION
        self.forward_s = [micro_s * (1 - backward) * p.share for p in self.plans]
        self.backward_s = [micro_s * backward * p.share for p in self.plans]
        self.dtype = torch.bfloat16 if config.run.precision == "bf16" else torch.float32
        compress = config.compress
        codec = compress.build_for_collectives(link_codec_speed(self.cal, compress))
        self.codec = activation_codec(codec) if codec is not None else None
        self.message_bytes = [self._bytes(self.micro, p) for p in self.plans]
        for s in range(self.stages - 1):  # a crossing's encode and decode, both ways
            numel = self.micro * self.plans[s].sends_per_example
            self.forward_s[s] += self._coding_s(numel, "encode")
            self.backward_s[s] += self._coding_s(numel, "decode")
            self.forward_s[s + 1] += self._coding_s(numel, "decode")
            self.backward_s[s + 1] += self._coding_s(numel, "encode")
        self.compute_s = [0.0] * workers
        self.bubble: list[float] = []  # per step: the share of stage-time not computing
        self.train_s = self.trained_s = 0.0

    def _bytes(self, examples: int, plan: StagePlan) -> int:
        """The bytes `plan`'s activation (or its gradient) for `examples` crosses as: its
        values, or the codec's payload (`scaleout.compress.activations`)."""
        if self.codec is None:
            return examples * plan.sends_per_example * self.dtype.itemsize
        return 4 * payload_numel(self.codec, (examples, *plan.sends_shape), self.dtype)

    def _coding_s(self, numel: int, which: str) -> float:
        """Seconds to encode or decode one crossing of `numel` values (none sent raw)."""
        if self.codec is None or not self.codec.encodes(numel):
            return 0.0
        return self.cal.codec_s(self.codec.name, numel, which)

    def _rank(self, pipeline: int, stage: int) -> int:
        return pipeline * self.stages + stage

    def _compute(self, rank: int, seconds: float) -> Process:
        started = self.env.now
        yield from self.cluster.machines[self.where[rank]].compute(seconds, self.threads)
        self.compute_s[rank] += self.env.now - started

    def _send(self, source: int, dest: int, nbytes: int, arrived: Any) -> Process:  # noqa: ANN401
        local = self.cal.allreduce
        if self.where[source] == self.where[dest] and local is None:
            raise ConfigError(
                "the calibration has no gloo all-reduce between two processes (it prices a "
                "message between two processes of one machine): run `scaleout calibrate` again"
            )
        yield from ring_send(
            self.cluster, self.where[source], self.where[dest], nbytes, local, "activations"
        )
        arrived.succeed()

    def _pipeline_pass(self, pipeline: int) -> Process:
        """Every stage of one pipeline runs its schedule's order."""
        env, stages, m = self.env, self.stages, self.microbatches
        activation = [[env.event() for _ in range(m)] for _ in range(stages)]
        gradient = [[env.event() for _ in range(m)] for _ in range(stages)]

        def stage_pass(s: int) -> Process:
            rank = self._rank(pipeline, s)
            for op in schedule_order(self.opts.schedule, s, stages, m):
                i = int(op[1:])
                if op[0] == "F":
                    if s > 0:
                        yield activation[s][i]
                    yield from self._compute(rank, self.forward_s[s])
                    if s < stages - 1:
                        nbytes = self.message_bytes[s]
                        env.process(self._send(rank, rank + 1, nbytes, activation[s + 1][i]))
                else:
                    if s < stages - 1:
                        yield gradient[s][i]
                    yield from self._compute(rank, self.backward_s[s])
                    if s > 0:
                        nbytes = self.message_bytes[s - 1]
                        env.process(self._send(rank, rank - 1, nbytes, gradient[s - 1][i]))

        yield env.all_of([env.process(stage_pass(s)) for s in range(stages)])

    def _after(self, stage: int) -> Process:
        """Stage `stage` of every pipeline: its gradient averaged over the pipelines, then
        its share of the optimizer."""
        plan = self.plans[stage]
        ranks = [self._rank(k, stage) for k in range(self.pipelines)]
        if self.pipelines > 1:
            machines = [self.where[r] for r in ranks]
            yield from ring_allreduce(self.cluster, machines, 4 * plan.params, self.cal)
        total = max(sum(p.params for p in self.plans), 1)
        seconds = self.cost.optimizer_s * plan.params / total
        env = self.env
        work = [env.process(self.cluster.machines[self.where[r]].work(seconds)) for r in ranks]
        yield env.all_of(work)

    def _step(self) -> Process:
        env = self.env
        started = env.now
        busy = sum(self.compute_s)
        yield env.all_of([env.process(self._pipeline_pass(k)) for k in range(self.pipelines)])
        elapsed = (env.now - started) * len(self.compute_s)
        self.bubble.append(1 - (sum(self.compute_s) - busy) / elapsed if elapsed else 0.0)
        tied = self.plans[0].tied
        if tied:
            yield env.all_of([env.process(self._sum_tied(k, tied)) for k in range(self.pipelines)])
        yield env.all_of([env.process(self._after(s)) for s in range(self.stages)])

    def _sum_tied(self, pipeline: int, values: int) -> Process:
        """The tied parameters' gradients summed over one pipeline's stages (one all-reduce
        of all of them, fp32)."""
        machines = [self.where[self._rank(pipeline, s)] for s in range(self.stages)]
        yield from ring_allreduce(self.cluster, machines, 4 * values, self.cal)

    def _evaluate(self) -> Process:
        """The test set relayed through the first pipeline batch by batch (a stage takes
        the next batch while the one after it computes this one)."""
        env = self.env
        full, rest = divmod(self.cost.test_size, self.train.eval_batch_size)
        batches = [self.train.eval_batch_size] * full + ([rest] if rest else [])
        arrived = [[env.event() for _ in batches] for _ in range(self.stages)]

        def stage_pass(s: int) -> Process:
            plan = self.plans[s]
            for b, size in enumerate(batches):
                if s > 0:
                    yield arrived[s][b]
                yield from self._compute(s, size * self.cost.eval_s * plan.share)
                if s < self.stages - 1:
                    nbytes = self._bytes(size, plan)
                    env.process(self._send(s, s + 1, nbytes, arrived[s + 1][b]))

        yield env.all_of([env.process(stage_pass(s)) for s in range(self.stages)])

    def _checkpoint(self) -> Process:
        numel = sum(p.params for p in self.plans)
        nbytes = checkpoint_bytes(numel, self.train.optimizer)
        yield self.env.timeout(nbytes / self.cal.checkpoint_bytes_per_s)

    def extra(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "pipelines": self.pipelines,
            "microbatches": self.microbatches,
            "schedule": self.opts.schedule,
            "bubble": statistics.mean(self.bubble) if self.bubble else 0.0,
            "message_bytes": list(self.message_bytes[:-1]),
        }
