"""Strategy "sandblaster": Sandblaster L-BFGS (DistBelief section 4.2) on a sharded
parameter server whose shards execute the optimizer's vector commands."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from scaleout.config import Section, TimeoutSeconds
from scaleout.train.job import Job

if TYPE_CHECKING:
    from scaleout.strategies.sandblaster.strategy import Sandblaster


class SandblasterSection(Section):
    """Sandblaster L-BFGS (DistBelief section 4.2): a coordinator that holds no parameters."""

    # replicas: each sums loss and gradient over the portions the coordinator hands it
    num_replicas: PositiveInt = 2
    # parameter-server shards: each holds a slice of the parameters and of L-BFGS's vectors
    # and runs the coordinator's vector commands on it; at most the model's parameter count
    num_shards: PositiveInt = 2
    # L-BFGS memory m: (s, y) pairs kept on the shards (2m vectors a shard; the usual m is
    # 3-20, and the coordinator keeps m scalars)
    history: Annotated[int, Field(ge=1, le=1000)] = 10
    portion_size: PositiveInt = 1000  # examples per portion handed to a replica
    batch_size: PositiveInt | None = None  # examples per L-BFGS batch; None: the training set
    push_every: PositiveInt = 4  # accepted portions a replica sums before pushing to shards
    backup_tasks: bool = True  # near a batch's end, idle replicas redo outstanding portions
    # L-BFGS iterations, the run's steps (train.steps and epochs do not apply); a tolerance
    # may stop it sooner
    max_iterations: PositiveInt = 100
    tolerance_grad: NonNegativeFloat = 1e-5  # stop when max |g_i| falls below
    tolerance_change: NonNegativeFloat = 1e-9  # stop when the objective changes less (relative)
    max_line_search: PositiveInt = 20  # objective evaluations per line search
    l2: NonNegativeFloat = 0.0  # objective + l2 * ||weights||^2 (biases are not penalised)
    dtype: Literal["float32", "float64"] = "float32"  # replicas' arithmetic; shards use float64
    max_restarts: NonNegativeInt = 3  # per replica
    timeout_s: TimeoutSeconds = 300.0  # a portion not done in this long: its replica is stuck
    straggler_replica: NonNegativeInt | None = None  # benchmarks: slow this replica down ...
    straggler_factor: Annotated[float, Field(ge=1)] = 4.0  # ... by this factor


def create(job: Job) -> Sandblaster:
    from scaleout.strategies.sandblaster.strategy import Sandblaster  # imports Ray when used

    return Sandblaster(job)


__all__ = ["SandblasterSection", "create"]
