"""Greedy layer-wise training of the sparse autoencoder (strategy "single" with
`model.kind = "sparse_autoencoder"`; COTS HPC section 3, Le et al. 2012).

Stack 1 is trained on the data for `train.steps` (or `train.epochs`) minibatches of SGD with
the configured optimizer (the paper: SGD with momentum); then it is frozen and stack 2 is
trained on stack 1's output, and so on. Only the stack being trained has gradients and
optimizer state, so memory holds every stack's weights plus one stack's gradient and
momentum. The metrics carry the objective's two terms, `reconstruction` and `sparsity`
(per example), beside `loss` (their sum) and `stack`; `filters.png` in the run directory shows
the first stack's filters, and `objective.png` both terms per stack. Each stack's alpha
starts at the least-squares scale of its reconstruction on the stack's first minibatch.

Steps are counted over the whole run (stack k covers steps (k-1)*S+1 .. k*S), a checkpoint
records the stack whose optimizer state it holds, and each stack's data order depends only
on (seed, stack, epoch), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from scaleout.build import build_datasets, build_model_for, build_optimizer, resolve_device
from scaleout.checkpoint import load_checkpoint
from scaleout.config import RunConfig, SparseAutoencoderModel
from scaleout.data import derive_seed, make_loader, num_batches
from scaleout.errors import CheckpointError, ConfigError, UserError
from scaleout.interrupt import StopOnInterrupt
from scaleout.metrics import MetricsLog, read_metrics, truncate_metrics
from scaleout.nn.autoencoder import SparseAutoencoderNetwork, write_filter_image
from scaleout.optim.single import TrainResult, load_model_state, model_state
from scaleout.progress import TrainingProgress, console
from scaleout.rundir import RunDir

FILTERS_FILE = "filters.png"
OBJECTIVE_PLOT_FILE = "objective.png"


@torch.no_grad()
def evaluate_objective(
    network: SparseAutoencoderNetwork,
    stack: int,
    dataset: Dataset,
    batch_size: int,
    device: torch.device,
) -> dict[str, float]:
    """Per-example reconstruction and sparsity of stack `stack` (0-based) on `dataset`."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for (x,) in make_loader(dataset, batch_size, shuffle=False):
        terms = network.stack_objective(x.to(device), stack)
        sums += torch.stack([terms.reconstruction, terms.sparsity]).double() * len(x)
    reconstruction, sparsity = (sums / len(dataset)).tolist()  # type: ignore[arg-type]
    return {
        "test_loss": reconstruction + sparsity,
        "test_reconstruction": reconstruction,
        "test_sparsity": sparsity,
    }


def _check_data_shape(config: RunConfig, train_set: Dataset) -> None:
    model = config.model
    assert isinstance(model, SparseAutoencoderModel)
    expected = (model.in_channels, model.in_size, model.in_size)
    shape = tuple(train_set.input_shape)  # type: ignore[attr-defined]
    if shape != expected:
        raise ConfigError(
            f"the data's examples have shape {shape} but the model takes {expected} "
            '(model.in_channels, model.in_size): with dataset = "patches" set '
            f"data.patch_size = {model.in_size} and data.channels = {model.in_channels}"
        )


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


def train_greedy(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    """Train the stacks of a sparse autoencoder one after the other; log, evaluate and
    checkpoint as the config says."""
    train_cfg = config.train
    device = resolve_device(config.run.device)
    if config.run.num_threads:
        torch.set_num_threads(config.run.num_threads)
    torch.manual_seed(config.run.seed)
    train_set, test_set = build_datasets(config)
    _check_data_shape(config, train_set)
    network = build_model_for(config, train_set).to(device)
    assert isinstance(network, SparseAutoencoderNetwork)
    batch_size = train_cfg.batch_size
    drop_last = len(train_set) >= batch_size  # type: ignore[arg-type]
    batches_per_epoch = num_batches(len(train_set), batch_size, drop_last)  # type: ignore[arg-type]
    steps_per_stack = train_cfg.steps or train_cfg.epochs * batches_per_epoch
    total_steps = steps_per_stack * network.num_stacks
    pin_memory = (
        device.type == "cuda" if config.loader.pin_memory == "auto" else config.loader.pin_memory
    )

    def optimizer_for(stack: int) -> torch.optim.Optimizer:
        network.train_only(stack)
        return build_optimizer(network.stack_parameter_groups(stack, train_cfg.lr), train_cfg)

    step, examples, elapsed, optimizer_stack = 0, 0, 0.0, 0
    optimizer = optimizer_for(0)
    if resume:
        path = run.checkpoints.latest()
        assert path is not None  # RunDir.prepare checked
        tensors, meta = load_checkpoint(path)
        if (meta.get("batches_per_epoch"), meta.get("steps_per_stack")) != (
            batches_per_epoch,
            steps_per_stack,
        ):
            raise CheckpointError(
                f"checkpoint {path} was made with {meta.get('batches_per_epoch')} batches per "
                f"epoch and {meta.get('steps_per_stack')} steps per stack, this config gives "
                f"{batches_per_epoch} and {steps_per_stack}: resume with the same train.steps, "
                "train.batch_size and data"
            )
        optimizer_stack = meta["stack"]
        optimizer = optimizer_for(optimizer_stack)
        load_model_state(network, optimizer, tensors, meta, str(path))
        step, examples, elapsed = meta["step"], meta["examples"], meta["time_s"]
        truncate_metrics(run.metrics, step)
        console.print(f"resumed {run.path} at step {step} (stack {optimizer_stack + 1})")

    def save(record: dict[str, Any]) -> None:
        tensors, meta = model_state(network, optimizer)
        meta.update(
            step=step,
            examples=examples,
            time_s=time.perf_counter() - start,
            batches_per_epoch=batches_per_epoch,
            steps_per_stack=steps_per_stack,
            stack=optimizer_stack,
            strategy="single",
            config=config.model_dump(mode="json"),
            metrics=record,
        )
        run.checkpoints.save(step, tensors, meta)
        if optimizer_stack == 0:
            write_filter_image(
                network.stacks[0].filter.weight, network.stacks[0].geometry, run.path / FILTERS_FILE
            )

    start = time.perf_counter() - elapsed
    record: dict[str, Any] = {}
    window = torch.zeros(2, dtype=torch.float64, device=device)  # reconstruction, sparsity
    window_examples, window_start, paused = 0, time.perf_counter(), 0.0
    with (
        MetricsLog(run.metrics) as log,
        StopOnInterrupt() as interrupt,
        TrainingProgress(total_steps, completed=step, description="greedy") as progress,
    ):
        while step < total_steps and not interrupt.requested:
            stack = step // steps_per_stack
            if stack != optimizer_stack:
                optimizer, optimizer_stack = optimizer_for(stack), stack
            epoch, start_batch = divmod(step - stack * steps_per_stack, batches_per_epoch)
            loader = make_loader(
                train_set,
                batch_size,
                shuffle=True,
                seed=derive_seed(config.run.seed, stack),
                epoch=epoch,
                start_batch=start_batch,
                workers=config.loader.workers,
                pin_memory=pin_memory,
                drop_last=drop_last,
            )
            for (x,) in loader:
                x = x.to(device, non_blocking=True)
                if step % steps_per_stack == 0:  # a stack's first minibatch: start alpha there
                    with torch.no_grad():
                        network.stacks[stack].fit_alpha_(network.features(x, stack))
                terms = network.stack_objective(x, stack)
                optimizer.zero_grad(set_to_none=True)
                terms.total.backward()
                optimizer.step()
                step += 1
                examples += len(x)
                window += torch.stack([terms.reconstruction, terms.sparsity]).detach() * len(x)
                window_examples += len(x)

                end_of_stack = step % steps_per_stack == 0
                evaluating = step % train_cfg.eval_every == 0 or end_of_stack
                if step % train_cfg.log_every == 0 or evaluating or interrupt.requested:
                    now = time.perf_counter()
                    reconstruction, sparsity = (window / window_examples).tolist()
                    record = {
                        "time_s": round(now - start, 4),
                        "step": step,
                        "epoch": epoch,
                        "examples": examples,
                        "stack": stack + 1,
                        "loss": reconstruction + sparsity,
                        "reconstruction": reconstruction,
                        "sparsity": sparsity,
                        "alpha": network.stacks[stack].alpha.item(),
                        "lr": optimizer.param_groups[0]["lr"],
                        "examples_per_s": window_examples / max(now - window_start - paused, 1e-9),
                    }
                    if not math.isfinite(record["loss"]):
                        raise UserError(
                            f"training diverged: the objective is {record['loss']} at step "
                            f"{step} (stack {stack + 1}); lower train.lr"
                        )
                    if evaluating:
                        record.update(
                            evaluate_objective(
                                network, stack, test_set, train_cfg.eval_batch_size, device
                            )
                        )
                    log.log(record)
                    show_greedy_progress(progress, record)
                    window.zero_()
                    window_examples, window_start, paused = 0, time.perf_counter(), 0.0
                if step % train_cfg.checkpoint_every == 0 or end_of_stack or interrupt.requested:
                    saving_from = time.perf_counter()
                    save(record)
                    paused += time.perf_counter() - saving_from
                progress.update(step)
                if end_of_stack or interrupt.requested:
                    break
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
