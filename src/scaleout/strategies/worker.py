"""The training loop: one process's part of training, under every strategy.

A `Worker` builds its data and model from the job, takes its part of them as its `Role`
says, and trains chunks of steps. What differs between strategies is only where the update
happens and what is shared:

- a whole replica with a local optimizer (strategy "single");
- this worker's part of a replica partitioned over a grid (`role.grid`, strategy
  "model_parallel"): every worker runs the same steps on the same minibatch, the exchanges
  happen inside the model (`scaleout.parallel.parallelize`), replicated parameters' gradients
  are summed over the grid, and sums of the objective are reduced over it;
- a slice of every global batch (`role.sliced`, strategy "sync"): DDP averages gradients
  during backward (`role.ddp`), or weights and optimizer state are averaged every
  `role.average_every` steps;
- a part of the data with no optimizer of its own (strategy "downpour"): a `ReplicaClient`
  fetches parameters from the parameter-server shards and pushes accumulated gradients.

The update itself is the worker's `updater` (`scaleout.strategies.updaters`): its own
optimizer (`LocalUpdate`) or the parameter server (`ShardUpdate`, set by `attach`).

Seeds: every worker builds data and model after `torch.manual_seed(run.seed)`, so all start
from the same weights, and worker 0's dropout stream is strategy "single"'s; other ranks and
replicas draw their own. Data order depends only on (seed, phase, epoch), so a run resumes
exactly where it stopped; a Downpour replica r > 0 shuffles its own part with its own seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from scaleout.checkpoint import unshared
from scaleout.compress.fsdp import fsdp_comms
from scaleout.compress.link import OnLink
from scaleout.data import derive_seed, make_loader
from scaleout.data.parts import data_part
from scaleout.errors import UserError
from scaleout.nn.optim import build_optimizer
from scaleout.nn.schedule import Schedule
from scaleout.parallel import (
    fsdp,
    parallelize,
    parts,
    stages,
    tensor,
)
from scaleout.parallel.pipeline import (
    PipelineRunner,
    Relayed,
    average_gradients,
    pipeline_groups,
    sum_tied_gradients,
)
from scaleout.runtime import resolve_device
from scaleout.strategies.batches import Batches
from scaleout.strategies.held_model import HeldModel
from scaleout.strategies.role import Role
from scaleout.strategies.updaters import LocalUpdate, ShardUpdate
from scaleout.strategies.worker_shards import served_params, shard_update, start_values
from scaleout.train.job import Job
from scaleout.train.objective import Layerwise, Supervised, objective_for
from scaleout.train.protocol import Chunk
from scaleout.train.step import Stepper

if TYPE_CHECKING:
    from scaleout.checkpoint import OptimizerState
    from scaleout.ps import ParameterServer


@dataclass
class WorkerChunk(Chunk):
    """A worker's `train` answer: its `Chunk`, where its data reader stands (a Downpour
    replica's, for checkpoints) and the push records since its last answer."""

    position: dict[str, int] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)


class Worker:
    def __init__(self, job: Job, role: Role, position: dict[str, int] | None = None) -> None:
        self.job, self.role, self.cfg = job, role, job.train
        self.device = resolve_device(job.run.device)
        seed = job.run.seed
        torch.manual_seed(seed)
        train_set, self.test_set = job.build_data()
        self.train_set = data_part(train_set, role.replica, role.num_replicas)
        model = job.build_model(self.train_set).to(self.device)
        # What the loader reads: 8-bit pixels on CUDA (`loader.uint8`), finished on the device.
        shipped, self.finish_batch = job.loader.with_uint8(train_set, self.device)
        self.whole_train_set = shipped  # Downpour: the parts are cut again when scaled
        if shipped is not train_set:
            self.train_set = data_part(shipped, role.replica, role.num_replicas)
        self.objective = objective_for(model, job.loss_fn(), self.test_set, job.metrics_source())
        schedule = role.schedule or Schedule()
        self.stepper = Stepper(job.train, job.run.precision, self.device, schedule)
        self.layerwise = isinstance(self.objective, Layerwise)
        # the codec of the exchanges and of DDP's buckets; on a `compress.link`, one that
        # sends raw what is faster raw, once the ranks agreed on its cost (`start`)
        self.codec = job.compress.build_for_collectives()
        stage_index: list[int] = []  # pipeline: the stage's parameters in the model's order
        # pipeline: per parameter several stages hold, this stage's copy (or None), shape
        self.tied: list[tuple[nn.Parameter | None, tuple[int, ...]]] = []
        aliases: dict[str, str] = {}
        if role.stages > 1:  # this worker keeps its stage of the model
            try:
                plan = stages.split(model, role.stages)
            except ValueError as err:
                raise UserError(str(err)) from None
            stage = stages.stage_module(model, plan[role.stage])
            stage_index = stages.trainable_index(model, stage)
            aliases = unshared(model.state_dict())[1]  # tied names, for checkpoints
            trainable = [p for p in model.parameters() if p.requires_grad]
            for tied in stages.tied_parameters(model, plan):
                mine = trainable[tied.index] if role.stage in tied.stages else None
                self.tied.append((mine, tied.shape))
                if mine is not None and tied.stages[0] != role.stage:
                    self.stepper.counted_elsewhere.append(mine)  # the first holder counts it
            model = stage
        if role.grid is not None:
            model = parallelize(model, role.grid, role.rank, None, role.transport, self.codec)  # type: ignore[arg-type]
        self.model: nn.Module = model
        self.network: nn.Module = model  # what the forward pass runs: DDP wraps it (`start`)
        self.held = HeldModel(model, role, self.device, stage_index, aliases)
        self.replicas: dist.ProcessGroup | None = None  # this stage in the other pipelines
        # Downpour replica r > 0 shuffles its own part; worker 0 is strategy "single"
        self.data_seed = seed if role.replica == 0 else derive_seed(seed, role.replica)
        self.batches = self._batches()
        position = position or {}
        self.step = position.get("step", 0)
        self.phase = position.get("phase", 0)
        self.batches.seek(position.get("epoch", 0), position.get("batch", 0))
        self.groups: list[dict[str, Any]] = []
        self.updater: LocalUpdate | ShardUpdate = LocalUpdate(None, self.stepper, self.model)
        self._select_phase(self.phase)
        if role.slice > 0 and role.sliced:  # its own dropout stream
            torch.manual_seed(derive_seed(seed, role.slice))
        elif role.replica > 0 or self.step > 0:
            torch.manual_seed(derive_seed(seed, role.replica, self.step))

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer a checkpoint holds: the worker's own, DiLoCo's inner one, or None
        (gradient pushes: the shards hold it)."""
        return self.updater.optimizer

    def start(self) -> None:
        """After the process group is formed: the ranks agree on the codec's cost on the
        link (`OnLink.agree`, a collective); wrap the model in DDP (`role.ddp`), or shard it
        (`role.fsdp`) and build the optimizer over the shards."""
        if isinstance(self.codec, OnLink) and self.role.world > 1:
            self.codec.agree(buckets=self.role.ddp)
        if self.held.pipelined:
            assert isinstance(self.model, stages.Stage) and isinstance(self.objective, Supervised)
            self.held.pipeline, self.replicas = pipeline_groups(
                self.role.world, self.role.stages, self.device
            )
            self.stepper.stages = self.held.pipeline
            self.network = PipelineRunner(  # type: ignore[assignment]
                self.model,
                self.held.pipeline,
                self.role.microbatches,
                self.role.pipeline_schedule,  # type: ignore[arg-type]
                self.objective.loss,
                self.device,
                self.codec,
            )
        if self.role.tensor_plan and self.role.world > 1:
            tensor.tensor_parallel(self.model, dict(self.role.tensor_plan), self.device)
            self.held.sharded = True  # DTensor weights: state and evaluation as under FSDP
            self._select_phase(self.phase)  # the optimizer over the split parameters
        if self.role.fsdp and self.role.world > 1:
            blocks = self.role.fsdp_blocks
            comms = fsdp_comms(self.codec) if self.codec is not None else None
            try:
                fsdp.shard(self.model, list(blocks) if blocks is not None else None, comms)
            except ValueError as err:
                raise UserError(str(err)) from None
            self.held.sharded = True
            self._select_phase(self.phase)  # the optimizer over the sharded parameters
        if self.role.ddp and self.role.world > 1:
            ids = [self.device.index or 0] if self.device.type == "cuda" else None
            self.network = DistributedDataParallel(self.model, device_ids=ids)
            if self.codec is not None:
                from scaleout.compress import ddp_hook

                self.network.register_comm_hook(None, ddp_hook(self.codec))

    # --- phases, optimizer, data ---------------------------------------------------------

    def _select_phase(self, phase: int) -> None:
        """Train phase `phase`'s parameters from now on (a fresh optimizer for them, unless
        the shards step them)."""
        self.phase = phase
        seed = derive_seed(self.data_seed, phase) if self.layerwise else self.data_seed
        if seed != self.batches.seed:  # a layer-wise phase reads in its own order
            self.batches.seek(self.batches.epoch, self.batches.batch, seed)
        self.groups = list(self.objective.parameter_groups(self.model, phase, self.cfg.lr))
        if not isinstance(self.updater, ShardUpdate):
            optimizer = build_optimizer(self.groups, self.job.optimizer_options())
            self.updater = LocalUpdate(
                optimizer,
                self.stepper,
                self.model,
                self._sync_grads,
                self.role.average_every,
                self.role.world,
            )

    def _sync_grads(self) -> None:
        """Before a step: a grid sums its replicated parameters' gradients; a pipeline sums
        its tied copies' over the stages and averages each stage's over the pipelines."""
        if self.held.partitioned:
            parts.sync_grads(self.model)
        if self.held.pipelined:
            assert self.held.pipeline is not None
            sum_tied_gradients(self.tied, self.held.pipeline, self.device)
            average_gradients(self.model, self.replicas)

    def _batches(self) -> Batches:
        role = self.role
        return Batches(
            self.train_set,
            self.cfg.batch_size,
            self.job.loader,
            self.device,
            self.finish_batch,
            part=role.slice if role.sliced else 0,
            num_parts=role.slices if role.sliced else 1,
        )

    def position(self) -> dict[str, int]:
        return {"step": self.step, "phase": self.phase, **self.batches.position()}

    def take_part(
        self, replica: int, num_replicas: int, position: dict[str, int], outer_scale: float
    ) -> None:
        """Downpour, scaled to `num_replicas` replicas: be replica `replica` and read its part
        of the training set from `position` on (`downpour.positions.rescaled`), in the order
        this worker read before (its seed stays, so the run's other replicas' orders do);
        DiLoCo pushes `outer_scale` of the change (its share of a round)."""
        if isinstance(self.updater, ShardUpdate):
            self.updater.client.outer_scale = outer_scale
        name = f"replica {replica}"
        self.role = replace(self.role, name=name, replica=replica, num_replicas=num_replicas)
        self.train_set = data_part(self.whole_train_set, replica, num_replicas)
        self.step = position["step"]  # DiLoCo's schedule: its share of the run's steps
        seed = self.batches.seed
        self.batches = self._batches()
        self.batches.seek(position["epoch"], position["batch"], seed)

    # --- training ------------------------------------------------------------------------

    def train(self, num_steps: int, stop: Callable[[], bool] | None = None) -> WorkerChunk:
        """Train `num_steps` steps (fewer when `stop()` turns true): the sums over their
        examples (loss, right predictions, an objective's terms; reduced over a grid), the
        examples, and the latest epoch, learning rate and phase values."""
        sums: dict[str, Tensor] = {}
        examples = steps = 0
        wait_s = average_s = 0.0
        grad_norm: Tensor | None = None
        started = time.perf_counter()
        for _ in range(num_steps):
            phase_steps = self.role.phase_steps
            if phase_steps and self.step // phase_steps != self.phase:  # the next phase
                self.batches.seek(0, 0)
                self._select_phase(self.step // phase_steps)
            waiting = time.perf_counter()
            batch = self.batches.next()
            wait_s += time.perf_counter() - waiting
            if phase_steps and self.step % phase_steps == 0:  # a phase's first minibatch
                self.objective.begin_phase(self.model, batch, self.phase)
            self.updater.begin_step()  # Downpour: a fetch when one is due (not compute)
            computing = time.perf_counter()
            loss, step_sums = self.stepper.forward_backward(
                self.objective, self.model, self.network, batch, self.phase
            )
            report = self.updater.end_step(loss, computing, self.step + 1, self._schedule_step())
            if report.grad_norm is not None:
                grad_norm = report.grad_norm
            average_s += report.average_s
            self.step += 1
            steps += 1
            examples += len(batch[0])
            for name, value in step_sums.items():
                sums[name] = sums[name] + value if name in sums else value
            if stop is not None and stop():
                break
        values = self._reduce_sums(sums)
        loss_sum = values.pop("loss", 0.0)
        if not math.isfinite(loss_sum):
            self._diverged(loss_sum / max(examples, 1))
        correct = values.pop("correct", None)
        fields: dict[str, Any] = {"epoch": self.batches.epoch, **self._phase_fields()}
        fields["data_wait_s"] = wait_s / max(steps, 1)  # per step: loading not hidden
        if grad_norm is not None:  # the last step's, before clipping
            fields["grad_norm"] = float(grad_norm)
        if self.role.average_every:
            fields["average_s"] = average_s / max(steps, 1)
        return WorkerChunk(
            steps=steps,
            examples=examples,
            loss_sum=loss_sum,
            correct=correct,
            term_sums=values,
            fields=fields,
            seconds=time.perf_counter() - started,
            position=self.position(),
            records=self.take_records(),
        )

    def _schedule_step(self) -> int:
        """The step the learning rate is a function of: the run's global step, or the
        phase's own for layer-wise training (each phase is a fresh optimization). A
        DiLoCo replica takes every num_replicas-th global step: its own step times that."""
        phase_steps = self.role.phase_steps
        step = self.step - self.phase * phase_steps if phase_steps else self.step
        return step * self.role.num_replicas if isinstance(self.updater, ShardUpdate) else step

    def _phase_fields(self) -> dict[str, Any]:
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else self.cfg.lr
        return {"lr": lr, **self.objective.phase_metrics(self.model, self.phase)}

    def _reduce_sums(self, sums: dict[str, Tensor]) -> dict[str, float]:
        if not sums:
            return {}
        names = list(sums)
        stacked = torch.stack([sums[n].double() for n in names])
        if self.held.partitioned:
            stacked = parts.reduce_parts(self.model, stacked)
        return dict(zip(names, stacked.tolist(), strict=True))

    def _diverged(self, loss: float) -> None:
        raise UserError(
            f"training diverged: {self.role.name} loss is {loss} at its step {self.step}; "
            "lower train.lr"
        )

    # --- on the parameter server (strategy "downpour") ---------------------------------------

    def _served(self) -> list[list[tuple[str, nn.Parameter]]]:
        return served_params(self.model, self.groups, self.held.partitioned, self.role.rank)

    def begin_phase(self, phase: int, fresh: bool = True) -> list[tuple[Tensor, float] | None]:
        """Make `phase` current (from its first minibatch when `fresh`; a layer-wise phase
        then fits its start, e.g. alpha, on that minibatch); return what its shards start
        from (`worker_shards.start_values`)."""
        if fresh:
            self.batches.seek(0, 0)
        self._select_phase(phase)
        if fresh and self.layerwise:
            self.objective.begin_phase(self.model, self.batches.peek(), phase)
        return start_values(self.groups, self._served(), self.cfg.lr)

    def attach(
        self,
        phase: int,
        servers: list[ParameterServer | None],
        n_fetch: int,
        n_push: int,
        threads: bool | Literal["auto"] = False,
        fresh: bool = True,
        mode: Literal["gradients", "diloco"] = "gradients",
        bounded: bool = False,
        outer_scale: float = 1.0,
        inner: OptimizerState | None = None,
    ) -> None:
        """Train phase `phase` through `servers` from now on (`worker_shards.shard_update`);
        `inner`: DiLoCo's optimizer state to go on from (see `inner_state`)."""
        if self.phase != phase or fresh:
            if fresh:
                self.batches.seek(0, 0)
            self._select_phase(phase)
        self.updater = shard_update(
            self.job,
            self.model,
            self.groups,
            self._served(),
            servers,
            self.stepper,
            partitioned=self.held.partitioned,
            pipeline=self.held.pipeline,
            sync_grads=self._sync_grads,
            diverged=self._diverged,
            replica=self.role.replica,
            worker=self.role.rank
            if self.held.partitioned or self.held.pipeline is not None
            else None,
            n_fetch=n_fetch,
            n_push=n_push,
            threads=threads,
            mode=mode,
            bounded=bounded,
            outer_scale=outer_scale,
            inner=inner,
        )

    def inner_state(self) -> OptimizerState | None:
        """DiLoCo: this replica's own optimizer state, for a replica that (re)starts
        (`attach(inner=...)`); None in gradient mode, where the shards hold it."""
        if isinstance(self.updater, ShardUpdate):
            return self.updater.inner_state()
        return None

    def take_records(self) -> list[dict[str, Any]]:
        """The push records since the last call (none off the parameter server)."""
        if isinstance(self.updater, ShardUpdate):
            return self.updater.take_records(self.step)
        return []

    def flush_pushes(self) -> list[dict[str, Any]]:
        """Push what is left and wait until the shards applied it; the last push records."""
        if isinstance(self.updater, ShardUpdate):
            return self.updater.flush(self.step)
        return []

    def adopt_final(self) -> dict[str, Any]:
        """Adopt the shards' final values and leave them (after every replica flushed);
        return the client's statistics. DiLoCo's optimizer stays, for the last checkpoint."""
        if not isinstance(self.updater, ShardUpdate):
            return {}
        stats = self.updater.detach()
        inner = self.updater.inner
        self.updater = inner if inner is not None else LocalUpdate(None, self.stepper, self.model)
        return stats

    # --- in sync "average" mode ----------------------------------------------------------

    def average_now(self) -> None:
        """Average weights and optimizer state over the group (sync "average" mode)."""
        if self.role.average_every and isinstance(self.updater, LocalUpdate):
            self.updater.average_now()

    # --- checkpoints ---------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The whole replica's weights (assembled over a grid, shards or stages: a
        collective there), its optimizer's state (under Downpour, DiLoCo's inner one only)
        and the RNG, in strategy "single"'s format; the shards' values under Downpour."""
        with self.updater.values():
            tensors, meta = self.held.state(self.optimizer)
        if self.layerwise and not (self.held.pipelined or self.held.sharded):
            meta["stack"] = self.phase
        return tensors, meta

    def restore(self, tensors: dict[str, Tensor], meta: dict[str, Any], source: str) -> None:
        """Continue from a checkpoint of `state()` (made under any strategy and layout that
        trains the same model); `meta["step"]` is where."""
        self.step = int(meta["step"])
        phase_steps = self.role.phase_steps
        self._select_phase(int(meta.get("stack", 0)) if self.layerwise else 0)
        within = self.step - self.phase * phase_steps if phase_steps else self.step
        self.batches.seek(*divmod(within, self.batches.per_epoch))
        self.held.load_state(self.optimizer, tensors, meta, source)
        if self.role.sliced and self.role.slice > 0:  # its own dropout stream
            rank_rng = f"rng.torch.{self.role.rank}"
            if rank_rng in tensors:
                torch.set_rng_state(tensors[rank_rng])
            else:
                torch.manual_seed(derive_seed(self.job.run.seed, self.role.slice, self.step))

    def load_weights(self, tensors: dict[str, Tensor], source: str) -> None:
        """Take the model weights of a checkpoint (a Downpour replica restored from it)."""
        self.held.load_weights(tensors, source)

    def held_bytes(self) -> dict[str, int]:
        """The parameter and optimizer-state bytes this worker holds (its shards under
        FSDP)."""
        return self.held.held_bytes(self.optimizer)

    def rng_state(self) -> Tensor:
        return torch.get_rng_state()

    # --- evaluation ----------------------------------------------------------------------

    def _evaluated_phase(self) -> int:
        phase_steps = self.role.phase_steps
        return max(self.step - 1, 0) // phase_steps if phase_steps else self.phase

    def evaluate(self) -> dict[str, float] | None:
        """Test metrics of the current parameters (the shards' under Downpour; the workers'
        average in sync "average" mode); a sliced worker other than rank 0 answers None."""
        if self.held.pipelined:
            return self._evaluate_pipelined()
        with self.updater.evaluated():
            if self.role.sliced and self.role.rank > 0 and not self.held.sharded:
                return None  # (sharded: every rank's forward gathers the blocks together)
            options = {}
            if self.held.partitioned:
                options["reduce"] = lambda values: parts.reduce_parts(self.model, values)
            with self.stepper.autocast():
                return self.objective.evaluate(
                    self.model,
                    self.test_set,
                    self.cfg.eval_batch_size,
                    self.device,
                    self._evaluated_phase(),
                    **options,
                )

    def _evaluate_pipelined(self) -> dict[str, float] | None:
        """Every stage of the first pipeline relays the test batches' activations on; its
        last one measures the outputs and answers, the others answer None (the other
        pipelines hold the same weights, and wait)."""
        runner = self.network
        assert isinstance(runner, PipelineRunner)
        if self.role.slice > 0:
            return None
        with self.updater.evaluated(), self.stepper.autocast():
            if runner.last:
                return self.objective.evaluate(
                    Relayed(runner), self.test_set, self.cfg.eval_batch_size, self.device
                )
            was_training = self.model.training
            self.model.eval()
            dtype = next(self.model.parameters()).dtype
            loader = make_loader(self.test_set, self.cfg.eval_batch_size, shuffle=False)
            for batch in loader:
                x = torch.as_tensor(batch[0]).to(self.device)
                runner.relay(x.to(dtype) if x.is_floating_point() else x)
            self.model.train(was_training)
        return None
