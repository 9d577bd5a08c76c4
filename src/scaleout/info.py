"""`scaleout info`: what a config's model costs, computed without data or weights.

The model is built on PyTorch's meta device (shapes, no storage), so this works for networks
far larger than memory; FLOPs come from torch's FlopCounterMode on one traced example.
Training FLOPs are taken as 3x the forward pass (forward, input gradients, weight gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from scaleout.errors import ConfigError
from scaleout.nn.optim import state_buffers


@dataclass
class LayerInfo:
    name: str
    kind: str
    shapes: list[tuple[int, ...]]
    params: int
    flops: int  # forward, per example


@dataclass
class ModelInfo:
    kind: str
    input_shape: tuple[int, ...]
    layers: list[LayerInfo]
    params: int
    forward_flops: int  # per example
    bytes_per_value: int
    optimizer: str
    notes: list[str] = field(default_factory=list)  # model-specific lines for `scaleout info`

    @property
    def train_flops(self) -> int:
        return 3 * self.forward_flops

    @property
    def memory(self) -> dict[str, int]:
        """Bytes for parameters, gradients and optimizer state."""
        weights = self.params * self.bytes_per_value
        return {
            "parameters": weights,
            "gradients": weights,
            "optimizer state": weights * state_buffers(self.optimizer),
        }


def describe_model(config: Any) -> ModelInfo:  # noqa: ANN401 - a RunConfig
    """Parameter counts per layer, memory and FLOPs for the model of `config` (a
    `RunConfig`); the input shape comes from the model's `input_shape`, or from one example
    of the data when the model has none."""
    if config.model is None:
        raise ConfigError("[model] is missing: scaleout info describes the model a config names")
    with torch.device("meta"):
        model = config.model.build()
    example = example_input(config, model)
    input_shape = tuple(example.shape[1:])
    if hasattr(model, "layer_costs"):  # the model counts its own layers exactly
        return _from_layer_costs(model, config, input_shape)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.eval()(example)
    per_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    root = type(model).__name__
    layers = [
        LayerInfo(
            name=name,
            kind=type(module).__name__,
            shapes=[tuple(p.shape) for p in module.parameters(recurse=False)],
            params=sum(p.numel() for p in module.parameters(recurse=False)),
            flops=per_module.get(f"{root}.{name}", 0),
        )
        for name, module in model.named_modules()
        if _has_own_parameters(module)
    ]
    return ModelInfo(
        kind=config.model.name,
        input_shape=input_shape,
        layers=layers,
        params=sum(p.numel() for p in model.parameters()),
        forward_flops=counter.get_total_flops(),
        bytes_per_value=torch.finfo(torch.get_default_dtype()).bits // 8,
        optimizer=config.train.optimizer,
    )


def example_input(config: Any, model: nn.Module) -> torch.Tensor:  # noqa: ANN401 - a RunConfig
    """One example for `model` on PyTorch's meta device, (1, ...): of the model's
    `input_shape`, or shaped (and typed: token ids are integers) as the data's first."""
    input_shape = getattr(model, "input_shape", None)
    if input_shape is not None:
        return torch.empty(1, *input_shape, device="meta")
    if config.data is None:
        raise ConfigError(
            f"model ({config.model.name}) has no input_shape and the config names no "
            "[data] to take one example from"
        )
    train, _ = config.data.build(config.run.seed)
    first = torch.as_tensor(train[0][0])
    return torch.empty(1, *first.shape, dtype=first.dtype, device="meta")


def _from_layer_costs(model: nn.Module, config: Any, input_shape: tuple) -> ModelInfo:  # noqa: ANN401
    """Counts from `model.layer_costs()`, for layers FlopCounterMode cannot see into (custom
    autograd Functions); `model.cost_notes(...)` adds lines of its own (e.g. per stack)."""
    layers = [LayerInfo(**row) for row in model.layer_costs()]  # type: ignore[operator]
    bytes_per_value = torch.finfo(torch.get_default_dtype()).bits // 8
    notes = []
    if hasattr(model, "cost_notes"):
        notes = model.cost_notes(  # type: ignore[operator]
            config.train.batch_size, bytes_per_value, state_buffers(config.train.optimizer)
        )
    return ModelInfo(
        kind=config.model.name,
        input_shape=input_shape,
        layers=layers,
        params=sum(p.numel() for p in model.parameters()),
        forward_flops=sum(layer.flops for layer in layers),
        bytes_per_value=bytes_per_value,
        optimizer=config.train.optimizer,
        notes=notes,
    )


def _has_own_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def human(count: float, unit: str = "") -> str:
    """1234567 -> '1.23M'; bytes with unit 'B' -> '4.71 MiB'."""
    if unit == "B":
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(count) < 1024 or suffix == "TiB":
                return f"{count:.0f} B" if suffix == "B" else f"{count:.2f} {suffix}"
            count /= 1024
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.3g}{suffix}{unit}"
    return f"{count:.0f}{unit}"
