"""Optimizers by name (torch.optim).

Parameter-server shards and workers build their optimizer from the same options (`[train]`
optimizer, lr, momentum, weight_decay), so S shards stepping their slices equal one
optimizer stepping the whole vector: every optimizer here is element-wise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

OptimizerName = Literal["sgd", "momentum", "adagrad", "rmsprop", "adam"]

# Optimizer state per parameter, in parameter-sized buffers (for memory estimates).
STATE_BUFFERS: dict[str, int] = {"sgd": 0, "momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 2}


class OptimizerOptions(Protocol):
    """What chooses an optimizer (the `[train]` section has these keys)."""

    @property
    def optimizer(self) -> str: ...
    @property
    def lr(self) -> float: ...
    @property
    def momentum(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...


@dataclass(frozen=True)
class OptimizerSpec:
    """Options for an optimizer outside a run config (e.g. a parameter server started by a
    user's own loop): `OptimizerSpec("adagrad", lr=0.05)`."""

    optimizer: OptimizerName = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], options: OptimizerOptions
) -> torch.optim.Optimizer:
    """torch.optim for `options.optimizer` (sgd, momentum, adagrad, rmsprop or adam) over
    parameters or parameter groups."""
    lr, decay = options.lr, options.weight_decay
    match options.optimizer:
        case "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=decay)
        case "momentum":
            return torch.optim.SGD(params, lr=lr, momentum=options.momentum, weight_decay=decay)
        case "adagrad":
            return torch.optim.Adagrad(params, lr=lr, weight_decay=decay)
        case "rmsprop":
            return torch.optim.RMSprop(params, lr=lr, weight_decay=decay)
        case "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=decay)
    raise ValueError(f"train.optimizer = {options.optimizer!r} is not an optimizer")
