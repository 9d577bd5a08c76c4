"""Pipeline stages: a model cut into contiguous parts, one stage per worker, applied from
outside the model (the schedules of `torch.distributed.pipelining` run them).

    parts = splittable_parts(model)             # an nn.Sequential's children, or the
    plan = split(model, stages=2)               # names a model lists in `pipeline_split`
    stage = stage_module(model, plan[rank])     # (N, ...) -> (N, ...): this rank's part

A model splits if it is an `nn.Sequential`, or if it names, in `pipeline_split`, the
submodules its forward runs one after another (each taking the previous one's output).
The cut balances the parameters over the stages; a parameter that two stages use (tied
embeddings) is held by both, its gradient summed between them (`tied_parameters`). Why
contiguous parts: each stage then sends one activation to the next, and DistBelief's
messages only cross a partition's edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from scaleout.checkpoint import (
    CheckpointError,
    load_optimizer_state,
    optimizer_state,
    required_optimizer_part,
)

__all__ = [
    "Stage",
    "Tied",
    "load_stage_state",
    "load_stage_weights",
    "merge_stage_states",
    "split",
    "splittable_parts",
    "stage_module",
    "stage_state",
    "tied_parameters",
    "trainable_index",
]


def splittable_parts(model: nn.Module) -> list[str]:
    """The names of the parts a pipeline may cut between, in forward order; ValueError
    naming the forms that split if `model` is neither."""
    if isinstance(model, nn.Sequential):
        return [name for name, _ in model.named_children()]
    names = getattr(model, "pipeline_split", None)
    if names is None:
        raise ValueError(
            f"{type(model).__name__} cannot be cut into pipeline stages: give an nn.Sequential, "
            "or a module whose `pipeline_split` lists the submodules its forward runs in turn"
        )
    names = list(names)
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"{type(model).__name__}.pipeline_split names {name!r}, which is no submodule"
            ) from None
    return names


def split(model: nn.Module, stages: int) -> list[list[str]]:
    """Cut `splittable_parts(model)` into `stages` contiguous runs of at least one part,
    the largest stage's parameter count as small as it can be; ValueError if there are
    fewer parts than stages."""
    parts = splittable_parts(model)
    if stages < 1 or stages > len(parts):
        raise ValueError(
            f"model_parallel.stages = {stages}: {type(model).__name__} has {len(parts)} "
            f"parts to cut between ({', '.join(parts)}); use 1 to {len(parts)} stages"
        )
    sizes = [_size(model.get_submodule(name)) for name in parts]
    cuts = _balanced_cuts(sizes, stages)
    return [parts[a:b] for a, b in zip([0, *cuts], [*cuts, len(parts)], strict=True)]


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _balanced_cuts(sizes: Sequence[int], stages: int) -> list[int]:
    """The `stages - 1` cut points of `sizes` (contiguous, each run non-empty) that make the
    largest run's sum smallest (ties: the earliest cuts); a table over prefixes."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: the smallest largest sum cutting sizes[:i] into k runs; its last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    last = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], last[k][i] = cost, j
    cuts, i = [], n
    for k in range(stages, 0, -1):
        i = last[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]  # the first "cut" is 0


@dataclass(frozen=True)
class Tied:
    """A parameter that several stages hold (tied weights: an embedding and the output
    layer, say): its index among the model's trainable parameters, shape and holders."""

    index: int
    shape: tuple[int, ...]
    stages: tuple[int, ...]


def tied_parameters(model: nn.Module, plan: list[list[str]]) -> list[Tied]:
    """The trainable parameters of `model` that more than one stage of `plan` uses, by
    index. Each holder keeps a copy; their gradients are summed before a step, so the
    copies stay one parameter (as Megatron-LM does for tied embeddings)."""
    holders: dict[int, list[int]] = {}
    for stage, names in enumerate(plan):
        for name in names:
            for param in model.get_submodule(name).parameters():
                held = holders.setdefault(id(param), [])
                if stage not in held:
                    held.append(stage)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        Tied(i, tuple(p.shape), tuple(holders[id(p)]))
        for i, p in enumerate(trainable)
        if len(holders.get(id(p), ())) > 1
    ]


class Stage(nn.Module):
    """The submodules `names` of a model, run one after another: (N, ...) -> (N, ...).
    They are the model's own modules (the same parameters); `full_name` maps this stage's
    parameter and buffer names back to the model's."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.names = list(names)
        self.parts = nn.ModuleList(model.get_submodule(name) for name in self.names)

    def forward(self, x: Tensor) -> Tensor:
        for part in self.parts:
            x = part(x)
        return x

    def full_name(self, name: str) -> str:
        """`parts.<i>.<rest>` -> `<names[i]>.<rest>`."""
        _, index, rest = name.split(".", 2)
        return f"{self.names[int(index)]}.{rest}"


def stage_module(model: nn.Module, names: Sequence[str]) -> Stage:
    """The stage that runs `names` of `model` (see `split`)."""
    return Stage(model, names)


# --- a stage's part of the whole model's checkpoint ------------------------------------------


def trainable_index(model: nn.Module, stage: Stage) -> list[int]:
    """For each trainable parameter of `stage`, in its order, its index among the whole
    `model`'s trainable parameters (the optimizer's indices in a checkpoint)."""
    order = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    return [order[id(p)] for p in stage.parameters() if p.requires_grad]


def stage_state(
    stage: Stage, optimizer: torch.optim.Optimizer | None, index: list[int]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This stage's part of the whole model's state: weights under the model's names, and
    optimizer state under the model's parameter indices (`index`: `trainable_index`;
    none without an optimizer, a Downpour replica's)."""
    tensors = {f"model.{stage.full_name(k)}": v for k, v in stage.state_dict().items()}
    if optimizer is None:
        return tensors, {}
    values, meta = optimizer_state(optimizer)
    for name, value in values.items():
        _, local, key = name.split(".", 2)
        tensors[f"optim.{index[int(local)]}.{key}"] = value
    scalars = {str(index[int(local)]): v for local, v in meta["scalars"].items()}
    groups = [{**g, "params": [index[i] for i in g["params"]]} for g in meta["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def merge_stage_states(
    parts: list[tuple[dict[str, Tensor], dict[str, Any]]],
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The whole model's state from every stage's `stage_state`, in strategy "single"'s
    format (one parameter group per group of the stages, their indices together)."""
    if not parts[0][1]:  # weights only
        return {k: v for part_tensors, _ in parts for k, v in part_tensors.items()}, {}
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    groups = [dict(g, params=[]) for g in parts[0][1]["param_groups"]]
    for part_tensors, part_meta in parts:
        tensors.update(part_tensors)
        scalars.update(part_meta["scalars"])
        for group, part_group in zip(groups, part_meta["param_groups"], strict=True):
            group["params"] += part_group["params"]
    for group in groups:  # (a tied parameter's index comes from each of its holders)
        group["params"] = sorted(set(group["params"]))
    return tensors, {"optimizer": {"param_groups": groups, "scalars": scalars}}


def load_stage_state(
    stage: Stage,
    optimizer: torch.optim.Optimizer,
    index: list[int],
    tensors: dict[str, Tensor],
    meta: dict[str, Any],
    source: str,
) -> None:
    """This stage's part of a whole model's checkpoint (any strategy's), into `stage` and
    its `optimizer`."""
    load_stage_weights(stage, tensors, source)
    values, info = required_optimizer_part(tensors, meta, source)
    local_of = {global_: local for local, global_ in enumerate(index)}
    local_values = {}
    for name, value in values.items():
        _, global_, key = name.split(".", 2)
        if int(global_) in local_of:
            local_values[f"optim.{local_of[int(global_)]}.{key}"] = value
    scalars = {str(local_of[int(g)]): v for g, v in info["scalars"].items() if int(g) in local_of}
    groups = []
    for group in info["param_groups"]:
        mine = [local_of[i] for i in group["params"] if i in local_of]
        groups.append({**group, "params": mine})
    load_optimizer_state(optimizer, local_values, {"param_groups": groups, "scalars": scalars})


def load_stage_weights(stage: Stage, tensors: dict[str, Tensor], source: str) -> None:
    """This stage's weights from a whole model's checkpoint (any strategy's)."""
    try:
        weights = {k: tensors[f"model.{stage.full_name(k)}"] for k in stage.state_dict()}
        stage.load_state_dict(weights)
    except (KeyError, RuntimeError) as err:
        raise CheckpointError(
            f"checkpoint {source} does not fit the configured model: {str(err).splitlines()[0]}"
        ) from None
