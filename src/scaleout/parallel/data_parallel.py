"""Strategy "sync": synchronous data parallelism (Ding et al. 2015, section 2.2).

`sync.num_workers` Ray actors (`SyncWorker`) form one torch.distributed group
(`scaleout.comm.ProcessGroup`: gloo on CPU, NCCL on GPU). `train.batch_size` is the
effective batch: the examples of global batch k are the ones strategy "single" would use,
and worker r trains on slice r of them (`make_loader(part=r, num_parts=W)`), so for one
worker this strategy IS strategy "single" (same initial weights, data order, dropout
stream and optimizer), and every extra worker only splits the batch.

Communication schedule per step, by `sync.mode`:

- `allreduce`: PyTorch DDP. During backward, gradient buckets are all-reduced and averaged
  as soon as they are ready (overlapping the rest of backward); every worker then applies
  the same averaged gradient, so all replicas stay identical. With `[compress] codec` other
  than fp32, the bucket travels through `scaleout.compress.ddp_hook` (8-bit codes,
  all-gathered). For SGD this equals one worker on the concatenated batch.
- `average`: the paper's scheme. Each worker steps on its own slice with its own
  optimizer; every `average_every` steps one all-reduce (coalesced into a flat buffer per
  dtype) averages the parameters, floating buffers AND the optimizer state (momentum,
  Adam moments). Evaluation uses the average of the current weights without changing the
  workers; a checkpoint is a synchronisation point (the workers average before it).

The driver hands out chunks of steps (up to the next log, evaluation or checkpoint step),
sums the workers' loss and accuracy, evaluates on rank 0 and writes checkpoints holding
rank 0's model and optimizer and every rank's RNG state, in strategy "single"'s format.
Synchronous training cannot go on without a worker: when one dies, the driver stops the
run with `WorkerDied`, naming the worker and the last checkpoint (`--resume` continues).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from scaleout.build import build_datasets, build_model_for, build_optimizer, resolve_device
from scaleout.checkpoint import load_checkpoint
from scaleout.comm import GroupMember, ProcessGroup, WorkerDied
from scaleout.config import RunConfig
from scaleout.data import derive_seed, make_loader, num_batches
from scaleout.data.prefetch import DevicePrefetcher
from scaleout.errors import CheckpointError, ConfigError, UserError
from scaleout.interrupt import StopOnInterrupt
from scaleout.metrics import MetricsLog, truncate_metrics
from scaleout.optim.single import (
    TrainResult,
    evaluate,
    load_model_state,
    model_state,
    reached,
    show_progress,
)
from scaleout.progress import TrainingProgress, console
from scaleout.rundir import RunDir
from scaleout.runtime import session

__all__ = ["SyncTrainer", "SyncWorker", "WorkerDied", "average_tensors", "train_sync"]


@torch.no_grad()
def average_tensors(tensors: list[torch.Tensor], group: Any = None) -> None:  # noqa: ANN401
    """Replace each tensor by its mean over the process group: one all-reduce per dtype of
    a flat buffer holding all of them (coalesced: latency is paid once, not per tensor)."""
    world = dist.get_world_size(group)
    if world == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)  # (sum of numels,)
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for tensor, mean in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            tensor.copy_(mean)


def synced_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What `average` mode averages: parameters, floating buffers, floating optimizer state
    (momentum buffers, moments; not step counters)."""
    tensors = [p.data for p in model.parameters()]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    for state in optimizer.state.values():
        tensors += [
            v
            for k, v in sorted(state.items())
            if torch.is_tensor(v) and v.is_floating_point() and k != "step" and v.dim() > 0
        ]
    return tensors


class SyncWorker(GroupMember):
    """One data-parallel worker (a Ray actor): its slice of every batch, a full model copy."""

    def __init__(
        self,
        rank: int,
        world: int,
        config: dict[str, Any],
        state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
    ) -> None:
        self.config = RunConfig.model_validate(config)
        self.rank, self.world = rank, world
        self.opts, cfg = self.config.sync, self.config.train
        torch.set_num_threads(self.config.run.num_threads or 1)
        self.device = resolve_device(self.config.run.device)
        # The same calls, in the same order, as strategy "single": rank 0's weights and RNG
        # stream are exactly the single worker's.
        torch.manual_seed(self.config.run.seed)
        self.train_set, self.test_set = build_datasets(self.config)
        self.model = build_model_for(self.config, self.train_set).to(self.device)
        self.optimizer = build_optimizer(self.model.parameters(), cfg)
        self.step = 0
        if state is not None:
            tensors, meta = state
            load_model_state(self.model, self.optimizer, tensors, meta, "checkpoint")
            self.step = meta["step"]
            if rank > 0:
                rng = tensors.get(f"rng.torch.{rank}")
                if rng is not None:
                    torch.set_rng_state(rng)
                else:
                    torch.manual_seed(derive_seed(self.config.run.seed, rank, self.step))
        elif rank > 0:  # its own dropout stream
            torch.manual_seed(derive_seed(self.config.run.seed, rank))
        size = len(self.train_set)  # type: ignore[arg-type]
        self.drop_last = size >= cfg.batch_size
        self.batches_per_epoch = num_batches(size, cfg.batch_size, self.drop_last)
        self.pin_memory = (
            self.device.type == "cuda"
            if self.config.loader.pin_memory == "auto"
            else self.config.loader.pin_memory
        )
        self.network: torch.nn.Module = self.model
        self._batches: Any = None
        self._epoch = -1

    def pid(self) -> int:
        return os.getpid()

    def start(self) -> None:
        """After the group is formed: wrap the model in DDP (allreduce mode)."""
        if self.opts.mode == "allreduce" and self.world > 1:
            ids = [self.device.index or 0] if self.device.type == "cuda" else None
            self.network = DistributedDataParallel(self.model, device_ids=ids)
            codec = self.config.compress.codec
            if codec != "fp32":
                from scaleout.compress import ddp_hook, from_config

                self.network.register_comm_hook(None, ddp_hook(from_config(self.config.compress)))

    # --- training ---------------------------------------------------------------------------

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, batch = divmod(self.step, self.batches_per_epoch)
        if self._batches is None or epoch != self._epoch:
            loader = make_loader(
                self.train_set,
                self.config.train.batch_size,
                seed=self.config.run.seed,
                epoch=epoch,
                start_batch=batch,
                workers=self.config.loader.workers,
                pin_memory=self.pin_memory,
                drop_last=self.drop_last,
                prefetch_factor=self.config.loader.prefetch_factor,
                part=self.rank,
                num_parts=self.world,
            )
            ahead = self.config.loader.device_prefetch
            self._batches, self._epoch = iter(DevicePrefetcher(loader, self.device, ahead)), epoch
        return next(self._batches)

    def train_chunk(self, num_steps: int) -> dict[str, float]:
        """Train `num_steps` steps in lock step with the other workers; return sums over
        them: loss, correct predictions, examples, and seconds waiting for data / averaging."""
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        examples, wait_s, average_s = 0, 0.0, 0.0
        started = time.perf_counter()
        for _ in range(num_steps):
            waiting = time.perf_counter()
            x, y = self._next_batch()
            wait_s += time.perf_counter() - waiting
            logits = self.network(x)  # (n, num_classes)
            loss = F.cross_entropy(logits, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # allreduce mode: DDP averages gradients here
            self.optimizer.step()
            self.step += 1
            if self.opts.mode == "average" and self.step % self.opts.average_every == 0:
                averaging = time.perf_counter()
                average_tensors(synced_state(self.model, self.optimizer))
                average_s += time.perf_counter() - averaging
            loss_sum += loss.detach() * len(y)
            correct += (logits.detach().argmax(dim=1) == y).sum()
            examples += len(y)
        value = loss_sum.item()
        if not math.isfinite(value):
            raise UserError(
                f"training diverged: worker {self.rank} loss is {value} at step {self.step}; "
                "lower train.lr"
            )
        return {
            "loss_sum": value,
            "correct": correct.item(),
            "examples": examples,
            "seconds": time.perf_counter() - started,
            "wait_s": wait_s,
            "average_s": average_s,
        }

    # --- evaluation and checkpoints ---------------------------------------------------------

    def average_now(self) -> None:
        """Average weights and optimizer state now (average mode; a no-op for allreduce)."""
        if self.opts.mode == "average":
            average_tensors(synced_state(self.model, self.optimizer))

    def evaluate(self) -> tuple[float, float] | None:
        """Test loss and accuracy of the workers' average weights (rank 0 answers)."""
        params = [p.data for p in self.model.parameters()]
        saved = None
        if self.opts.mode == "average" and self.world > 1:
            saved = [p.clone() for p in params]
            average_tensors(params)
        result = None
        if self.rank == 0:
            result = evaluate(
                self.model, self.test_set, self.config.train.eval_batch_size, self.device
            )
        if saved is not None:
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)
        return result

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Model, optimizer and this rank's RNG (`model_state`, strategy "single"'s format)."""
        tensors, meta = model_state(self.model, self.optimizer)
        return {k: v.cpu() for k, v in tensors.items()}, meta

    def rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()


class SyncTrainer:
    """The driver: forms the group, hands out chunks of steps, logs, evaluates, checkpoints."""

    def __init__(self, config: RunConfig, run: RunDir, resume: bool) -> None:
        self.config, self.run, self.opts = config, run, config.sync
        cfg = config.train
        if cfg.batch_size % self.opts.num_workers:
            raise ConfigError(
                f"train.batch_size = {cfg.batch_size} must be a multiple of sync.num_workers = "
                f"{self.opts.num_workers} (each worker trains on an equal slice of the batch)"
            )
        train_set, _ = build_datasets(config)
        size = len(train_set)  # type: ignore[arg-type]
        self.batches_per_epoch = num_batches(size, cfg.batch_size, size >= cfg.batch_size)
        self.total_steps = cfg.steps or cfg.epochs * self.batches_per_epoch
        self.step, self.examples, self.elapsed = 0, 0, 0.0
        self.state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        if resume:
            self._restore()
        device = resolve_device(config.run.device)
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.group = ProcessGroup.create(
            SyncWorker,
            self.opts.num_workers,
            args=(config.model_dump(mode="json"), self.state),
            num_cpus=min(1.0, cpus / self.opts.num_workers),
            num_gpus=1.0 if device.type == "cuda" else 0.0,
            backend=self.opts.backend,
            device=str(device),
            timeout_s=self.opts.timeout_s,
        )
        self.workers = self.group.actors
        try:
            self._get([w.start.remote() for w in self.workers], "starting")
        except BaseException:
            self.group.close()
            raise

    def _restore(self) -> None:
        path = self.run.checkpoints.latest()
        assert path is not None  # RunDir.prepare checked
        tensors, meta = load_checkpoint(path)
        if meta.get("strategy") != "sync":
            raise CheckpointError(f"{path} is a {meta.get('strategy')} checkpoint, not a sync one")
        if meta["batches_per_epoch"] != self.batches_per_epoch:
            raise CheckpointError(
                f"checkpoint {path} was made with {meta['batches_per_epoch']} batches per epoch, "
                f"this config gives {self.batches_per_epoch}: resume with the same "
                "train.batch_size and data"
            )
        self.step, self.examples, self.elapsed = meta["step"], meta["examples"], meta["time_s"]
        self.state = (tensors, meta)
        truncate_metrics(self.run.metrics, self.step)
        console.print(f"resumed {self.run.path} at step {self.step} from {path.name}")

    def _get(self, futures: list[Any], doing: str) -> list[Any]:
        """Wait for one call on every worker; a dead worker stops the run (`WorkerDied`)."""
        return self.group.get(futures, doing, "sync worker", self._where)

    def _where(self) -> str:
        latest = self.run.checkpoints.latest()
        return f"at step {self.step}; " + (
            f"the last checkpoint is {latest} (continue with --resume)"
            if latest
            else "no checkpoint was written yet (start the run again)"
        )

    def checkpoint(self, record: dict[str, Any]) -> None:
        self._get([w.average_now.remote() for w in self.workers], "averaging")
        states = self._get([w.state.remote() for w in self.workers[:1]], "checkpointing")
        tensors, meta = states[0]
        rngs = self._get([w.rng_state.remote() for w in self.workers[1:]], "checkpointing")
        for rank, rng in enumerate(rngs, start=1):
            tensors[f"rng.torch.{rank}"] = rng
        meta.update(
            step=self.step,
            examples=self.examples,
            time_s=time.perf_counter() - self.start,
            batches_per_epoch=self.batches_per_epoch,
            strategy="sync",
            num_workers=self.opts.num_workers,
            mode=self.opts.mode,
            config=self.config.model_dump(mode="json"),
            metrics=record,
        )
        self.run.checkpoints.save(self.step, tensors, meta)

    def train(self) -> TrainResult:
        try:
            result = self._train()
        except BaseException:
            self.group.close(timeout_s=0.0)  # survivors may hang in a collective: kill them
            raise
        self.group.close()
        return result

    def _train(self) -> TrainResult:
        cfg = self.config.train
        self.start = time.perf_counter() - self.elapsed
        record: dict[str, Any] = {}
        with (
            MetricsLog(self.run.metrics) as log,
            StopOnInterrupt() as interrupt,
            TrainingProgress(self.total_steps, completed=self.step, description="sync") as bar,
        ):
            while self.step < self.total_steps and not interrupt.requested:
                boundaries = [cfg.log_every, cfg.eval_every, cfg.checkpoint_every]
                target = min((self.step // b + 1) * b for b in boundaries)
                steps = min(target, self.total_steps) - self.step
                epoch = self.step // self.batches_per_epoch
                window_start = time.perf_counter()
                outs = self._get([w.train_chunk.remote(steps) for w in self.workers], "training")
                seconds = time.perf_counter() - window_start
                self.step += steps
                examples = sum(o["examples"] for o in outs)
                self.examples += examples
                last = self.step >= self.total_steps
                evaluating = self.step % cfg.eval_every == 0 or last
                if self.step % cfg.log_every == 0 or evaluating or interrupt.requested:
                    record = {
                        "time_s": round(time.perf_counter() - self.start, 4),
                        "step": self.step,
                        "epoch": epoch,
                        "examples": self.examples,
                        "loss": sum(o["loss_sum"] for o in outs) / examples,
                        "train_accuracy": sum(o["correct"] for o in outs) / examples,
                        "lr": cfg.lr,
                        "examples_per_s": examples / max(seconds, 1e-9),
                        "data_wait_s": max(o["wait_s"] for o in outs) / steps,
                        "average_s": max(o["average_s"] for o in outs) / steps,
                    }
                    if evaluating:
                        result = self._get(
                            [w.evaluate.remote() for w in self.workers], "evaluating"
                        )[0]
                        record["test_loss"], record["test_accuracy"] = result
                        if reached(cfg.target_accuracy, record):
                            self.total_steps, last = self.step, True
                    log.log(record)
                    show_progress(bar, record)
                if self.step % cfg.checkpoint_every == 0 or last or interrupt.requested:
                    self.checkpoint(record)
                bar.update(self.step)
        if interrupt.requested:
            console.print(
                f"interrupted at step {self.step}: checkpoint saved in "
                f"{self.run.checkpoints.directory}; continue with --resume"
            )
        summary = self.run.finish()
        summary.update(num_workers=self.opts.num_workers, mode=self.opts.mode)
        return TrainResult(step=self.step, interrupted=interrupt.requested, summary=summary)


def train_sync(config: RunConfig, run: RunDir, resume: bool = False) -> TrainResult:
    """Run synchronous data parallelism: embedded Ray by default, a cluster with
    `run.address`."""
    with session(config.run.address):
        return SyncTrainer(config, run, resume).train()
