"""Optimizers by name (torch.optim) or by the user's factory.

Parameter-server shards and workers build their optimizer from the same options (`[train]`
optimizer, lr, momentum, weight_decay, betas, eps), so S shards stepping their slices equal
one optimizer stepping the whole vector: every optimizer by name here is element-wise, and
a factory's is checked to be before it runs on shards (`check_elementwise`).

`train.optimizer` is a name (sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw), or a factory:
"package.module:function" in TOML, or the function itself from `scaleout.fit(optimizer=)`,
called as `fn(params) -> torch.optim.Optimizer`; its own rate is the base the schedule
scales. The learning rate of each step is the caller's, from the global step
(`scaleout.nn.schedule`), which keeps each group's base rate as `initial_lr`.

Warm-up: `warmup_steps = None` (the default) is 200 steps for Adagrad and 0 for the others.
Adagrad needs it: its accumulator starts at 0, so its first step moves every weight by about
lr at once (whatever its gradient), which throws the loss far above chance before training
recovers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch.distributed.tensor import DTensor

from scaleout.errors import ConfigError
from scaleout.factories import load_callable, one_line
from scaleout.nn.schedule import Schedule

OptimizerName = Literal["sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw"]
OPTIMIZER_NAMES: tuple[str, ...] = OptimizerName.__args__  # type: ignore[attr-defined]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

# Optimizer state per parameter, in parameter-sized buffers (for memory estimates).
STATE_BUFFERS: dict[str, int] = {
    "sgd": 0,
    "momentum": 1,
    "nesterov": 1,
    "adagrad": 1,
    "rmsprop": 1,
    "adam": 2,
    "adamw": 2,
}
DEFAULT_WARMUP: dict[str, int] = {"adagrad": 200}  # optimizer steps, where warmup_steps is None


def state_buffers(optimizer: str) -> int:
    """Parameter-sized buffers of `optimizer`'s state; a factory's is taken as Adam's (2)."""
    return STATE_BUFFERS.get(optimizer, 2)


class OptimizerOptions(Protocol):
    """What chooses an optimizer (the `[train]` section has these keys)."""

    @property
    def optimizer(self) -> str | OptimizerFactory: ...
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
    user's own loop): `OptimizerSpec("adagrad", lr=0.05)`. `schedule`: the learning rate of
    each global step (None: constant after `warmup_steps`); shards count the steps their
    pushes carry."""

    optimizer: str | OptimizerFactory = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # None: DEFAULT_WARMUP's
    betas: tuple[float, float] | None = None  # None: torch's default (0.9, 0.999)
    eps: float | None = None  # None: the optimizer's own default
    schedule: Schedule | None = None


def warmup_steps(options: OptimizerOptions) -> int:
    """The steps of `options`' learning-rate warm-up (0: none)."""
    steps = getattr(options, "warmup_steps", None)
    name = options.optimizer if isinstance(options.optimizer, str) else ""
    return DEFAULT_WARMUP.get(name, 0) if steps is None else steps


def schedule_of(options: OptimizerOptions) -> Schedule:
    """`options.schedule` where it has one, else constant after its warm-up."""
    schedule = getattr(options, "schedule", None)
    return schedule if schedule is not None else Schedule(warmup_steps=warmup_steps(options))


def is_factory(optimizer: str | OptimizerFactory) -> bool:
    """Whether `train.optimizer` names a factory rather than an optimizer by name."""
    return callable(optimizer) or ":" in optimizer


def factory_of(optimizer: str | OptimizerFactory) -> OptimizerFactory:
    return optimizer if callable(optimizer) else load_callable(optimizer, "train.optimizer")


def optimizer_label(optimizer: str | OptimizerFactory) -> str:
    """How messages name `train.optimizer`."""
    if isinstance(optimizer, str):
        return optimizer
    return getattr(optimizer, "__qualname__", type(optimizer).__name__)


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]], options: OptimizerOptions
) -> torch.optim.Optimizer:
    """The optimizer `options.optimizer` names (or its factory builds) over parameters or
    parameter groups."""
    params = [_listed(p) for p in params]  # looked at by `_fused`, then given to torch
    if is_factory(options.optimizer):
        return _from_factory(params, options.optimizer)
    return _torch_optimizer(params, options)


def _from_factory(params: list[Any], optimizer: str | OptimizerFactory) -> torch.optim.Optimizer:
    factory = factory_of(optimizer)
    name = optimizer_label(optimizer)
    try:
        built = factory(params)
    except Exception as err:  # noqa: BLE001 - the user's code: one line, never a traceback
        raise ConfigError(f"train.optimizer = {name!r} raised {one_line(err)}") from None
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(
            f"train.optimizer = {name!r} returned a {type(built).__name__}, not a "
            "torch.optim.Optimizer: return one, e.g. torch.optim.AdamW(params, lr=3e-4)"
        )
    return built


def _torch_optimizer(params: list[Any], options: OptimizerOptions) -> torch.optim.Optimizer:
    lr, decay = options.lr, options.weight_decay
    given: dict[str, Any] = {}  # betas and eps where set; else each optimizer's own default
    if getattr(options, "eps", None) is not None:
        given["eps"] = options.eps  # type: ignore[attr-defined]
    moments = dict(given)
    if getattr(options, "betas", None) is not None:
        moments["betas"] = tuple(options.betas)  # type: ignore[attr-defined]
    loop = {"foreach": False} if _mixed(params) else {}  # DTensors beside tensors
    fused = {} if loop else {"fused": _fused(params)}
    match options.optimizer:
        case "sgd":
            return torch.optim.SGD(params, lr=lr, weight_decay=decay, **loop)
        case "momentum":
            return torch.optim.SGD(
                params, lr=lr, momentum=options.momentum, weight_decay=decay, **loop
            )
        case "nesterov":
            return torch.optim.SGD(
                params, lr=lr, momentum=options.momentum, weight_decay=decay, nesterov=True, **loop
            )
        case "adagrad":
            return torch.optim.Adagrad(params, lr=lr, weight_decay=decay, **fused, **loop, **given)
        case "rmsprop":
            return torch.optim.RMSprop(params, lr=lr, weight_decay=decay, **loop, **given)
        case "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=decay, **fused, **loop, **moments)
        case "adamw":
            return torch.optim.AdamW(params, lr=lr, weight_decay=decay, **fused, **loop, **moments)
    raise ConfigError(
        f"train.optimizer = {options.optimizer!r} is not an optimizer: use one of "
        f"{', '.join(OPTIMIZER_NAMES)} or a factory 'package.module:function'"
    )


def _listed(param: Any) -> Any:  # noqa: ANN401 - a parameter or a group
    """A parameter as it is; a group with its parameters in a list (a generator, as in
    `{"params": model.parameters()}`, would be spent by `_fused` before torch saw it)."""
    if not isinstance(param, dict):
        return param
    params = param["params"]
    return {**param, "params": [params] if isinstance(params, torch.Tensor) else list(params)}


FUSED_DEVICES = ("cpu", "cuda")  # where torch has the one-pass kernels used here


def _tensors(params: list[torch.nn.Parameter] | list[dict[str, Any]]) -> list[torch.Tensor]:
    return [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]


def _mixed(params: list[torch.nn.Parameter] | list[dict[str, Any]]) -> bool:
    """Whether some parameters are DTensors (split by tensor parallelism) and some plain:
    torch's fused and multi-tensor steps take one kind at a time, its per-tensor loop both."""
    kinds = {isinstance(t, DTensor) for t in _tensors(params)}
    return len(kinds) > 1


def _fused(params: list[torch.nn.Parameter] | list[dict[str, Any]]) -> bool | None:
    """Adagrad's, Adam's and AdamW's fused step (one pass over memory) where every
    parameter is a floating-point tensor on a device that has it; None (torch's default)
    elsewhere. Fused because a parameter-server shard's step is bound by memory traffic,
    which the unfused steps multiply. Fused and unfused differ by an ulp, so a reference to
    compare with is built fused too."""
    tensors = _tensors(params)
    if tensors and all(t.is_floating_point() and t.device.type in FUSED_DEVICES for t in tensors):
        return True
    return None


def check_elementwise(options: OptimizerOptions) -> None:
    """Raise a one-line `ConfigError` unless `options`' optimizer steps every value on its
    own: a parameter-server shard holds a flat slice that cuts across tensors, so an
    optimizer that reads whole tensors (per-layer norms, factored moments, orthogonalised
    updates) would step something else than the model's tensors. Checked by stepping a
    (6, 10) tensor whole and as two flat slices of 23 and 37 values on the same gradients:
    an element-wise optimizer moves both alike."""
    if not is_factory(options.optimizer):
        return  # every optimizer by name is element-wise
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, 10, generator=generator)
    grads = [torch.randn(6, 10, generator=generator) for _ in range(3)]
    whole = torch.nn.Parameter(start.clone())
    flat = start.reshape(-1)
    pieces = [torch.nn.Parameter(flat[:23].clone()), torch.nn.Parameter(flat[23:].clone())]
    name = optimizer_label(options.optimizer)
    why = (
        f"train.optimizer = {name!r} does not step element by element, and a Downpour shard "
        "holds a flat slice of the parameters that cuts across tensors"
    )
    fix = (
        "use it with strategy single or sync, or an element-wise optimizer (sgd, adam, "
        "adamw, ...) with downpour"
    )
    one = build_optimizer([whole], options)  # a factory that fails here fails everywhere
    try:
        two = [build_optimizer([piece], options) for piece in pieces]
        for grad in grads:
            whole.grad = grad
            one.step()
            flat_grad = grad.reshape(-1)
            pieces[0].grad, pieces[1].grad = flat_grad[:23], flat_grad[23:]
            for optimizer in two:
                optimizer.step()
    except Exception as err:  # noqa: BLE001 - e.g. an optimizer that needs 2-D tensors
        cause = err.__cause__ or err
        raise ConfigError(f"{why} (on a 1-D slice: {one_line(cause)}): {fix}") from None
    stepped = torch.cat([pieces[0].detach(), pieces[1].detach()])
    if not torch.allclose(whole.detach().reshape(-1), stepped, rtol=1e-5, atol=1e-6):
        raise ConfigError(f"{why} (a (6, 10) tensor and its two slices moved differently): {fix}")
