"""The model as one worker holds it, and its checkpoints in strategy "single"'s format.

A worker holds the whole model, its part of a model-parallel grid, its FSDP or
tensor-parallel shards, or one pipeline stage. `HeldModel.state` gives the whole replica's
weights (assembled over the grid, shards or stages: a collective there), the optimizer's
state and the RNG; `load_state` takes such a checkpoint, made under any strategy and layout
that trains the same model, and `load_weights` its weights alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaleout.checkpoint import load_optimizer_state, on_cpu_shared_once
from scaleout.errors import UserError
from scaleout.parallel import fsdp, parts, stages
from scaleout.train.state import load_model_state, load_model_weights, model_state

if TYPE_CHECKING:
    from scaleout.strategies.role import Role

Tensors = dict[str, Tensor]


@dataclass
class HeldModel:
    """The model (or this worker's part of it) and how it is laid out over the workers."""

    model: nn.Module
    role: Role
    device: torch.device
    stage_index: list[int] = field(default_factory=list)  # a stage's parameters, model order
    aliases: dict[str, str] = field(default_factory=dict)  # a pipeline's tied names
    sharded: bool = False  # FSDP or tensor parallel applied (at start): state is a collective
    pipeline: dist.ProcessGroup | None = None  # a pipeline's stages (at start)

    @property
    def partitioned(self) -> bool:
        """Part of a model-parallel grid: every worker runs the same steps."""
        return self.role.grid is not None

    @property
    def pipelined(self) -> bool:
        """One stage of a pipeline: state and evaluation are collectives over its stages."""
        return self.role.stages > 1

    def state(self, optimizer: torch.optim.Optimizer | None) -> tuple[Tensors, dict[str, Any]]:
        """The whole replica's weights, `optimizer`'s state and the RNG, in strategy
        "single"'s format (on the first worker of a pipeline or of FSDP's group; the
        others get empty dicts)."""
        if self.pipelined:  # a collective: rank 0 gathers every stage's part
            return self._gathered_stages(optimizer)
        if self.sharded:  # a collective: rank 0 gets the whole state, the others nothing
            tensors, meta = fsdp.full_state(self.model, optimizer)
            tensors["rng.torch"] = torch.get_rng_state()
            return on_cpu_shared_once(tensors), meta
        tensors, meta = model_state(self.model, optimizer)
        if self.partitioned:
            tensors = self._gathered(tensors, optimizer)
        return on_cpu_shared_once(tensors), meta

    def _gathered_stages(
        self, optimizer: torch.optim.Optimizer | None
    ) -> tuple[Tensors, dict[str, Any]]:
        """The whole model's state, assembled on the pipeline's first stage from every
        stage's part (the other stages get empty dicts); pipeline k's stage s is rank
        k * stages + s, so the first pipeline's RNG states are the ranks' own."""
        assert isinstance(self.model, stages.Stage)
        tensors, meta = stages.stage_state(self.model, optimizer, self.stage_index)
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

    def _gathered(self, tensors: Tensors, optimizer: torch.optim.Optimizer | None) -> Tensors:
        """A grid worker's state as the whole replica's: its filters (and their optimizer
        state) gathered, in the single-process network's names."""
        model = self.model
        gathered = {f"model.{k}": v for k, v in parts.global_state_dict(model).items()}
        params = _params(optimizer) if optimizer is not None else []
        for name, value in tensors.items():
            if name.startswith("optim."):
                _, index, _ = name.split(".", 2)
                value = parts.gather_parameter(model, params[int(index)], value)
            if not name.startswith("model."):
                gathered[name] = value
        return gathered

    def held_bytes(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """The parameter and optimizer-state bytes this worker holds (its shards under
        FSDP)."""
        return fsdp.held_bytes(self.model, optimizer)

    def load_state(
        self,
        optimizer: torch.optim.Optimizer | None,
        tensors: Tensors,
        meta: dict[str, Any],
        source: str,
    ) -> None:
        """Take a checkpoint of `state` (made under any strategy and layout that trains the
        same model) into the model, `optimizer` and the RNG."""
        if self.pipelined:
            assert isinstance(self.model, stages.Stage) and optimizer is not None
            stages.load_stage_state(self.model, optimizer, self.stage_index, tensors, meta, source)
            torch.set_rng_state(tensors.get(f"rng.torch.{self.role.rank}", tensors["rng.torch"]))
        elif self.sharded:
            fsdp.load_full_state(self.model, optimizer, tensors, meta, source)
            torch.set_rng_state(tensors["rng.torch"])
        elif not self.partitioned:
            load_model_state(self.model, optimizer, tensors, meta, source)
        else:
            self._load_parts(optimizer, tensors, meta, source)

    def _load_parts(
        self,
        optimizer: torch.optim.Optimizer | None,
        tensors: Tensors,
        meta: dict[str, Any],
        source: str,
    ) -> None:
        model = self.model
        weights = {
            k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")
        }
        try:
            parts.load_global_state_dict(model, {k: v.to(self.device) for k, v in weights.items()})
        except ValueError as err:
            raise UserError(f"checkpoint {source} does not fit the model: {err}") from None
        if optimizer is not None:
            params = _params(optimizer)
            local = {}
            for name, value in tensors.items():
                if name.startswith("optim."):
                    _, index, _ = name.split(".", 2)
                    value = parts.scatter_parameter(model, params[int(index)], value)
                    local[name] = value.to(self.device)
            load_optimizer_state(optimizer, local, meta["optimizer"])
        torch.set_rng_state(tensors["rng.torch"])

    def load_weights(self, tensors: Tensors, source: str) -> None:
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


def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]
