"""Greedy layer-wise training of the sparse autoencoder (COTS HPC section 3, Le et al. 2012):
the part that runs where the weights are.

Stack 1 is trained on the data for `train.steps` (or `train.epochs`) minibatches of SGD with
the configured optimizer (the paper: SGD with momentum); then it is frozen and stack 2 is
trained on stack 1's output, and so on. Only the stack being trained has gradients and
optimizer state, so memory holds every stack's weights plus one stack's gradient and
momentum. Each stack's alpha starts at the least-squares scale of its reconstruction on the
stack's first minibatch.

`GreedyTrainer` holds one replica, or one worker's part of a replica partitioned over a grid
(`PartitionedAutoencoder`, strategy "model_parallel"): every worker of a grid runs the same
calls on the same minibatch, and the partitioned network exchanges what it needs inside
them. The driver (`scaleout.optim.greedy_driver`) logs, evaluates and checkpoints the same
way for both. Steps are counted over the whole run (stack k covers steps (k-1)*S+1 .. k*S)
and each stack's data order depends only on (seed, stack, epoch), so a resumed run continues
exactly where it stopped. Checkpoints hold the whole replica in the single-process network's
format (a model-parallel worker's filters and their optimizer state are assembled over the
grid), so a run can resume under either strategy and any grid.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset

from scaleout.build import build_datasets, build_model_for, build_optimizer, resolve_device
from scaleout.checkpoint import load_optimizer_state, optimizer_state
from scaleout.config import RunConfig, SparseAutoencoderModel
from scaleout.data import derive_seed, make_loader, num_batches
from scaleout.errors import ConfigError, UserError
from scaleout.nn.autoencoder import ObjectiveTerms, SparseAutoencoderNetwork
from scaleout.nn.local import LocalGeometry
from scaleout.optim.single import load_model_state, model_state

__all__ = ["GreedyPlan", "GreedyTrainer"]


@dataclass(frozen=True)
class GreedyPlan:
    """What the driver needs to know of a run: its length and the first stack's geometry."""

    batches_per_epoch: int
    steps_per_stack: int
    num_stacks: int
    first_geometry: LocalGeometry

    @property
    def total_steps(self) -> int:
        return self.steps_per_stack * self.num_stacks


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


class GreedyTrainer:
    """One replica (or one grid worker's part of it), its optimizer and its place in the data.

    With `model_parallel`, the calling process is rank `rank` of the default process group
    (or of `group`), whose size is `model_parallel.grid`'s product; every rank must make the
    same calls in the same order.
    """

    def __init__(
        self,
        config: RunConfig,
        model_parallel: bool = False,
        rank: int = 0,
        group: dist.ProcessGroup | None = None,
        replica: tuple[int, int] = (0, 1),
    ) -> None:
        self.config, self.train_cfg = config, config.train
        self.device = resolve_device(config.run.device)
        if config.run.num_threads:
            torch.set_num_threads(config.run.num_threads)
        torch.manual_seed(config.run.seed)
        self.train_set, self.test_set = build_datasets(config)
        _check_data_shape(config, self.train_set)
        self.rank, (replica_id, num_replicas) = rank, replica
        if num_replicas > 1:  # Downpour: each replica owns a disjoint part of the data
            from scaleout.optim.replica import data_part

            self.train_set = data_part(self.train_set, replica_id, num_replicas)
        # initialised globally with the seed, then partitioned: the same start on any grid
        network = build_model_for(config, self.train_set).to(self.device)
        assert isinstance(network, SparseAutoencoderNetwork)
        self.first_geometry = network.stacks[0].geometry
        self.partitioned = None
        self.network: nn.Module = network
        if model_parallel:
            from scaleout.parallel.model_parallel import PartitionedAutoencoder

            codec = None
            if config.compress.codec != "fp32":
                from scaleout.compress import from_config

                codec = from_config(config.compress)
            options = config.model_parallel
            self.partitioned = PartitionedAutoencoder(
                network, tuple(options.grid), rank, group, options.transport, codec
            ).to(self.device)
            self.network = self.partitioned  # the global network is dropped here
        self.group = group
        size = len(self.train_set)  # type: ignore[arg-type]
        self.drop_last = size >= self.train_cfg.batch_size
        batches_per_epoch = num_batches(size, self.train_cfg.batch_size, self.drop_last)
        self.plan = GreedyPlan(
            batches_per_epoch=batches_per_epoch,
            steps_per_stack=self.train_cfg.steps or self.train_cfg.epochs * batches_per_epoch,
            num_stacks=network.num_stacks,
            first_geometry=self.first_geometry,
        )
        self.pin_memory = (
            self.device.type == "cuda"
            if config.loader.pin_memory == "auto"
            else config.loader.pin_memory
        )
        self.step = 0
        self.optimizer_stack = 0
        self.optimizer = self._optimizer_for(0)
        self._batches: Any = None
        self.link: Any = None  # a ShardLink while Downpour trains a stack (`attach`)

    def get_plan(self) -> GreedyPlan:
        return self.plan

    def _optimizer_for(self, stack: int) -> torch.optim.Optimizer:
        self.network.train_only(stack)  # type: ignore[operator]
        groups = self.network.stack_parameter_groups(stack, self.train_cfg.lr)  # type: ignore[operator]
        return build_optimizer(groups, self.train_cfg)

    def _sum_over_replica(self, values: Tensor) -> Tensor:
        """A model-parallel worker's parts summed over the grid; the values themselves else."""
        if self.partitioned is not None and dist.is_initialized():
            dist.all_reduce(values, group=self.group)
        return values

    # --- training ----------------------------------------------------------------------------

    def _next_batch(self) -> Tensor:
        """The step's minibatch (N, C, H, W): the same on every worker of a grid."""
        plan = self.plan
        stack = self.step // plan.steps_per_stack
        epoch, batch = divmod(self.step - stack * plan.steps_per_stack, plan.batches_per_epoch)
        if batch == 0 or self._batches is None:
            loader = make_loader(
                self.train_set,
                self.train_cfg.batch_size,
                shuffle=True,
                seed=derive_seed(self.config.run.seed, stack),
                epoch=epoch,
                start_batch=batch,
                workers=self.config.loader.workers,
                pin_memory=self.pin_memory,
                drop_last=self.drop_last,
            )
            self._batches = iter(loader)
        (x,) = next(self._batches)
        return x.to(self.device, non_blocking=True)

    def train_chunk(self, num_steps: int) -> dict[str, Any]:
        """Train `num_steps` steps, all within one stack; return the replica's summed terms
        (reconstruction, sparsity: per-example values times examples), the examples, and the
        stack's alpha and learning rate afterwards."""
        plan = self.plan
        stack = self.step // plan.steps_per_stack
        assert (self.step + num_steps - 1) // plan.steps_per_stack == stack, (
            "a chunk crossed a stack"
        )
        if stack != self.optimizer_stack:
            self.optimizer, self.optimizer_stack = self._optimizer_for(stack), stack
            self._batches = None
        network: Any = self.network
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        examples = 0
        started = time.perf_counter()
        for _ in range(num_steps):
            x = self._next_batch()
            if self.step % plan.steps_per_stack == 0:  # a stack's first minibatch: alpha there
                network.fit_alpha_(x, stack)
            if self.link is not None:
                self.link.before_step()  # a fetch from the shards overrides the alpha fit
            terms: ObjectiveTerms = network.stack_objective(x, stack)
            self.optimizer.zero_grad(set_to_none=True)
            terms.total.backward()
            if self.partitioned is not None:
                self.partitioned.sync_grads()
            if self.link is not None:
                self.link.after_backward()  # the shards apply the update
            else:
                self.optimizer.step()
            self.step += 1
            examples += len(x)
            sums += torch.stack([terms.reconstruction, terms.sparsity]).detach() * len(x)
        reconstruction, sparsity = self._sum_over_replica(sums).tolist()
        if not math.isfinite(reconstruction + sparsity):
            raise UserError(
                f"training diverged: the objective is {(reconstruction + sparsity) / examples} "
                f"at step {self.step} (stack {stack + 1}); lower train.lr"
            )
        return {
            "reconstruction": reconstruction,
            "sparsity": sparsity,
            "examples": examples,
            "epoch": (self.step - 1 - stack * plan.steps_per_stack) // plan.batches_per_epoch,
            "alpha": network.stacks[stack].alpha.item(),
            "lr": self.optimizer.param_groups[0]["lr"],
            "seconds": time.perf_counter() - started,
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Per-example reconstruction and sparsity of the current stack on the test set
        (with Downpour: of the shards' current parameters)."""
        if self.link is not None:
            self.link.pull()
        stack = max(self.step - 1, 0) // self.plan.steps_per_stack  # the last trained step's
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        batch_size = self.train_cfg.eval_batch_size
        for (x,) in make_loader(self.test_set, batch_size, shuffle=False):
            terms = self.network.stack_objective(x.to(self.device), stack)  # type: ignore[operator]
            sums += torch.stack([terms.reconstruction, terms.sparsity]).double() * len(x)
        reconstruction, sparsity = (self._sum_over_replica(sums) / len(self.test_set)).tolist()  # type: ignore[arg-type]
        return {
            "test_loss": reconstruction + sparsity,
            "test_reconstruction": reconstruction,
            "test_sparsity": sparsity,
        }

    # --- checkpoints ---------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The whole replica's weights, the optimizer's state and the RNG, in strategy
        "single"'s format (`model_state`): a grid assembles its parts on every worker.
        With Downpour, the parameters are the shards' (their optimizer state stays there)."""
        if self.link is not None:
            self.link.pull()
        if self.partitioned is None:
            tensors, meta = model_state(self.network, self.optimizer)
        else:
            part, stack = self.partitioned, self.optimizer_stack
            tensors = {f"model.{k}": v for k, v in part.global_state_dict().items()}
            optim_tensors, optim_meta = optimizer_state(self.optimizer)
            local_shape = part.stacks[stack].weight.shape
            for name, value in optim_tensors.items():  # param 0 is the filters, 1 is alpha
                if name.startswith("optim.0.") and value.shape == local_shape:
                    value = part.gather_filters(stack, value)
                tensors[name] = value
            tensors["rng.torch"] = torch.get_rng_state()
            meta = {"optimizer": optim_meta}
        meta["stack"] = self.optimizer_stack
        return {k: v.detach().cpu() for k, v in tensors.items()}, meta

    def restore(self, tensors: dict[str, Tensor], meta: dict[str, Any], source: str) -> None:
        """Continue from `state()`'s output (made under either strategy and any grid)."""
        self.optimizer_stack = meta["stack"]
        self.optimizer = self._optimizer_for(self.optimizer_stack)
        self.step = meta["step"]
        self._batches = None
        if self.partitioned is None:
            load_model_state(self.network, self.optimizer, tensors, meta, source)
            return
        part, stack = self.partitioned, self.optimizer_stack
        weights = {
            k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")
        }
        part.load_global_state_dict({k: v.to(self.device) for k, v in weights.items()})
        global_shape = part.stacks[stack].global_weight_shape
        optim_tensors = {}
        for name, value in tensors.items():
            if name.startswith("optim."):
                if name.startswith("optim.0.") and tuple(value.shape) == global_shape:
                    value = part.local_filters(stack, value)
                optim_tensors[name] = value.to(self.device)
        load_optimizer_state(self.optimizer, optim_tensors, meta["optimizer"])
        torch.set_rng_state(tensors["rng.torch"])

    # --- Downpour: the stack in training lives on parameter-server shards ----------------------

    def _stack_params(self, stack: int) -> tuple[Tensor, Tensor | None]:
        """What this worker keeps on shards: the stack's filters (its part of them), and
        alpha on rank 0 (the grid's other workers get it broadcast)."""
        if self.partitioned is not None:
            part = self.partitioned.stacks[stack]
            return part.weight, part.alpha if self.rank == 0 else None
        network: Any = self.network
        return network.stacks[stack].filter.weight, network.stacks[stack].alpha

    @torch.no_grad()
    def begin_stack(self, stack: int) -> tuple[Tensor, Tensor | None]:
        """At the stack's start, fit its alpha on the first minibatch; return the values its
        shards start from: the filters (P_w,) and alpha (1,) or None (called on one
        replica)."""
        if self.step == stack * self.plan.steps_per_stack:  # not when resuming mid-stack
            self._batches = None
            self.network.fit_alpha_(self._next_batch(), stack)  # type: ignore[operator]
            self._batches = None  # training starts from the same first minibatch
        weight, alpha = self._stack_params(stack)
        flat_alpha = None if alpha is None else alpha.detach().reshape(1).cpu()
        return weight.detach().reshape(-1).cpu(), flat_alpha

    def attach(self, stack: int, servers: tuple[Any, Any], n_fetch: int, n_push: int) -> None:
        """Train stack `stack` through `servers` (this worker's shards: its filters', and
        alpha's or None) from now on."""
        from scaleout.parallel.model_parallel.shards import ShardLink

        if stack != self.optimizer_stack:
            self.optimizer, self.optimizer_stack = self._optimizer_for(stack), stack
        weight, alpha = self._stack_params(stack)
        lanes = [([weight], servers[0])]
        if alpha is not None:
            lanes.append(([alpha], servers[1]))
        after_pull = None
        if self.partitioned is not None and dist.is_initialized():
            shared_alpha = self.partitioned.stacks[stack].alpha

            def after_pull() -> None:
                dist.broadcast(shared_alpha.data, src=0, group=self.group)

        self.link = ShardLink(lanes, n_fetch, n_push, after_pull)

    def finish_stack(self) -> dict[str, Any]:
        """Flush the last gradients, adopt the final values; return the link's statistics."""
        if self.link is None:
            return {}
        self.link.flush()
        stats = {**self.link.stats, "staleness": self.link.staleness}
        self.link = None
        return stats
