"""The one driver: everything a run does around a strategy's training.

It asks the strategy for chunks of steps that end where something is due: a metrics line
every `train.log_every` steps, an evaluation every `eval_every` and at the end of each
phase, a checkpoint every `checkpoint_every` and at the end. It writes `metrics.jsonl` (and
TensorBoard events with `run.tensorboard`), shows the progress bar, stops at
`train.target_accuracy`, turns Ctrl-C into a stop at the end of the current chunk with a
checkpoint (a second Ctrl-C interrupts at once), refuses to resume from a checkpoint of
another run, and prints the summary. When a worker of a lock-step strategy dies (its group
cannot go on without it), it restarts the strategy from the last checkpoint, up to
`train.max_restarts` times, as torchrun's elastic agent does (a strategy that can be
started again after `close` says so: `restartable`). A strategy only trains
(`scaleout.train.protocol`).
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaleout.checkpoint import load_checkpoint
from scaleout.comm import WorkerDied
from scaleout.errors import CheckpointError, DiskError, UserError
from scaleout.interrupt import StopOnInterrupt
from scaleout.metrics import MetricsLog, plot_terms, read_metrics, truncate_metrics
from scaleout.progress import TrainingProgress, console
from scaleout.rundir import RunDir
from scaleout.train.job import Job
from scaleout.train.protocol import Chunk, Plan, Resume, Strategy

TERMS_PLOT_FILE = "objective.png"


@dataclass
class TrainResult:
    """What `scaleout.fit` returns: where the run stopped, its summary and its directory."""

    step: int
    summary: dict[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None
    # SIGINT (Ctrl-C) or SIGTERM when a signal stopped the run early, with a checkpoint of
    # the step it reached
    stopped_by: signal.Signals | None = None

    @property
    def interrupted(self) -> bool:
        return self.stopped_by is not None

    @property
    def steps(self) -> int:
        return self.step

    @property
    def best_test_accuracy(self) -> float | None:
        return self.summary.get("best_test_accuracy")

    @property
    def final_test_accuracy(self) -> float | None:
        return self.summary.get("final_test_accuracy")

    @property
    def final_test_loss(self) -> float | None:
        return self.summary.get("final_test_loss")


def reached(target: float | None, record: dict[str, Any]) -> bool:
    """Whether an evaluation reached `train.target_accuracy` (the run then stops)."""
    accuracy = record.get("test_accuracy")
    if target is None or accuracy is None or accuracy < target:
        return False
    console.print(
        f"test accuracy {100 * accuracy:.2f}% reached the target at step {record['step']}"
    )
    return True


def show_progress(
    progress: TrainingProgress, record: dict[str, Any], bar_fields: dict[str, str]
) -> None:
    """Loss, test accuracy and rate beside the bar (and a strategy's `bar_fields`), and a
    log line per evaluation."""
    fields = {}
    if "stack" in record:
        fields["stack"] = f"stack {record['stack']}"
    if record.get("loss") is not None:
        fields["loss"] = f"loss {record['loss']:.4f}"
    if "test_accuracy" in record:
        fields["acc"] = f"acc {100 * record['test_accuracy']:.2f}%"
    rate = record.get("examples_per_s")
    if rate is not None:
        fields["rate"] = f"{rate / 1000:.1f}k ex/s" if rate >= 1000 else f"{rate:.1f} ex/s"
    progress.update(record["step"], **{**fields, **bar_fields})
    if "test_loss" in record:
        progress.log(
            f"step {record['step']}  {record['time_s']:.1f}s  "
            + "  ".join(fields.values())
            + f"  test loss {record['test_loss']:.4f}"
        )


class Driver:
    """Runs `strategy` for `job` in `run`; `resume` continues from its last checkpoint."""

    def __init__(self, strategy: Strategy, job: Job, run: RunDir, resume: bool = False) -> None:
        self.strategy, self.job, self.run, self.resume = strategy, job, run, resume
        self.step = self.examples = 0
        self.elapsed = 0.0
        self.start_time = time.perf_counter()
        self.plan: Plan | None = None
        self.restarts: list[dict[str, Any]] = []  # the restarts after a worker died

    # --- resume ----------------------------------------------------------------------------

    def _load_resume(self, plan: Plan) -> Resume:
        path = self.run.checkpoints.latest()
        assert path is not None  # RunDir.prepare checked
        tensors, meta = load_checkpoint(path)
        for key, value in plan.resume_meta().items():
            if key in meta and meta[key] != value:
                raise CheckpointError(
                    f"checkpoint {path} was made with {key} = {meta[key]}, this config gives "
                    f"{value}: resume with the same train.batch_size, train.steps and data"
                )
        return Resume(path, tensors, meta)

    # --- records ---------------------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.start_time

    def _record(self, window: Chunk) -> dict[str, Any]:
        record: dict[str, Any] = {
            "time_s": round(self.now(), 4),
            "step": self.step,
            "examples": self.examples,
        }
        if window.examples:
            record["loss"] = window.loss_sum / window.examples
            for name, value in window.term_sums.items():
                record[name] = value / window.examples
            if window.correct is not None:
                record["train_accuracy"] = window.correct / window.examples
            record["examples_per_s"] = window.examples / max(window.seconds or 0.0, 1e-9)
        record.update(window.fields)
        loss = record.get("loss")
        if loss is not None and not math.isfinite(loss):
            raise UserError(
                f"training diverged: loss is {loss} at step {self.step}; lower train.lr"
            )
        return record

    def _save(self, record: dict[str, Any]) -> None:
        """Write a checkpoint; a full disk (here or on a parameter-server shard, which
        checkpoints with it) stops the run with one line saying how to go on."""
        try:
            self._write_checkpoint(record)
        except DiskError as err:
            again = "--resume" if self.run.checkpoints.latest() else "start the run again"
            raise DiskError(
                f"{err}; the run stopped at step {self.step}: fix it, then {again}"
            ) from None

    def _write_checkpoint(self, record: dict[str, Any]) -> None:
        assert self.plan is not None
        tensors, meta = self.strategy.state()
        meta.update(
            step=self.step,
            examples=self.examples,
            time_s=self.now(),
            strategy=self.strategy.name,
            config=self.job.record,
            metrics=record,
            **self.plan.resume_meta(),
        )
        self.run.checkpoints.save(self.step, tensors, meta)
        write = getattr(self.job.model, "write_artifacts", None)
        if write is not None:
            write(tensors, meta, self.run.path)

    # --- the loop --------------------------------------------------------------------------

    def run_training(self) -> TrainResult:
        try:
            while True:
                try:
                    return self._run()
                except WorkerDied as died:
                    if not self.strategy.restartable or died.cause is None:
                        raise
                    if len(self.restarts) >= self.job.train.max_restarts:
                        raise
                    self._restart(died.cause)
        finally:
            self.strategy.close()

    def _restart(self, cause: str) -> None:
        """After a worker died: end the strategy's workers and start them again from the last
        checkpoint (from the start when there is none); the steps since it are done again."""
        self.strategy.close()
        saved = self.run.checkpoints.steps()
        self.resume = bool(saved)
        restart = {
            "time_s": round(self.now(), 3),
            "step": self.step,
            "from_step": saved[-1] if saved else 0,
            "message": cause[:300],
        }
        self.restarts.append(restart)
        console.print(
            f"{cause}; restarting from step {restart['from_step']} (restart "
            f"{len(self.restarts)} of train.max_restarts = {self.job.train.max_restarts})"
        )

    def _run(self) -> TrainResult:
        cfg = self.job.train
        plan = self.plan = self.strategy.plan()
        resume = self._load_resume(plan) if self.resume else None
        if resume is not None:
            meta = resume.meta
            self.step, self.examples, self.elapsed = meta["step"], meta["examples"], meta["time_s"]
        elif self.restarts:  # a worker died before the first checkpoint: from the start
            self.step = self.examples = 0
            self.elapsed = 0.0
            truncate_metrics(self.run.metrics, 0)
        counters = self.strategy.start(resume)
        # Started: only now, before the first metrics line or checkpoint, is the previous run
        # that --overwrite set aside deleted (a failure up to here puts it back).
        self.run.commit()
        self.step = counters.get("step", self.step)
        self.examples = counters.get("examples", self.examples)
        self.elapsed = counters.get("time_s", self.elapsed)
        if resume is not None:
            truncate_metrics(self.run.metrics, self.step)
            console.print(f"resumed {self.run.path} at step {self.step} from {resume.path.name}")
        self.start_time = time.perf_counter() - self.elapsed
        total = plan.total_steps
        boundaries = plan.boundaries()
        tensorboard = self.run.tensorboard if self.job.run.tensorboard else None
        record: dict[str, Any] = {}
        saved_at, evaluated_at, terms = -1, -1, set()
        window = Chunk()  # the chunks since the last metrics line
        stopped: str | None = None
        with (
            MetricsLog(self.run.metrics, tensorboard) as log,
            StopOnInterrupt(self.job.run.stop_grace_s) as interrupt,
            TrainingProgress(total, self.step, self.strategy.name) as bar,
        ):

            def emit(evaluate: bool) -> None:
                nonlocal record, window, evaluated_at, total
                record = self._record(window)
                record.update(self.strategy.metrics())
                terms.update(window.term_sums)
                window = Chunk()
                if evaluate:
                    record.update(self.strategy.evaluate())
                    evaluated_at = self.step
                    if reached(cfg.target_accuracy, record):
                        total = self.step
                bar_fields = record.pop("_bar", {})  # for the progress bar only
                try:
                    log.log(record)
                except DiskError as err:
                    stopped_at = self.run.stopped_at(self.step)
                    raise DiskError(f"{err}; the run stopped {stopped_at}") from None
                show_progress(bar, record, bar_fields)

            while self.step < total and not interrupt.requested and stopped is None:
                cadence = [cfg.log_every, cfg.eval_every, cfg.checkpoint_every]
                target = min([(self.step // b + 1) * b for b in cadence] + [total])
                target = min([target] + [b for b in boundaries if b > self.step])
                started = time.perf_counter()
                chunk = self.strategy.train(target - self.step, lambda: interrupt.requested)
                if chunk.seconds is None:  # the strategy trained for the whole call
                    chunk.seconds = time.perf_counter() - started
                window.add(chunk)
                before, self.step = self.step, self.step + chunk.steps
                self.examples += chunk.examples
                stopped = chunk.stopped
                bar.update(self.step)

                def crossed(every: int, before: int = before) -> bool:
                    return self.step // every > before // every

                phase_end = any(before < b <= self.step for b in boundaries)
                last = self.step >= total or stopped is not None
                evaluating = crossed(cfg.eval_every) or phase_end or last
                stopping = interrupt.requested and record.get("step") != self.step
                if crossed(cfg.log_every) or evaluating or stopping:
                    emit(evaluating)
                due = crossed(cfg.checkpoint_every) or phase_end
                if due and not (self.step >= total or interrupt.requested or stopped):
                    self._save(record)  # the last checkpoint is written after `finish`
                    saved_at = self.step
            tail = self.strategy.finish()
            if tail.steps:
                window.add(tail)
                self.step += tail.steps
                self.examples += tail.examples
                bar.update(self.step)
            if window.steps and record.get("step") != self.step:
                emit(evaluate=not interrupt.requested and evaluated_at != self.step)
            if record and saved_at != self.step:
                self._save(record)
        stopped_by = interrupt.signal if interrupt.requested else None
        if stopped_by is not None:
            how = "interrupted" if stopped_by == signal.SIGINT else f"stopped by {stopped_by.name}"
            console.print(
                f"{how} at step {self.step}: checkpoint saved in "
                f"{self.run.checkpoints.directory}; continue with --resume"
            )
        elif stopped is not None:
            console.print(f"{self.strategy.name} stopped: {stopped}")
        if terms and plan.num_phases > 1 and plan.phase_steps:
            plot_terms(
                read_metrics(self.run.metrics),
                sorted(terms),
                plan.phase_steps,
                self.run.path / TERMS_PLOT_FILE,
            )
        summary = self.run.finish()
        summary.update(self.strategy.summary())
        if self.restarts:
            summary["restarts"] = len(self.restarts)
            summary["steps_redone"] = sum(r["step"] - r["from_step"] for r in self.restarts)
        if stopped is not None:
            summary["stopped"] = stopped
        if stopped_by is not None:
            summary["stopped_by"] = stopped_by.name
        return TrainResult(self.step, summary, self.run.path, stopped_by)
