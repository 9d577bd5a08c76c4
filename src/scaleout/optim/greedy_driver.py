"""The driver of greedy autoencoder training: hands out chunks of steps, logs, evaluates and
checkpoints; the same for one process (strategy "single") and a grid of workers (strategy
"model_parallel", `scaleout.parallel.model_parallel.trainer`).

The driver talks to the trainer only through `call(method, *args)`, which runs
`GreedyTrainer.method(*args)` in-process, or on every worker of the grid at once and answers
with rank 0's result (the workers' results agree: they are sums over the grid). A chunk ends
at the next multiple of `train.log_every`, `eval_every`, `checkpoint_every` or the end of a
stack, so chunks never cross a stack and the driver acts between them; an interrupt (Ctrl-C)
is seen at the end of the chunk it falls in.

The metrics carry the objective's two terms, `reconstruction` and `sparsity` (per example),
beside `loss` (their sum) and `stack`; `filters.png` in the run directory shows the first
stack's filters, and `objective.png` both terms per stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaleout.checkpoint import load_checkpoint
from scaleout.config import RunConfig
from scaleout.errors import CheckpointError
from scaleout.interrupt import StopOnInterrupt
from scaleout.metrics import MetricsLog, read_metrics, truncate_metrics
from scaleout.nn.autoencoder import write_filter_image
from scaleout.optim.greedy import GreedyPlan, GreedyTrainer
from scaleout.optim.single import TrainResult
from scaleout.progress import TrainingProgress, console
from scaleout.rundir import RunDir

__all__ = ["Call", "drive_greedy", "plot_objective", "train_greedy"]

FILTERS_FILE = "filters.png"
OBJECTIVE_PLOT_FILE = "objective.png"

Call = Callable[..., Any]  # call(method name, *args) -> the trainer's (rank 0's) result


def train_greedy(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    """Train the stacks of a sparse autoencoder one after the other, in this process."""
    trainer = GreedyTrainer(config)

    def call(method: str, *args: Any) -> Any:  # noqa: ANN401 - whatever the method returns
        return getattr(trainer, method)(*args)

    return drive_greedy(config, run, resume, call, "single")


def show_greedy_progress(progress: TrainingProgress, record: dict[str, Any]) -> None:
    fields = {
        "stack": f"stack {record['stack']}",
        "loss": f"loss {record['loss']:.4f}",
        "terms": f"(rec {record['reconstruction']:.4f} + sp {record['sparsity']:.4f})",
        "rate": f"{record['examples_per_s']:.1f} ex/s",
    }
    progress.update(record["step"], **fields)
    if "test_loss" in record:
        progress.log(
            f"step {record['step']}  {record['time_s']:.1f}s  "
            + "  ".join(fields.values())
            + f"  test loss {record['test_loss']:.4f}"
        )


def _restore(run: RunDir, plan: GreedyPlan, call: Call) -> dict[str, Any]:
    path = run.checkpoints.latest()
    assert path is not None  # RunDir.prepare checked
    tensors, meta = load_checkpoint(path)
    if "stack" not in meta:
        raise CheckpointError(
            f"{path} is a {meta.get('strategy')} checkpoint of a supervised model, not of a "
            "sparse autoencoder: resume with the config that wrote it"
        )
    if (meta.get("batches_per_epoch"), meta.get("steps_per_stack")) != (
        plan.batches_per_epoch,
        plan.steps_per_stack,
    ):
        raise CheckpointError(
            f"checkpoint {path} was made with {meta.get('batches_per_epoch')} batches per "
            f"epoch and {meta.get('steps_per_stack')} steps per stack, this config gives "
            f"{plan.batches_per_epoch} and {plan.steps_per_stack}: resume with the same "
            "train.steps, train.batch_size and data"
        )
    call("restore", tensors, meta, str(path))
    truncate_metrics(run.metrics, meta["step"])
    console.print(f"resumed {run.path} at step {meta['step']} (stack {meta['stack'] + 1})")
    return meta


def drive_greedy(
    config: RunConfig, run: RunDir, resume: bool, call: Call, strategy: str
) -> TrainResult:
    """Run greedy training through `call`; `strategy` is recorded in checkpoints."""
    cfg = config.train
    plan: GreedyPlan = call("get_plan")
    step, examples, elapsed = 0, 0, 0.0
    if resume:
        meta = _restore(run, plan, call)
        step, examples, elapsed = meta["step"], meta["examples"], meta["time_s"]
    start = time.perf_counter() - elapsed

    def save(record: dict[str, Any]) -> None:
        tensors, meta = call("state")
        meta.update(
            step=step,
            examples=examples,
            time_s=time.perf_counter() - start,
            batches_per_epoch=plan.batches_per_epoch,
            steps_per_stack=plan.steps_per_stack,
            strategy=strategy,
            config=config.model_dump(mode="json"),
            metrics=record,
        )
        run.checkpoints.save(step, tensors, meta)
        if meta["stack"] == 0:
            weight = tensors["model.stacks.0.filter.weight"]
            write_filter_image(weight, plan.first_geometry, run.path / FILTERS_FILE)

    record: dict[str, Any] = {}
    window = {"reconstruction": 0.0, "sparsity": 0.0, "examples": 0, "seconds": 0.0}
    with (
        MetricsLog(run.metrics) as log,
        StopOnInterrupt() as interrupt,
        TrainingProgress(plan.total_steps, completed=step, description=strategy) as progress,
    ):
        while step < plan.total_steps and not interrupt.requested:
            boundaries = [cfg.log_every, cfg.eval_every, cfg.checkpoint_every]
            target = min((step // b + 1) * b for b in [*boundaries, plan.steps_per_stack])
            chunk_start = time.perf_counter()
            out = call("train_chunk", target - step)
            step, examples = target, examples + out["examples"]
            window["seconds"] += time.perf_counter() - chunk_start
            for key in ("reconstruction", "sparsity", "examples"):
                window[key] += out[key]
            progress.update(step)
            stack = (step - 1) // plan.steps_per_stack
            end_of_stack = step % plan.steps_per_stack == 0
            evaluating = step % cfg.eval_every == 0 or end_of_stack
            if step % cfg.log_every == 0 or evaluating or interrupt.requested:
                reconstruction = window["reconstruction"] / window["examples"]
                sparsity = window["sparsity"] / window["examples"]
                record = {
                    "time_s": round(time.perf_counter() - start, 4),
                    "step": step,
                    "epoch": out["epoch"],
                    "examples": examples,
                    "stack": stack + 1,
                    "loss": reconstruction + sparsity,
                    "reconstruction": reconstruction,
                    "sparsity": sparsity,
                    "alpha": out["alpha"],
                    "lr": out["lr"],
                    "examples_per_s": window["examples"] / max(window["seconds"], 1e-9),
                }
                if evaluating:
                    record.update(call("evaluate"))
                log.log(record)
                show_greedy_progress(progress, record)
                window = dict.fromkeys(window, 0.0)
            if step % cfg.checkpoint_every == 0 or end_of_stack or interrupt.requested:
                save(record)
    if interrupt.requested:
        console.print(
            f"interrupted at step {step}: checkpoint saved in {run.checkpoints.directory}; "
            "continue with --resume"
        )
    plot_objective(read_metrics(run.metrics), run.path / OBJECTIVE_PLOT_FILE)
    return TrainResult(step=step, interrupted=interrupt.requested, summary=run.finish())


def plot_objective(records: list[dict[str, Any]], out: Path) -> Path | None:
    """Reconstruction and sparsity (train, and test where evaluated) per stack, against
    steps: one panel per stack."""
    rows = [r for r in records if "reconstruction" in r and "stack" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacks = sorted({r["stack"] for r in rows})
    fig, axes = plt.subplots(1, len(stacks), figsize=(4.5 * len(stacks), 3.6), squeeze=False)
    for ax, stack in zip(axes[0], stacks, strict=True):
        mine = [r for r in rows if r["stack"] == stack]
        steps = [r["step"] for r in mine]
        ax.plot(steps, [r["reconstruction"] for r in mine], label="reconstruction")
        ax.plot(steps, [r["sparsity"] for r in mine], label="sparsity")
        tested = [r for r in mine if "test_reconstruction" in r]
        if tested:
            ax.plot(
                [r["step"] for r in tested],
                [r["test_reconstruction"] + r["test_sparsity"] for r in tested],
                "o-",
                label="test objective",
            )
        ax.set_title(f"stack {stack}")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("per example")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
