"""A worker's checkpoint: the whole replica in strategy "single"'s format.

`state()` gives the model's weights (a grid worker assembles the whole replica's from its
part, a collective), the optimizer's state (under Downpour only DiLoCo's replicas have one)
and the RNG; `restore()` takes such a checkpoint, made under any strategy and grid that trains the
same model, and puts the worker where it stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaleout.checkpoint import load_optimizer_state, on_cpu_shared_once
from scaleout.data import derive_seed
from scaleout.errors import UserError
from scaleout.parallel import fsdp, parts, stages
from scaleout.train.state import load_model_state, load_model_weights, model_state

if TYPE_CHECKING:
    from scaleout.strategies.role import Role
    from scaleout.strategies.updaters import Updater
    from scaleout.train.job import Job


class WorkerState:
    """Checkpoints of a `Worker` (a mixin: it reads the worker's model, optimizer, phase)."""

    job: Job
    role: Role
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    partitioned: bool
    sharded: bool
    pipelined: bool
    pipeline: dist.ProcessGroup | None
    stage_index: list[int]
    aliases: dict[str, str]  # a pipeline's tied names: {alias: name kept} in the whole model
    layerwise: bool
    phase: int
    step: int
    epoch: int
    batch: int
    batches_per_epoch: int
    device: torch.device
    _batches: Any

    if TYPE_CHECKING:  # defined by Worker and its other part

        def _select_phase(self, phase: int) -> None: ...

        @property
        def updater(self) -> Updater: ...

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The whole replica's weights (assembled over a grid), its optimizer's state (under
        Downpour, DiLoCo's inner one only) and the RNG, in strategy "single"'s format."""
        if self.pipelined:  # a collective: rank 0 gathers every stage's part
            with self.updater.values():
                return self._gathered_stages()
        if self.sharded:  # a collective: rank 0 gets the whole state, the others nothing
            tensors, meta = fsdp.full_state(self.model, self.optimizer)
            tensors["rng.torch"] = torch.get_rng_state()
            return on_cpu_shared_once(tensors), meta
        with self.updater.values():
            tensors, meta = model_state(self.model, self.optimizer)
            if self.partitioned:
                tensors = self._gathered(tensors)
        if self.layerwise:
            meta["stack"] = self.phase
        return on_cpu_shared_once(tensors), meta

    def _gathered_stages(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The whole model's state, assembled on the pipeline's first stage from every
        stage's part (the other stages get empty dicts); pipeline k's stage s is rank
        k * stages + s, so the first pipeline's RNG states are the ranks' own."""
        assert isinstance(self.model, stages.Stage)
        tensors, meta = stages.stage_state(self.model, self.optimizer, self.stage_index)
        mine = (on_cpu_shared_once(tensors), meta, torch.get_rng_state())
        first = self.role.stage == 0
        parts: list[Any] | None = [None] * self.role.stages if first else None
        dist.gather_object(mine, parts, group=self.pipeline, group_dst=0)
        if parts is None:
            return {}, {}
        whole, whole_meta = stages.merge_stage_states([(t, m) for t, m, _ in parts])
        for alias, name in self.aliases.items():  # tied copies: saved once, as one model's
            whole[f"model.{alias}"] = whole[f"model.{name}"]
        whole["rng.torch"] = parts[0][2]  # each stage's own dropout stream: rank r's as
        for rank, (_, _, rng) in enumerate(parts[1:], start=1):  # rng.torch.<r>
            whole[f"rng.torch.{rank}"] = rng
        return whole, whole_meta

    def _gathered(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """A grid worker's state as the whole replica's: its filters (and their optimizer
        state) gathered, in the single-process network's names."""
        model = self.model
        gathered = {f"model.{k}": v for k, v in parts.global_state_dict(model).items()}
        params = self._optimizer_params() if self.optimizer is not None else []
        for name, value in tensors.items():
            if name.startswith("optim."):
                _, index, _ = name.split(".", 2)
                value = parts.gather_parameter(model, params[int(index)], value)
            if not name.startswith("model."):
                gathered[name] = value
        return gathered

    def _optimizer_params(self) -> list[nn.Parameter]:
        assert self.optimizer is not None
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def held_bytes(self) -> dict[str, int]:
        """The parameter and optimizer-state bytes this worker holds (its shards under
        FSDP)."""
        return fsdp.held_bytes(self.model, self.optimizer)

    def rng_state(self) -> Tensor:
        return torch.get_rng_state()

    def restore(self, tensors: dict[str, Tensor], meta: dict[str, Any], source: str) -> None:
        """Continue from a checkpoint of `state()` (made under any strategy and grid that
        trains the same model); `meta["step"]` is where."""
        self.step = int(meta["step"])
        phase_steps = self.role.phase_steps
        self._select_phase(int(meta.get("stack", 0)) if self.layerwise else 0)
        within = self.step - self.phase * phase_steps if phase_steps else self.step
        self.epoch, self.batch = divmod(within, self.batches_per_epoch)
        self._batches = None
        rank_rng = f"rng.torch.{self.role.rank}"
        if self.pipelined:
            assert isinstance(self.model, stages.Stage) and self.optimizer is not None
            stages.load_stage_state(
                self.model, self.optimizer, self.stage_index, tensors, meta, source
            )
            torch.set_rng_state(tensors.get(rank_rng, tensors["rng.torch"]))
        elif self.sharded:
            fsdp.load_full_state(self.model, self.optimizer, tensors, meta, source)
            torch.set_rng_state(tensors["rng.torch"])
        elif not self.partitioned:
            load_model_state(self.model, self.optimizer, tensors, meta, source)
        else:
            self._restore_parts(tensors, meta, source)
        if self.role.sliced and self.role.slice > 0:
            if rank_rng in tensors:
                torch.set_rng_state(tensors[rank_rng])
            else:
                torch.manual_seed(derive_seed(self.job.run.seed, self.role.slice, self.step))

    def _restore_parts(self, tensors: dict[str, Tensor], meta: dict[str, Any], source: str) -> None:
        model = self.model
        weights = {
            k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")
        }
        try:
            parts.load_global_state_dict(model, {k: v.to(self.device) for k, v in weights.items()})
        except ValueError as err:
            raise UserError(f"checkpoint {source} does not fit the model: {err}") from None
        if self.optimizer is not None:
            params = self._optimizer_params()
            local = {}
            for name, value in tensors.items():
                if name.startswith("optim."):
                    _, index, _ = name.split(".", 2)
                    value = parts.scatter_parameter(model, params[int(index)], value)
                    local[name] = value.to(self.device)
            load_optimizer_state(self.optimizer, local, meta["optimizer"])
        torch.set_rng_state(tensors["rng.torch"])

    def load_weights(self, tensors: dict[str, Tensor], source: str) -> None:
        """Take the model weights of a checkpoint (a Downpour replica restored from it)."""
        if self.pipelined:
            assert isinstance(self.model, stages.Stage)
            stages.load_stage_weights(self.model, tensors, source)
        elif self.partitioned:
            weights = {
                k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")
            }
            parts.load_global_state_dict(self.model, weights)
        else:
            load_model_weights(self.model, tensors, source)
