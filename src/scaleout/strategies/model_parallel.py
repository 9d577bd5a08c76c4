"""Strategy "model_parallel": one replica partitioned over a `model_parallel.grid = [px, py]`
of workers (COTS HPC section 4.2, DistBelief section 3).

The workers are Ray actors in one placement group, joined in a torch.distributed process
group (gloo on CPU, NCCL on GPU). Each builds the whole model from the seed and keeps its
part (`scaleout.parallel.parallelize`), so the grid starts from exactly the single-process
weights. Every worker runs the same steps on the same minibatch; inside a step the workers
exchange activations and gradients with the workers their receptive fields reach, and
all-reduce only the replicated parameters' gradients (alpha) and the objective's sums.
Checkpoints hold the whole replica in strategy "single"'s format (the grid assembles its
parts), so a run resumes under another grid or in one process. A grid of 1 x 1 is one
worker, the same code. A worker that dies stops the run with `WorkerDied`; `--resume`
continues from the last checkpoint.

The same grid is what strategy "downpour" runs as each replica when `model_parallel.grid`
has more than one worker.
"""

from __future__ import annotations

from typing import Any

from scaleout.strategies.group import ActorWorkers
from scaleout.strategies.layout import (
    ModelParallelSection,
    check_grid_steps,
    check_partitionable,
    check_pipeline,
    check_tensor,
)
from scaleout.strategies.lockstep import Lockstep, Workers
from scaleout.strategies.role import Role
from scaleout.train.job import Job


class ModelParallel(Lockstep):
    name = "model_parallel"

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.opts = job.section("model_parallel", ModelParallelSection)
        if self.opts.stages > 1:
            check_pipeline(job, self.opts)
            return
        if self.opts.tensor > 1:
            check_tensor(job, self.opts)
            return
        check_partitionable(job, self.name, self.opts.grid)
        if self.opts.num_workers > 1:
            check_grid_steps(job)

    def role_options(self) -> dict[str, Any]:
        opts = self.opts
        if opts.tensor > 1:
            return dict(tensor_plan=tuple(opts.tensor_plan.items()))
        if opts.stages > 1:
            return dict(
                stages=opts.stages,
                microbatches=opts.num_microbatches,
                pipeline_schedule=opts.schedule,
            )
        return dict(grid=(opts.grid[0], opts.grid[1]), transport=opts.transport)

    def make_workers(self, role: Role) -> Workers:
        return ActorWorkers(
            self.job,
            role,
            self.opts.num_workers,
            "model-parallel worker",
            self.where,
            self.opts.backend,
            self.opts.timeout_s,
        )

    def summary(self) -> dict[str, Any]:
        """The layout; with stages or split layers, the bytes the fullest worker holds."""
        opts = self.opts
        if opts.tensor == 1 and opts.stages == 1:
            return {"grid": list(opts.grid)}
        held = self.held_bytes()
        if opts.tensor > 1:
            return {"tensor": opts.tensor, **held}
        return {"stages": opts.stages, "microbatches": opts.num_microbatches, **held}


def create(job: Job) -> ModelParallel:
    return ModelParallel(job)
