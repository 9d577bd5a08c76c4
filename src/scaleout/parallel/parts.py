"""What a worker of a model-parallel grid does with its part of a model, beside running it:
sum the parts of a value over the grid, complete the gradients of replicated parameters,
broadcast them, and assemble or split whole-replica tensors (checkpoints).

Every function takes the module `parallelize` returned; strategies use only these, so how a
model is partitioned stays inside `scaleout.parallel`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

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


def _part(module: nn.Module) -> Any:  # noqa: ANN401
    return module


def reduce_parts(module: nn.Module, values: Tensor) -> Tensor:
    """Sum every worker's part of `values` (of the objective, its terms) over the grid, in
    place; returns `values`."""
    return _part(module).reduce(values)


def sync_grads(module: nn.Module) -> None:
    """Sum the replicated parameters' gradients over the grid (each worker's backward gave
    its part); a worker's own slices have their whole gradient already."""
    _part(module).sync_grads()


def is_replicated(module: nn.Module, param: nn.Parameter) -> bool:
    """Whether every worker holds all of `param` rather than its part."""
    return bool(_part(module).replicated(param))


def broadcast_replicated(module: nn.Module, params: Iterable[nn.Parameter]) -> None:
    """Give every worker rank 0's values of replicated `params`."""
    if dist.is_initialized():
        for p in params:
            dist.broadcast(p.data, src=0, group=_part(module).group)


def gather_parameter(module: nn.Module, param: nn.Parameter, value: Tensor) -> Tensor:
    """`value` shaped like this worker's part of `param` (the parameter, or its optimizer
    state) as the whole replica's tensor, on every worker (a collective)."""
    return _part(module).gather_parameter(param, value)


def scatter_parameter(module: nn.Module, param: nn.Parameter, value: Tensor) -> Tensor:
    """This worker's part of the whole replica's `value` for `param`."""
    return _part(module).scatter_parameter(param, value)


def global_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The whole replica's parameters under the unpartitioned module's names (a collective)."""
    return _part(module).global_state_dict()


def load_global_state_dict(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Take this worker's parts of a whole replica's state dict."""
    _part(module).load_global_state_dict(state)
