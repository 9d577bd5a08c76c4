"""A worker's `Role`: where it sits in its strategy's layout, the one value a strategy hands
each of its workers (`scaleout.strategies.worker.Worker` takes its part of the data and
model as it says). Frozen, so that a role can travel to Ray actors and be named per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaleout.nn.schedule import Schedule


@dataclass(frozen=True)
class Role:
    """Where a worker sits in its strategy's layout (the layouts: `scaleout.strategies.worker`)."""

    name: str = "worker"  # in messages: "worker 1", "replica 0"
    rank: int = 0  # in its process group (a grid, or the sync workers)
    world: int = 1
    replica: int = 0  # Downpour: trains on every num_replicas-th example from `replica`
    num_replicas: int = 1
    grid: tuple[int, int] | None = None  # model parallel: this worker's part of the model
    transport: str = "all_to_all"
    sliced: bool = False  # sync: slice `rank` of every global batch
    ddp: bool = False  # sync "allreduce": DDP averages gradients during backward
    average_every: int | None = None  # sync "average": average weights + optimizer state
    fsdp: bool = False  # sync "fsdp": parameters, gradients and optimizer state sharded
    fsdp_blocks: tuple[str, ...] | None = None  # the module classes sharded one by one
    stages: int = 1  # pipeline stages: this worker's is `stage` of pipeline `slice`
    microbatches: int = 1  # per step, through the stages
    pipeline_schedule: str = "1f1b"  # "gpipe" | "1f1b"
    tensor_plan: tuple[tuple[str, str], ...] = ()  # model parallel: Linear path -> style
    phase_steps: int | None = None  # lock-step layer-wise training: steps per phase
    schedule: Schedule | None = None  # the learning rate of each step (None: no optimizer)

    @property
    def stage(self) -> int:
        """This worker's pipeline stage: rank r is stage r % stages of pipeline r // stages."""
        return self.rank % self.stages

    @property
    def slice(self) -> int:
        """Sync: the slice of every global batch this worker trains on (its pipeline's)."""
        return self.rank // self.stages

    @property
    def slices(self) -> int:
        return self.world // self.stages

    def named(self, rank: int, world: int) -> Role:
        """This role for rank `rank` of `world`."""
        return dataclasses.replace(self, rank=rank, world=world)
