"""Sharded data parallelism: PyTorch's FSDP2 (`fully_shard`) applied to any module from
outside, and its state in the library's single-file checkpoint format.

    blocks = shard(model, ["GPT2Block"])      # each block, then the root; None: each child
                                              # (comms=fsdp_comms("dynamic8"): 8-bit payloads)
    optimizer = AdamW(model.parameters())     # over the sharded parameters: 1/N of the state
    tensors, meta = full_state(model, optimizer)          # a collective; rank 0 gets it all
    load_full_state(model, optimizer, tensors, meta, src)  # every rank, from the whole state

Each rank holds 1/N of every parameter, gradient and optimizer value; a block's parameters
are gathered for its forward and backward and freed after, and gradients are averaged by a
reduce-scatter. Checkpoints are gathered whole, so a run resumes under any mode and worker
count. Why from outside: the model code stays architecture only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor

from scaleout.checkpoint import CheckpointError, required_optimizer_part

__all__ = [
    "FSDPModule",
    "blocks_of",
    "exchange_numels",
    "full_state",
    "held_bytes",
    "load_full_state",
    "shard",
]


def blocks_of(model: nn.Module, names: list[str] | None) -> list[str]:
    """The qualified names of the modules to shard one by one: those whose class is one of
    `names`, or (None) each direct child that holds parameters (a ModuleList's children in
    its place); a child that shares a parameter with another (tied embeddings) is left to
    the root."""
    if names is not None:
        found = [
            qualified
            for qualified, module in model.named_modules()
            if qualified and type(module).__name__ in names
        ]
        classes = {type(model.get_submodule(q)).__name__ for q in found}
        missing = [n for n in names if n not in classes]
        if missing:
            present = sorted({type(m).__name__ for _, m in model.named_modules()})
            raise ValueError(
                f"sync.fsdp_blocks names {missing}, which match no module of the model; its "
                f"module classes are {present}"
            )
        return [q for q in found if not any(q.startswith(f"{o}.") for o in found)]
    children = _children(model, "")
    owners: dict[int, set[str]] = {}
    for child, module in children:
        for param in module.parameters():
            owners.setdefault(id(param), set()).add(child)
    shared = {c for names_ in owners.values() if len(names_) > 1 for c in names_}
    return [
        child
        for child, module in children
        if child not in shared and any(True for _ in module.parameters())
    ]


def _children(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """`module`'s direct children by qualified name, a container's (ModuleList,
    ModuleDict: no forward of their own) replaced by its children."""
    found = []
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            found += _children(child, f"{qualified}.")
        else:
            found.append((qualified, child))
    return found


def shard(
    model: nn.Module, names: list[str] | None, comms: tuple[AllGather, ReduceScatter] | None = None
) -> list[str]:
    """Apply `fully_shard` to each of `blocks_of(model, names)`, then to the root (which
    keeps what no block holds); return the blocks' names. The model is changed in place:
    its parameters become DTensors, so build the optimizer after this. `comms`: the
    all-gather and reduce-scatter every sharded module runs (`scaleout.compress.fsdp_comms`
    sends compressed payloads); None: torch's."""
    blocks = blocks_of(model, names)
    for name in blocks:
        fully_shard(model.get_submodule(name))
    fully_shard(model)
    if comms is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(comms[0])
                module.set_custom_reduce_scatter(comms[1])
    return blocks


def exchange_numels(model: nn.Module, names: list[str] | None, world: int) -> list[tuple[str, int]]:
    """What `shard(model, names)` over `world` ranks exchanges, per unit in forward order
    (each block, then the root "" with what no block holds): the values a rank sends in the
    unit's all-gather, and keeps from its reduce-scatter. FSDP2 cuts every parameter's dim
    0 into `world` chunks of ceil(dim0 / world) rows, padding the last ones. Model-free of
    processes: the simulator prices a step from it."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    blocks = blocks_of(model, names)
    seen: set[int] = set()
    units = []
    for name in [*blocks, ""]:
        numel = 0
        for param in model.get_submodule(name).parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            rows = param.shape[0] if param.dim() else 1
            numel += -(-rows // world) * (param.numel() // max(rows, 1))
        units.append((name, numel))
    return units


def _options(**kwargs: bool) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, **kwargs)


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The qualified name of each of the optimizer's parameters, in its order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The whole model's weights (`model.<name>`, every alias of a tied parameter too) and
    the optimizer's state (`optim.<index>.<key>`, as `optimizer_state` writes it), gathered
    on rank 0 (on the CPU); other ranks get empty dicts. A collective: every rank calls it."""
    weights = get_model_state_dict(model, options=_options(cpu_offload=True))
    if not weights:
        if optimizer is not None:
            get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
        return {}, {}
    tensors = {f"model.{k}": v for k, v in weights.items()}
    for name, param in model.named_parameters(remove_duplicate=False):
        if f"model.{name}" not in tensors:  # a tied parameter's other name
            first = next(n for n, p in model.named_parameters() if p is param)
            tensors[f"model.{name}"] = tensors[f"model.{first}"]
    meta: dict[str, Any] = {}
    if optimizer is not None:
        gathered = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
        local = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for index, name in enumerate(_names(model, optimizer)):
            for key, value in gathered["state"].get(name, {}).items():
                if isinstance(value, Tensor):
                    tensors[f"optim.{index}.{key}"] = value
                else:
                    scalars.setdefault(str(index), {})[key] = value
        meta["optimizer"] = {"param_groups": local["param_groups"], "scalars": scalars}
    return tensors, meta


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    tensors: dict[str, Tensor],
    meta: dict[str, Any],
    source: str,
) -> None:
    """Inverse of `full_state`, on every rank from the whole state: each keeps its shard."""
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    kept = {name for name, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    try:
        kept_weights = {k: v for k, v in weights.items() if k in kept}
        set_model_state_dict(model, kept_weights, options=_options())
    except (RuntimeError, KeyError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {source} does not fit the configured model: {str(err).splitlines()[0]}"
        ) from None
    if optimizer is None:
        return
    values, info = required_optimizer_part(tensors, meta, source)
    names = _names(model, optimizer)
    saved = info["param_groups"]
    counts = [len(g["params"]) for g in saved], [len(g["params"]) for g in optimizer.param_groups]
    if counts[0] != counts[1]:
        raise CheckpointError(
            f"checkpoint {source}'s optimizer holds {counts[0]} parameters per group, this "
            f"one {counts[1]}: resume with the model and optimizer that wrote it"
        )
    state: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        _, index, field = key.split(".", 2)
        state.setdefault(names[int(index)], {})[field] = value
    for index, fields in info["scalars"].items():
        state.setdefault(names[int(index)], {}).update(fields)
    current: list[dict[str, Any]] = []  # the groups as they are: settings are loaded below
    start = 0
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        current.append({**settings, "params": names[start : start + len(group["params"])]})
        start += len(group["params"])
    try:
        set_optimizer_state_dict(
            model, optimizer, {"state": state, "param_groups": current}, options=_options()
        )
    except (RuntimeError, KeyError, ValueError, IndexError) as err:
        raise CheckpointError(
            f"checkpoint {source}'s optimizer state does not fit this optimizer: {err}"
        ) from None
    for group, settings in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in settings.items() if k != "params"})


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """The parameter and optimizer-state bytes this rank holds (its shards under FSDP)."""

    def local(tensor: Tensor) -> Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    seen: set[int] = set()
    params = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            params += local(param).nbytes
    state = 0
    if optimizer is not None:
        for values in optimizer.state.values():
            state += sum(local(v).nbytes for v in values.values() if isinstance(v, Tensor))
    return {"parameter_bytes": params, "optimizer_bytes": state}
