"""Strategy "single": one worker, the reference every distributed strategy is measured by.

The loop is deterministic given the config: the order of examples is a function of
(seed, epoch) and the checkpoint holds the model, the optimizer state, the RNG state and the
position in the epoch, so a run killed and resumed ends with exactly the parameters of an
uninterrupted run. There is no communication; the loss, metrics, checkpoints and evaluation
are the same pieces the distributed strategies use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from scaleout.build import build_datasets, build_model_for, build_optimizer, resolve_device
from scaleout.checkpoint import load_checkpoint, load_optimizer_state, optimizer_state
from scaleout.config import RunConfig
from scaleout.data import make_loader, num_batches
from scaleout.errors import CheckpointError, UserError
from scaleout.interrupt import StopOnInterrupt
from scaleout.metrics import MetricsLog, truncate_metrics
from scaleout.progress import TrainingProgress, console
from scaleout.rundir import RunDir


@dataclass
class TrainResult:
    """What a strategy returns: where it stopped and the run's summary."""

    step: int
    interrupted: bool
    summary: dict[str, Any] = field(default_factory=dict)


@torch.inference_mode()
def evaluate(
    model: nn.Module, dataset: Dataset, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of `model` on `dataset`."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    loader = make_loader(dataset, batch_size, shuffle=False, pin_memory=device.type == "cuda")
    dtype = next(model.parameters()).dtype  # e.g. float64 for Sandblaster's convex runs
    for x, y in loader:
        x, y = x.to(device, dtype, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)  # (N, num_classes)
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(dim=1) == y).sum()
    model.train(was_training)
    count = len(dataset)  # type: ignore[arg-type]
    return loss_sum.item() / count, correct.item() / count


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Tensors and metadata of a training state: parameters, optimizer, RNG."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    optim_tensors, optim_meta = optimizer_state(optimizer)
    tensors.update(optim_tensors)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors, {"optimizer": optim_meta}


def load_model_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict, meta: dict, source: str
) -> None:
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointError(
            f"checkpoint {source} does not fit the configured model: {str(err).splitlines()[0]}"
        ) from None
    load_optimizer_state(optimizer, tensors, meta["optimizer"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


def reached(target: float | None, record: dict[str, Any]) -> bool:
    """Whether an evaluation reached `train.target_accuracy` (the run then stops)."""
    accuracy = record.get("test_accuracy")
    if target is None or accuracy is None or accuracy < target:
        return False
    console.print(
        f"test accuracy {100 * accuracy:.2f}% reached the target at step {record['step']}"
    )
    return True


def show_progress(progress: TrainingProgress, record: dict[str, Any]) -> None:
    """Loss, test accuracy and rate beside the bar, and a log line per evaluation."""
    fields = {}
    if record.get("loss") is not None:
        fields["loss"] = f"loss {record['loss']:.4f}"
    if "test_accuracy" in record:
        fields["acc"] = f"acc {100 * record['test_accuracy']:.2f}%"
    if record.get("examples_per_s") is not None:
        fields["rate"] = f"{record['examples_per_s'] / 1000:.1f}k ex/s"
    progress.update(record["step"], **fields)
    if "test_accuracy" in record:
        progress.log(
            f"step {record['step']}  {record['time_s']:.1f}s  "
            + "  ".join(fields.values())
            + f"  test loss {record['test_loss']:.4f}"
        )


def train_single(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    """Train on one worker; log, evaluate and checkpoint as the config says.

    `run.num_threads` holds for the run only: the caller's torch thread count is restored.
    """
    threads = torch.get_num_threads()
    try:
        if config.model.kind == "sparse_autoencoder":  # unsupervised, trained stack by stack
            from scaleout.optim.greedy_driver import train_greedy

            return train_greedy(config, run, resume)
        return _train_single(config, run, resume)
    finally:
        torch.set_num_threads(threads)


def _train_single(config: RunConfig, run: RunDir, resume: bool) -> TrainResult:
    train_cfg = config.train
    device = resolve_device(config.run.device)
    if config.run.num_threads:
        torch.set_num_threads(config.run.num_threads)
    torch.manual_seed(config.run.seed)
    train_set, test_set = build_datasets(config)
    model = build_model_for(config, train_set).to(device)
    optimizer = build_optimizer(model.parameters(), train_cfg)
    batch_size = train_cfg.batch_size
    drop_last = len(train_set) >= batch_size  # type: ignore[arg-type]
    batches_per_epoch = num_batches(len(train_set), batch_size, drop_last)  # type: ignore[arg-type]
    total_steps = train_cfg.steps or train_cfg.epochs * batches_per_epoch
    pin_memory = (
        device.type == "cuda" if config.loader.pin_memory == "auto" else config.loader.pin_memory
    )

    step, examples, elapsed = 0, 0, 0.0
    if resume:
        path = run.checkpoints.latest()
        assert path is not None  # RunDir.prepare checked
        tensors, meta = load_checkpoint(path)
        if meta["batches_per_epoch"] != batches_per_epoch:
            raise CheckpointError(
                f"checkpoint {path} was made with {meta['batches_per_epoch']} batches per epoch, "
                f"this config gives {batches_per_epoch}: resume with the same train.batch_size "
                "and data"
            )
        load_model_state(model, optimizer, tensors, meta, str(path))
        step, examples, elapsed = meta["step"], meta["examples"], meta["time_s"]
        truncate_metrics(run.metrics, step)
        console.print(f"resumed {run.path} at step {step} from {path.name}")

    def save(record: dict[str, Any]) -> None:
        tensors, meta = model_state(model, optimizer)
        meta.update(
            step=step,
            examples=examples,
            time_s=time.perf_counter() - start,
            batches_per_epoch=batches_per_epoch,
            strategy="single",
            config=config.model_dump(mode="json"),
            metrics=record,
        )
        run.checkpoints.save(step, tensors, meta)

    start = time.perf_counter() - elapsed
    record: dict[str, Any] = {}
    window_loss = torch.zeros((), device=device)
    window_correct = torch.zeros((), device=device, dtype=torch.long)
    window_examples, window_start, paused = 0, time.perf_counter(), 0.0
    with (
        MetricsLog(run.metrics) as log,
        StopOnInterrupt() as interrupt,
        TrainingProgress(total_steps, completed=step) as progress,
    ):
        while step < total_steps and not interrupt.requested:
            epoch, start_batch = divmod(step, batches_per_epoch)
            loader = make_loader(
                train_set,
                batch_size,
                shuffle=True,
                seed=config.run.seed,
                epoch=epoch,
                start_batch=start_batch,
                workers=config.loader.workers,
                pin_memory=pin_memory,
                drop_last=drop_last,
            )
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)  # (N, num_classes)
                loss = F.cross_entropy(logits, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                examples += len(y)
                window_loss += loss.detach() * len(y)
                window_correct += (logits.detach().argmax(dim=1) == y).sum()
                window_examples += len(y)

                last = step == total_steps
                evaluating = step % train_cfg.eval_every == 0 or last
                if step % train_cfg.log_every == 0 or evaluating or interrupt.requested:
                    now = time.perf_counter()
                    record = {
                        "time_s": round(now - start, 4),
                        "step": step,
                        "epoch": epoch,
                        "examples": examples,
                        "loss": window_loss.item() / window_examples,
                        "train_accuracy": window_correct.item() / window_examples,
                        "lr": optimizer.param_groups[0]["lr"],
                        # training rate: time spent evaluating and saving is left out
                        "examples_per_s": window_examples / max(now - window_start - paused, 1e-9),
                    }
                    if not math.isfinite(record["loss"]):
                        raise UserError(
                            f"training diverged: loss is {record['loss']} at step {step}; "
                            "lower train.lr"
                        )
                    if evaluating:
                        record["test_loss"], record["test_accuracy"] = evaluate(
                            model, test_set, train_cfg.eval_batch_size, device
                        )
                        if reached(train_cfg.target_accuracy, record):
                            total_steps, last = step, True
                    log.log(record)
                    show_progress(progress, record)
                    window_loss.zero_()
                    window_correct.zero_()
                    window_examples, window_start, paused = 0, time.perf_counter(), 0.0
                if step % train_cfg.checkpoint_every == 0 or last or interrupt.requested:
                    saving_from = time.perf_counter()
                    save(record)
                    paused += time.perf_counter() - saving_from
                progress.update(step)
                if last or interrupt.requested:
                    break
    if interrupt.requested:
        console.print(
            f"interrupted at step {step}: checkpoint saved in {run.checkpoints.directory}; "
            "continue with --resume"
        )
    return TrainResult(step=step, interrupted=interrupt.requested, summary=run.finish())
