"""The base of the strategies that train one replica in lock step: "single" (one worker in
this process), "model_parallel" (the replica partitioned over a grid of actors) and "sync"
(every worker a whole replica on a slice of each global batch).

They differ only in the workers' `Role`, where the workers run, and how their answers
combine; the plan, the training loop (`Worker`), evaluation and checkpoints are the same.
Checkpoints hold the whole replica in strategy "single"'s format (a grid assembles its
parts), so a run resumes under any of the three where they train the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scaleout.data import num_batches
from scaleout.rundir import RunDir
from scaleout.strategies.group import ActorWorkers, LocalWorkers
from scaleout.strategies.role import Role
from scaleout.strategies.worker import Worker, WorkerChunk
from scaleout.train.job import Job
from scaleout.train.protocol import Chunk, Plan, Resume, Tensors
from scaleout.train.step import schedule_for

Workers = LocalWorkers | ActorWorkers


def lockstep_plan(job: Job) -> Plan:
    """Steps = `train.steps` or epochs of the training set (per phase when layer-wise);
    a last partial batch is dropped when the set holds at least one whole batch."""
    probe = job.probe
    assert probe is not None, "probe_job(job) first"
    batch = job.train.batch_size
    per_epoch = num_batches(probe.train_size, batch, drop_last=probe.train_size >= batch)
    per_phase = job.train.total_steps(per_epoch)
    if not probe.layerwise:
        return Plan(per_phase, per_epoch)
    return Plan(per_phase * probe.num_phases, per_epoch, probe.num_phases, per_phase)


class Lockstep:
    """Base of the lock-step strategies; subclasses give `make_workers()` and their workers'
    `role_options()`."""

    name = "lockstep"
    restartable = True  # the driver starts the workers again when one of them died

    def __init__(self, job: Job) -> None:
        self.job = job
        self.workers: Workers | None = None
        self._plan: Plan | None = None
        self.step = 0

    def plan(self) -> Plan:
        self._plan = lockstep_plan(self.job)
        return self._plan

    def make_workers(self, role: Role) -> Workers:
        raise NotImplementedError

    def where(self) -> str:
        """Where the run stopped, for a worker's death: the step and the last checkpoint."""
        return RunDir(self.job.run_dir).stopped_at(self.step)

    def start(self, resume: Resume | None) -> dict[str, Any]:
        assert self._plan is not None
        plan = self._plan
        schedule = schedule_for(self.job.train, plan.phase_steps or plan.total_steps)
        role = Role(phase_steps=plan.phase_steps, schedule=schedule, **self.role_options())
        self.workers = self.make_workers(role)
        self.step = 0 if resume is None else resume.step
        if resume is not None:
            self.workers.call(Worker.restore, resume.tensors, resume.meta, str(resume.path))
        return {}

    def role_options(self) -> dict[str, Any]:
        return {}

    def train(self, num_steps: int, stop: Callable[[], bool]) -> Chunk:
        assert self.workers is not None
        if isinstance(self.workers, LocalWorkers):
            outs = [self.workers.worker.train(num_steps, stop)]
        else:
            outs = self.workers.call(Worker.train, num_steps)
        chunk = self.combine(outs)
        self.step += chunk.steps
        return chunk

    def combine(self, outs: list[WorkerChunk]) -> Chunk:
        """The replica's chunk from its workers' answers (rank 0's: sums are the grid's)."""
        return outs[0]

    def metrics(self) -> dict[str, Any]:
        return {}

    def evaluate(self) -> dict[str, float]:
        assert self.workers is not None
        # the first worker that measured: rank 0, or a pipeline's last stage
        return next(m for m in self.workers.call(Worker.evaluate) if m is not None)

    def held_bytes(self) -> dict[str, int]:
        """The parameter and optimizer-state bytes the fullest worker holds, per kind."""
        assert self.workers is not None
        answers = self.workers.call(Worker.held_bytes)
        return {key: max(a[key] for a in answers) for key in answers[0]}

    def state(self) -> tuple[Tensors, dict[str, Any]]:
        assert self.workers is not None
        return self.workers.call(Worker.state)[0]

    def finish(self) -> Chunk:
        return Chunk()

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None
