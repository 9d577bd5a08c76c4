"""How one replica is laid out over workers, the `[model_parallel]` section: a spatial
grid of a layer-wise model (`model_parallel.grid`), pipeline stages (`stages`) or
tensor-parallel Linear layers (`tensor`), and the checks that refuse, in one line before any
worker starts, what a layout cannot train. Strategy "model_parallel" runs one such replica,
sync may make each of its workers a pipeline, and a Downpour replica may be a grid; they
read the layout here, so no strategy imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, PositiveInt
from torch import nn

from scaleout.config import Section, TimeoutSeconds
from scaleout.errors import ConfigError
from scaleout.parallel import PARTITIONABLE, parallelize
from scaleout.parallel.stages import split, tied_parameters
from scaleout.parallel.tensor import check_plan
from scaleout.train.job import Job

__all__ = [
    "ModelParallelSection",
    "check_grid_steps",
    "check_partitionable",
    "check_pipeline",
    "check_tensor",
]


class ModelParallelSection(Section):
    """Model parallelism over a grid of workers (`scaleout.parallel.parallelize`)."""

    grid: Annotated[list[PositiveInt], Field(min_length=2, max_length=2)] = [1, 1]  # [px, py]
    # pipeline stages (`scaleout.parallel.stages`): an nn.Sequential, or a module listing its
    # parts in `pipeline_split`, cut into this many contiguous stages, one per worker
    stages: PositiveInt = 1
    microbatches: PositiveInt | None = None  # per step through the stages; None: 2 x stages
    # micro-batch order through the stages: "gpipe" (every forward, then every backward) or
    # "1f1b" (forwards and backwards alternate, so fewer micro-batches' activations are held)
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    # tensor-parallel Linear layers (`scaleout.parallel.tensor`) over this many workers: each
    # named layer "colwise" (output features split) or "rowwise" (input features split)
    tensor: PositiveInt = 1
    # {path of an nn.Linear in the model: "colwise" or "rowwise"}, e.g. {"mlp.0" = "colwise",
    # "mlp.2" = "rowwise"}; needed (not empty) when tensor > 1
    tensor_plan: dict[str, Literal["colwise", "rowwise"]] = {}
    # how a grid's workers exchange the pixels their neurons read: "all_to_all" (one
    # all_to_all_single) or "p2p" (a send / receive per piece, batch_isend_irecv)
    transport: Literal["all_to_all", "p2p"] = "all_to_all"
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL on CUDA, else gloo
    timeout_s: TimeoutSeconds = 300.0  # a collective waiting longer than this fails

    @property
    def num_workers(self) -> int:
        return self.grid[0] * self.grid[1] * self.stages * self.tensor

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.stages


def check_partitionable(job: Job, strategy: str, grid: list[int]) -> None:
    """A grid trains what `parallelize` can split and whose objective is a sum of the
    workers' parts (a layer-wise model such as the sparse autoencoder; a supervised loss
    would need the whole output on one worker), and the grid must fit the model's feature
    maps: one line naming the fix otherwise, before any worker starts. The split is tried
    on the driver with the model on PyTorch's meta device (shapes only)."""
    probe = job.probe
    if probe is None:
        return
    if not (probe.partitionable and probe.layerwise):
        raise ConfigError(
            f'train.strategy = "{strategy}" with model parallelism trains a layer-wise model '
            f"that `scaleout.parallel.parallelize` partitions ({PARTITIONABLE}); the model "
            f'({job.model.name}) is not one: set model.kind = "sparse_autoencoder" or use '
            "another strategy"
        )
    with torch.device("meta"):
        model = job.model.build()
    try:
        parallelize(model, grid, rank=0)
    except ValueError as err:
        raise ConfigError(f"model_parallel.grid = {list(grid)}: {err}") from None


def check_grid_steps(job: Job) -> None:
    """A step on a grid of more than one worker: its gradient lies in parts over the grid,
    whose global norm is not clipped, and its exchanges move fp32 activations; one line
    for `train.grad_clip_norm` or a `run.precision` other than fp32."""
    if job.train.grad_clip_norm is not None:
        raise ConfigError(
            "train.grad_clip_norm with a model-parallel grid: each worker holds a part of the "
            "gradient, and its global norm is not clipped across the grid; leave "
            "train.grad_clip_norm out or use model_parallel.grid = [1, 1]"
        )
    if job.run.precision != "fp32":
        raise ConfigError(
            f'run.precision = "{job.run.precision}" with a model-parallel grid: the grid '
            'exchanges fp32 activations; use run.precision = "fp32" or '
            "model_parallel.grid = [1, 1]"
        )


def check_pipeline(
    job: Job, opts: ModelParallelSection, pipelines: int = 1, tied: bool = True
) -> None:
    """What pipeline stages train, one line each otherwise: a supervised model that cuts
    into `stages` parts (tried on the driver, on PyTorch's meta device), micro-batches
    that divide each of the `pipelines`' slice of the batch; not yet with a grid,
    accumulation or fp16. A codec compresses the activations and their gradients. Without
    `tied`, no parameter may sit on two stages (Downpour's stages push to shards of their
    own)."""
    train = job.train
    refusals = [
        (opts.grid != [1, 1], f"model_parallel.grid = {opts.grid}: set it to [1, 1]"),
        (train.accumulate_steps > 1, "train.accumulate_steps: use model_parallel.microbatches"),
        (job.run.precision == "fp16", 'run.precision = "fp16": use "bf16"'),
    ]
    for refused, fix in refusals:
        if refused:
            raise ConfigError(f"model_parallel.stages = {opts.stages} with {fix}")

    def cut(model: nn.Module) -> None:
        plan = split(model, opts.stages)
        shared = tied_parameters(model, plan)
        if shared and not tied:
            names = [n for n, p in model.named_parameters() if p.requires_grad]
            name = names[shared[0].index]
            raise ValueError(
                f"model_parallel.stages = {opts.stages} cuts between the stages that use "
                f"{name} (tied weights), and Downpour's stages push to shards of their own: "
                'untie it, use fewer stages, or train.strategy = "sync"'
            )

    _try_on_meta(
        job,
        f"model_parallel.stages = {opts.stages}",
        "pipeline stages train a supervised model (use model_parallel.grid)",
        cut,
    )
    if train.batch_size % (opts.num_microbatches * pipelines):
        each = f" over {pipelines} pipelines" if pipelines > 1 else ""
        raise ConfigError(
            f"model_parallel.microbatches = {opts.num_microbatches} does not divide "
            f"train.batch_size = {train.batch_size}{each}: make the batch a multiple of "
            f"{opts.num_microbatches * pipelines}"
        )


def check_tensor(job: Job, opts: ModelParallelSection) -> None:
    """What tensor-parallel layers train, one line each otherwise: a plan whose paths name
    the model's Linear layers (tried on the driver, on PyTorch's meta device); not with a
    grid, stages, fp16 or compressed exchanges."""
    refusals = [
        (opts.grid != [1, 1], f"model_parallel.grid = {opts.grid}: set it to [1, 1]"),
        (opts.stages > 1, f"model_parallel.stages = {opts.stages}: use one of the two"),
        (job.run.precision == "fp16", 'run.precision = "fp16": use "bf16"'),
        (job.compress.codec != "fp32", f'compress.codec = "{job.compress.codec}": use "fp32"'),
    ]
    for refused, fix in refusals:
        if refused:
            raise ConfigError(f"model_parallel.tensor = {opts.tensor} with {fix}")
    _try_on_meta(
        job,
        f"model_parallel.tensor = {opts.tensor}",
        "tensor-parallel layers train a supervised model",
        lambda model: check_plan(model, dict(opts.tensor_plan)),
    )


def _try_on_meta(
    job: Job, setting: str, supervised: str, apply: Callable[[nn.Module], Any]
) -> None:
    """`apply` the setting to the model built on PyTorch's meta device (shapes only): its
    ValueError is one line; a layer-wise model is refused with `supervised`, the reason."""
    probe = job.probe
    if probe is None:
        return
    if probe.layerwise:
        raise ConfigError(f"{setting}: model ({job.model.name}) trains layer-wise; {supervised}")
    with torch.device("meta"):
        model = job.model.build()
    try:
        apply(model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
