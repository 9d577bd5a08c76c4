"""What a Downpour run can be, checked before anything starts: one line each otherwise."""

from __future__ import annotations

from scaleout.errors import ConfigError
from scaleout.nn.optim import check_elementwise
from scaleout.strategies.downpour import DownpourSection
from scaleout.strategies.layout import check_grid_steps
from scaleout.train.job import Job


def check_replica_steps(job: Job, grid: bool) -> None:
    """What a Downpour step can be, one line each otherwise: the shards step the optimizer
    on flat slices (element-wise only); a replica pushes gradients and steps no optimizer
    of its own, so fp16's loss scaling (a GradScaler steps an optimizer) has no place; a
    grid replica's gradient is in parts, whose global norm is not clipped here (a
    pipeline's stages clip theirs together: `grid` is False for them)."""
    check_elementwise(job.optimizer_options())
    if job.run.precision == "fp16":
        raise ConfigError(
            'run.precision = "fp16" with train.strategy = "downpour": a replica pushes its '
            "gradient and has no optimizer for fp16's loss scaling to step; use "
            'run.precision = "bf16", which needs none'
        )
    if grid:
        check_grid_steps(job)


def check_asynchrony(opts: DownpourSection, grid: bool) -> None:
    """What DiLoCo and bounded staleness need, one line each otherwise: both fetch after
    their own push is applied (no fetch and push threads), DiLoCo once per push, bounded
    staleness at least once; neither runs on a model-parallel grid or pipeline, whose
    workers fetch and push in step."""
    wanted = []
    if opts.mode == "diloco":
        wanted.append('downpour.mode = "diloco"')
        if opts.n_fetch != opts.n_push:
            raise ConfigError(
                'downpour.mode = "diloco" pushes after n_push inner steps and fetches the '
                f"result: set downpour.n_fetch = downpour.n_push (now {opts.n_fetch} and "
                f"{opts.n_push})"
            )
    if opts.max_staleness is not None:
        wanted.append(f"downpour.max_staleness = {opts.max_staleness}")
        if opts.n_fetch > opts.n_push:
            raise ConfigError(
                f"downpour.max_staleness bounds each push from its window's fetch: set "
                f"downpour.n_fetch <= downpour.n_push (now {opts.n_fetch} and {opts.n_push})"
            )
    if not wanted:
        return
    if opts.threads is True:
        raise ConfigError(
            f"{' and '.join(wanted)} fetch after their own push is applied: set "
            "downpour.threads = false"
        )
    if grid:
        raise ConfigError(
            f"{' and '.join(wanted)} need replicas of one worker: a model-parallel "
            "replica's workers fetch and push in step; set model_parallel.grid = [1, 1] "
            "and model_parallel.stages = 1"
        )


def check_elastic(opts: DownpourSection, grid: bool) -> None:
    """What an elastic run needs, one line each otherwise: min_replicas <= num_replicas <=
    max_replicas, and replicas of one worker (a grid's or pipeline's workers start and
    leave together with their collectives, which a running run cannot re-form)."""
    if not opts.elastic:
        return
    if opts.min_replicas > opts.num_replicas:
        raise ConfigError(
            f"downpour.min_replicas = {opts.min_replicas} exceeds downpour.num_replicas = "
            f"{opts.num_replicas}, the count an elastic run starts with: lower it"
        )
    if opts.max_replicas is not None and opts.max_replicas < opts.num_replicas:
        raise ConfigError(
            f"downpour.max_replicas = {opts.max_replicas} is below downpour.num_replicas = "
            f"{opts.num_replicas}, the count an elastic run starts with: raise it"
        )
    if grid:
        raise ConfigError(
            "downpour.elastic = true needs replicas of one worker: a model-parallel "
            "replica's workers form a process group that cannot grow or shrink; set "
            "model_parallel.grid = [1, 1] and model_parallel.stages = 1"
        )
