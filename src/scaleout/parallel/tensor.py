"""Tensor-parallel Linear layers: PyTorch's `parallelize_module` plans applied to a user's
model from outside, over all the workers of the process group.

    check_plan(model, {"mlp.0": "colwise", "mlp.2": "rowwise"})   # ValueError: one line
    tensor_parallel(model, plan, device)                         # in place: DTensor weights

"colwise" splits a Linear's output features over the workers (its output stays split, as
the next layer's "rowwise" input expects); "rowwise" splits its input features and sums the
partial outputs (an all-reduce), so a colwise-rowwise pair computes the whole layer pair
with one all-reduce forward and one backward. Every worker reads the same batch. A model
whose code reshapes a split output (attention heads) must infer the split size (`view(n,
t, -1, head_dim)`). Why PyTorch's plans: they are what torchtitan applies.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

Style = Literal["colwise", "rowwise"]
STYLES = ("colwise", "rowwise")

__all__ = ["STYLES", "Style", "check_plan", "tensor_parallel"]


def check_plan(model: nn.Module, plan: dict[str, str]) -> None:
    """Every path of `plan` names an `nn.Linear` of `model` and a style in `STYLES`;
    ValueError naming the path and the model's Linear layers otherwise."""
    if not plan:
        raise ValueError("model_parallel.tensor_plan is empty: name the Linear layers to split")
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for path, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"model_parallel.tensor_plan[{path!r}] = {style!r}: use one of {STYLES}"
            )
        if path not in linears:
            raise ValueError(
                f"model_parallel.tensor_plan names {path!r}, which is no nn.Linear of the "
                f"model; its Linear layers are {', '.join(linears) or 'none'}"
            )


def _style(style: str) -> ParallelStyle:
    return ColwiseParallel() if style == "colwise" else RowwiseParallel()


def tensor_parallel(model: nn.Module, plan: dict[str, str], device: torch.device) -> None:
    """Split the Linear layers `plan` names over every worker of the default process group
    (in place: their weights become DTensors; build the optimizer after this)."""
    check_plan(model, plan)
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    parallelize_module(model, mesh, {path: _style(style) for path, style in plan.items()})
