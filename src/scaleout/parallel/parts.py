"""What a worker of a model-parallel grid does with its part of a model, beside running it:
sum the parts of a value over the grid, complete the gradients of replicated parameters,
broadcast them, and assemble or split whole-replica tensors (checkpoints).

Every function takes the module `parallelize` returned; strategies use only these, so how a
model is partitioned stays inside `scaleout.parallel`. The grid and its process group are
found through the swapped layers. A parameter is either a slice (the weight or bias of a
`PartitionedLocallyConnected2d`: a worker's backward gives its whole gradient) or replicated
(every other parameter, e.g. a stack's alpha: a worker's backward gives its part of the
gradient, and `sync_grads` sums the parts).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaleout.parallel.spatial import PARTITIONED_LAYERS, PartitionedLocallyConnected2d, Placement

__all__ = [
    "broadcast_replicated",
    "gather_parameter",
    "global_state_dict",
    "is_replicated",
    "load_global_state_dict",
    "reduce_parts",
    "scatter_parameter",
    "sync_grads",
]

Slice = tuple[PartitionedLocallyConnected2d, str]  # the layer holding it, the parameter's name


def _placement(module: nn.Module) -> Placement:
    for m in module.modules():
        if isinstance(m, PARTITIONED_LAYERS):
            return m.placement
    raise ValueError(
        f"this {type(module).__name__} is not a worker's part of a model: "
        "partition it with scaleout.parallel.parallelize"
    )


def _slices_by_name(module: nn.Module) -> dict[str, Slice]:
    """{state-dict name: (layer, parameter name)} of every sliced parameter."""
    slices = {}
    for prefix, m in module.named_modules():
        if isinstance(m, PartitionedLocallyConnected2d):
            for name, _ in m.named_parameters(recurse=False):
                slices[f"{prefix}.{name}" if prefix else name] = (m, name)
    return slices


def _slice_of(module: nn.Module, param: Tensor) -> Slice | None:
    for m in module.modules():
        if isinstance(m, PartitionedLocallyConnected2d):
            for name, p in m.named_parameters(recurse=False):
                if p is param:
                    return m, name
    return None


def reduce_parts(module: nn.Module, values: Tensor) -> Tensor:
    """Sum every worker's part of `values` (of the objective, its terms) over the grid, in
    place; returns `values`."""
    return _placement(module).reduce(values)


def sync_grads(module: nn.Module) -> None:
    """Sum the replicated parameters' gradients over the grid (each worker's backward gave
    its part); a worker's own slices have their whole gradient already. Only trainable
    parameters with a gradient take part: the same ones on every worker."""
    placement = _placement(module)
    if not placement.collective:
        return
    sliced = {id(getattr(layer, name)) for layer, name in _slices_by_name(module).values()}
    params = [
        p
        for p in module.parameters()
        if p.requires_grad and p.grad is not None and id(p) not in sliced
    ]
    by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p)  # type: ignore[union-attr]
    for group in by_kind.values():  # one all-reduce per dtype and device
        flat = torch.cat([p.grad.reshape(-1) for p in group])  # type: ignore[union-attr]
        dist.all_reduce(flat, group=placement.group)
        for p, grad in zip(group, flat.split([p.numel() for p in group]), strict=True):
            p.grad.copy_(grad.view_as(p.grad))  # type: ignore[union-attr]


def is_replicated(module: nn.Module, param: nn.Parameter) -> bool:
    """Whether every worker holds all of `param` rather than its part."""
    return any(p is param for p in module.parameters()) and _slice_of(module, param) is None


def broadcast_replicated(module: nn.Module, params: Iterable[nn.Parameter]) -> None:
    """Give every worker rank 0's values of replicated `params`."""
    placement = _placement(module)
    if not placement.collective:
        return
    group = placement.group
    source = 0 if group is None else dist.get_global_rank(group, 0)
    for p in params:
        dist.broadcast(p.data, src=source, group=group)


def gather_parameter(module: nn.Module, param: nn.Parameter, value: Tensor) -> Tensor:
    """`value` shaped like this worker's part of `param` (the parameter, or its optimizer
    state) as the whole replica's tensor, on every worker (a collective)."""
    found = _slice_of(module, param)
    if found is None or tuple(value.shape) != tuple(param.shape):
        return value
    layer, name = found
    return layer.assemble(name, value)


def scatter_parameter(module: nn.Module, param: nn.Parameter, value: Tensor) -> Tensor:
    """This worker's part of the whole replica's `value` for `param`."""
    found = _slice_of(module, param)
    if found is None:
        return value
    layer, name = found
    if tuple(value.shape) != layer.global_shape(name):
        return value
    return layer.slice_of(name, value)


@torch.no_grad()
def global_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The whole replica's parameters under the unpartitioned module's names (a collective):
    for checkpoints in the single-process format, filter images, a Downpour push."""
    slices = _slices_by_name(module)
    state = {}
    for name, value in module.state_dict().items():  # the same order on every worker
        if name in slices:
            layer, attr = slices[name]
            state[name] = layer.assemble(attr, value)
        else:
            state[name] = value.detach().clone()
    return state


@torch.no_grad()
def load_global_state_dict(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Take this worker's parts of a whole replica's state dict (a resume); ValueError, with
    nothing changed, when it is not the state of the same model."""
    slices = _slices_by_name(module)
    own = module.state_dict()
    for name, value in own.items():
        if name not in state:
            raise ValueError(f"{name} is missing: load a checkpoint of the same model")
        expected = slices[name][0].global_shape(slices[name][1]) if name in slices else value.shape
        if tuple(state[name].shape) != tuple(expected):
            raise ValueError(
                f"{name} has shape {tuple(state[name].shape)}, this network needs "
                f"{tuple(expected)}: load a checkpoint of the same model"
            )
    for name, value in own.items():
        whole = state[name].to(value.device, value.dtype)
        value.copy_(slices[name][0].slice_of(slices[name][1], whole) if name in slices else whole)
