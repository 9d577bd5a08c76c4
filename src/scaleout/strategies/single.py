"""Strategy "single": one worker in this process, the reference every distributed strategy
is measured by.

No Ray and no process group: the same `Worker` the other strategies run as actors trains
here in the driver's process (`LocalWorkers`), so one code path degrades to one worker.
"""

from __future__ import annotations

from scaleout.strategies.group import LocalWorkers
from scaleout.strategies.lockstep import Lockstep, Workers
from scaleout.strategies.role import Role
from scaleout.train.job import Job


class Single(Lockstep):
    """One worker in this process. Deterministic given the config: the order of examples
    depends only on (seed, epoch), and checkpoints hold the model, optimizer, RNG and
    position, so a run killed and resumed ends with exactly the parameters of an
    uninterrupted one."""

    name = "single"

    def make_workers(self, role: Role) -> Workers:
        return LocalWorkers(self.job, role)


def create(job: Job) -> Single:
    return Single(job)
