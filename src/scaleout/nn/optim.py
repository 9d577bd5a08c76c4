"""Optimizers by name (torch.optim).

Parameter-server shards and workers build their optimizer from the same options (`[train]`
optimizer, lr, momentum, weight_decay, warmup_steps), so S shards stepping their slices
equal one optimizer stepping the whole vector: every optimizer here is element-wise.

Warm-up: the learning rate rises linearly over the first `warmup_steps` optimizer steps
(lr / W, 2 lr / W, ..., lr). Adagrad needs it: its accumulator starts at 0, so its first
step moves every weight by about lr at once (whatever its gradient), which drove the MNIST
demo's loss from 2.3 to 16 and the speech model's from 9 (chance) to 30 before they
recovered. `warmup_steps = None` (the default) is 200 for Adagrad and 0 for the others.
Measured on the demo (2 replicas, warm start of 200 steps; a shard's optimizer steps once
per push): 50 steps removed the start's blow-up but not a second one when the second
replica joins (loss 0.3 -> 4.75: the accumulator, no longer inflated by the blow-up, let
two stale replicas overshoot); 200 removed both (no push's loss above the first); 500
learned slower. The step count lives in each parameter group (saved with the optimizer's
state), so a restored optimizer does not warm up again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

OptimizerName = Literal["sgd", "momentum", "adagrad", "rmsprop", "adam"]

# Optimizer state per parameter, in parameter-sized buffers (for memory estimates).
STATE_BUFFERS: dict[str, int] = {"sgd": 0, "momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 2}
DEFAULT_WARMUP: dict[str, int] = {"adagrad": 200}  # optimizer steps, where warmup_steps is None


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
    @property
    def warmup_steps(self) -> int | None: ...


@dataclass(frozen=True)
class OptimizerSpec:
    """Options for an optimizer outside a run config (e.g. a parameter server started by a
    user's own loop): `OptimizerSpec("adagrad", lr=0.05)`."""

    optimizer: OptimizerName = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # None: DEFAULT_WARMUP's


def warmup_steps(options: OptimizerOptions) -> int:
    """The optimizer steps of `options`' learning-rate warm-up (0: none)."""
    steps = getattr(options, "warmup_steps", None)
    return DEFAULT_WARMUP.get(options.optimizer, 0) if steps is None else steps


def warm_up(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.Optimizer:
    """Scale every group's learning rate by (k + 1) / steps at its k-th step, k < steps (a
    step pre-hook; k is kept in the group as `warmup_step`, its full rate as `warmup_lr`).
    After the warm-up the hook leaves the rate alone, so a schedule of the caller's (or a
    phase's own rates) is not overwritten."""
    if steps <= 0:
        return optimizer
    for group in optimizer.param_groups:
        group.setdefault("warmup_lr", group["lr"])
        group.setdefault("warmup_step", 0)

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            done = group.get("warmup_step", steps)
            if done < steps:
                group["lr"] = group["warmup_lr"] * ((done + 1) / steps)  # as LambdaLR
                group["warmup_step"] = done + 1

    optimizer.register_step_pre_hook(before_step)
    return optimizer


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], options: OptimizerOptions
) -> torch.optim.Optimizer:
    """torch.optim for `options.optimizer` (sgd, momentum, adagrad, rmsprop or adam) over
    parameters or parameter groups, with its learning-rate warm-up (`warmup_steps`)."""
    return warm_up(_torch_optimizer(params, options), warmup_steps(options))


def _torch_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], options: OptimizerOptions
) -> torch.optim.Optimizer:
    lr, decay = options.lr, options.weight_decay
    params = [_listed(p) for p in params]  # looked at by `_fused`, then given to torch
    match options.optimizer:
        case "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=decay)
        case "momentum":
            return torch.optim.SGD(params, lr=lr, momentum=options.momentum, weight_decay=decay)
        case "adagrad":
            return torch.optim.Adagrad(params, lr=lr, weight_decay=decay, fused=_fused(params))
        case "rmsprop":
            return torch.optim.RMSprop(params, lr=lr, weight_decay=decay)
        case "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=decay, fused=_fused(params))
    raise ValueError(f"train.optimizer = {options.optimizer!r} is not an optimizer")


def _listed(param: Any) -> Any:  # noqa: ANN401 - a parameter or a group
    """A parameter as it is; a group with its parameters in a list (a generator, as in
    `{"params": model.parameters()}`, would be spent by `_fused` before torch saw it)."""
    if not isinstance(param, dict):
        return param
    params = param["params"]
    return {**param, "params": [params] if isinstance(params, torch.Tensor) else list(params)}


FUSED_DEVICES = ("cpu", "cuda")  # where torch has Adagrad's and Adam's one-pass kernels


def _fused(params: list[torch.nn.Parameter] | list[dict[str, Any]]) -> bool | None:
    """Adagrad's and Adam's fused step (one pass over memory) where every parameter is a
    floating-point tensor on a device that has it; None (torch's default) elsewhere. A
    parameter-server shard of the MNIST demo (0.93M values, cold caches) steps Adagrad in
    0.70 ms fused against 1.62 ms (Adam: 1.23 against 2.64 ms). The two differ by an
    ulp (2.4e-7 after five steps), so a reference to compare with is built fused too."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    if tensors and all(t.is_floating_point() and t.device.type in FUSED_DEVICES for t in tensors):
        return True
    return None
