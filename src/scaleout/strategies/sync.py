"""Strategy "sync": synchronous data parallelism (Ding et al. 2015, section 2.2).

`sync.num_workers` Ray actors form one torch.distributed group (gloo on CPU, NCCL on GPU).
`train.batch_size` is the effective batch: the examples of global batch k are the ones
strategy "single" would use, and worker r trains on slice r of them, so for one worker this
strategy IS strategy "single" (same initial weights, data order, dropout stream and
optimizer), and every extra worker only splits the batch.

Communication schedule per step, by `sync.mode`:

- `allreduce`: PyTorch DDP. During backward, gradient buckets are all-reduced and averaged
  as soon as they are ready (overlapping the rest of backward); every worker then applies
  the same averaged gradient, so all replicas stay identical. With `[compress] codec` other
  than fp32, the bucket travels through `scaleout.compress.ddp_hook` (8-bit codes,
  all-gathered). For SGD this equals one worker on the concatenated batch. Buffers (e.g.
  BatchNorm statistics) are rank 0's: DDP broadcasts them before every forward pass.
- `average`: the paper's scheme. Each worker steps on its own slice with its own
  optimizer; every `average_every` steps one all-reduce (coalesced into a flat buffer per
  dtype) averages the parameters, floating buffers (BatchNorm statistics) AND the optimizer
  state (momentum, Adam moments). Evaluation uses the average of the current weights without
  changing the workers; a checkpoint is a synchronisation point (the workers average first).

With `model_parallel.stages = S`, every worker is a pipeline of S stage workers
(`scaleout.parallel.pipeline`): `num_workers` x S actors, pipeline k training slice k of
each global batch, and each stage's gradient averaged with the same stage of the other
pipelines before the step.

Checkpoints hold rank 0's model and optimizer and every rank's RNG state, in strategy
"single"'s format. Synchronous training cannot go on without a worker: when one dies, the
run stops with `WorkerDied`, naming the worker and the last checkpoint (`--resume`
continues).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import PositiveInt

from scaleout.config import Section, TimeoutSeconds
from scaleout.errors import ConfigError
from scaleout.strategies.group import ActorWorkers
from scaleout.strategies.layout import ModelParallelSection, check_pipeline
from scaleout.strategies.lockstep import Lockstep, Workers
from scaleout.strategies.role import Role
from scaleout.strategies.worker import Worker, WorkerChunk
from scaleout.train.job import Job
from scaleout.train.protocol import Chunk, Tensors


class SyncSection(Section):
    """Synchronous data parallelism (Ding et al. 2015): `num_workers` workers in lock step.

    `train.batch_size` is the effective (global) batch: each worker gets an equal slice of
    it. `allreduce`: PyTorch DDP averages gradients every step (with `[compress] codec` as
    its communication hook). `average`: every worker steps on its own slice, then weights
    and optimizer state (momentum) are averaged every `average_every` steps (1: the paper).
    `fsdp`: each worker holds 1/N of the parameters, gradients and optimizer state
    (PyTorch's FSDP2, `scaleout.parallel.fsdp`), sharded per module of a class in
    `fsdp_blocks` (None: per direct child that holds parameters), then the root; the same
    steps as `allreduce` for a model too big for one worker.
    """

    # data-parallel workers (with model_parallel.stages = S: pipelines of S workers each);
    # each trains an equal slice of train.batch_size, which must be a multiple of it
    num_workers: PositiveInt = 2
    mode: Literal["allreduce", "average", "fsdp"] = "allreduce"  # how workers combine: see above
    # "average": steps between the averages of weights and optimizer state; others ignore it
    average_every: PositiveInt = 1
    fsdp_blocks: list[str] | None = None  # module class names, e.g. ["GPT2Block"]
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL on CUDA, else gloo
    timeout_s: TimeoutSeconds = 300.0  # a collective waiting longer than this fails


def check_fsdp(job: Job, blocks: list[str] | None) -> None:
    """Block classes the model has, one line otherwise; and what sharded data parallelism
    cannot do yet: fp16's loss scaling. (A `[compress]` codec compresses its all-gathers
    and reduce-scatters: `scaleout.compress.fsdp`.)"""
    probe = job.probe
    if blocks is not None and probe is not None and probe.module_classes:
        missing = [name for name in blocks if name not in probe.module_classes]
        if missing:
            raise ConfigError(
                f"sync.fsdp_blocks = {blocks}: {', '.join(missing)} match no module of the "
                f"model; its module classes are {', '.join(sorted(probe.module_classes))}"
            )
    if job.run.precision == "fp16":
        raise ConfigError(
            'run.precision = "fp16" with sync.mode = "fsdp": use "bf16", which needs no loss '
            "scaling"
        )


class Sync(Lockstep):
    name = "sync"

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.opts = job.section("sync", SyncSection)
        if job.train.batch_size % self.opts.num_workers:
            raise ConfigError(
                f"train.batch_size = {job.train.batch_size} must be a multiple of "
                f"sync.num_workers = {self.opts.num_workers} (each worker trains on an equal "
                "slice of the batch)"
            )
        micro, workers = job.train.accumulate_steps, self.opts.num_workers
        if micro > 1 and (job.train.batch_size // workers) % micro:
            raise ConfigError(
                f"train.accumulate_steps = {micro} does not divide each worker's slice of "
                f"train.batch_size = {job.train.batch_size} over sync.num_workers = "
                f"{workers}: make the batch a multiple of {micro * workers}"
            )
        probe = job.probe
        if (
            probe is not None
            and self.opts.num_workers > 1
            and probe.train_size < job.train.batch_size
        ):
            raise ConfigError(
                f"train.batch_size = {job.train.batch_size}: the training set has only "
                f"{probe.train_size} examples, and sync splits every batch over "
                f"{self.opts.num_workers} workers; use a batch of at most {probe.train_size}"
            )
        if self.opts.mode == "fsdp":
            check_fsdp(job, self.opts.fsdp_blocks)
        elif self.opts.fsdp_blocks is not None:
            raise ConfigError(
                f'sync.fsdp_blocks is for sync.mode = "fsdp" (now "{self.opts.mode}"): set the '
                "mode or drop the blocks"
            )
        if probe is not None and probe.layerwise:
            raise ConfigError(
                f'train.strategy = "sync" trains supervised models; model ({job.model.name}) '
                'trains layer-wise: use strategy "single", "model_parallel" or "downpour"'
            )
        self.pipes = job.section("model_parallel", ModelParallelSection)
        self.stages = self.pipes.stages
        if self.pipes.grid != [1, 1] or self.pipes.tensor > 1:
            raise ConfigError(
                "model_parallel.grid and model_parallel.tensor are for strategy "
                '"model_parallel"; under sync each worker may be a pipeline '
                "(model_parallel.stages): drop them or change the strategy"
            )
        if self.stages > 1:
            self._check_pipelines()

    def _check_pipelines(self) -> None:
        """Pipelines side by side: what each trains (`check_pipeline`), with gradients
        averaged in fp32 as DDP's are (not yet compressed, not sharded or averaged every
        few steps)."""
        job, stages = self.job, self.stages
        refusals = [
            (self.opts.mode != "allreduce", f'sync.mode = "{self.opts.mode}": use "allreduce"'),
            (
                job.compress.codec != "fp32",
                f'compress.codec = "{job.compress.codec}": the pipelines average their '
                'gradients in fp32 (not yet compressed); use "fp32"',
            ),
        ]
        for refused, fix in refusals:
            if refused:
                raise ConfigError(f"model_parallel.stages = {stages} under sync with {fix}")
        check_pipeline(job, self.pipes, pipelines=self.opts.num_workers)

    def role_options(self) -> dict[str, Any]:
        mode = self.opts.mode
        blocks = self.opts.fsdp_blocks
        if self.stages > 1:  # pipelines: their gradients averaged stage by stage
            return dict(
                sliced=True,
                stages=self.stages,
                microbatches=self.pipes.num_microbatches,
                pipeline_schedule=self.pipes.schedule,
            )
        return dict(
            sliced=True,
            ddp=mode == "allreduce",
            average_every=self.opts.average_every if mode == "average" else None,
            fsdp=mode == "fsdp",
            fsdp_blocks=tuple(blocks) if blocks is not None else None,
        )

    def make_workers(self, role: Role) -> Workers:
        return ActorWorkers(
            self.job,
            role,
            self.opts.num_workers * self.stages,
            "sync worker",
            self.where,
            self.opts.backend,
            self.opts.timeout_s,
        )

    def combine(self, outs: list[WorkerChunk]) -> Chunk:
        """Every worker trained its slice: sums add up (a pipeline's stages report the same,
        its first stage counts); the slowest worker's times count."""
        outs = outs[:: self.stages]
        chunk = outs[0]
        chunk.examples = sum(o.examples for o in outs)
        chunk.loss_sum = sum(o.loss_sum for o in outs)
        if chunk.correct is not None:
            chunk.correct = sum(o.correct or 0.0 for o in outs)
        chunk.seconds = max(o.seconds or 0.0 for o in outs)
        for key in ("data_wait_s", "average_s"):
            if key in chunk.fields:
                chunk.fields[key] = max(o.fields[key] for o in outs)
        return chunk

    def state(self) -> tuple[Tensors, dict[str, Any]]:
        assert self.workers is not None
        self.workers.call(Worker.average_now)
        sharded = self.opts.mode == "fsdp"  # gathering the shards is a collective
        ranks = None if sharded else self.stages  # (the first pipeline's stages gather)
        tensors, meta = self.workers.call(Worker.state, ranks=ranks)[0]
        for rank, rng in enumerate(self.workers.call(Worker.rng_state)[1:], start=1):
            tensors[f"rng.torch.{rank}"] = rng
        meta.update(num_workers=self.opts.num_workers, mode=self.opts.mode)
        return tensors, meta

    def summary(self) -> dict[str, Any]:
        """The layout, and the parameter and optimizer bytes the fullest worker holds."""
        held = self.held_bytes() if self.workers is not None else {}
        layout: dict[str, Any] = {"num_workers": self.opts.num_workers, "mode": self.opts.mode}
        if self.stages > 1:
            layout.update(stages=self.stages, microbatches=self.pipes.num_microbatches)
        return {**layout, **held}


def create(job: Job) -> Sync:
    return Sync(job)
