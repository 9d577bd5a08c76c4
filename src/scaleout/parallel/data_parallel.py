"""Data-parallel primitives (Ding et al. 2015, section 2.2): average tensors over a process
group, and what the paper's `average` mode averages.

`average_tensors` coalesces: one all-reduce per dtype of a flat buffer holding every tensor,
so latency is paid once, not per tensor. The synchronous strategy averages `synced_state`
(parameters, floating buffers such as BatchNorm statistics, floating optimizer state such as
momentum) every `sync.average_every` steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["average_tensors", "synced_state"]


@torch.no_grad()
def average_tensors(tensors: list[torch.Tensor], group: Any = None) -> None:  # noqa: ANN401
    """Replace each tensor by its mean over the process group."""
    world = dist.get_world_size(group)
    if world == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)  # (sum of numels,)
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for tensor, mean in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            tensor.copy_(mean)


def synced_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What `average` mode averages: parameters, floating buffers, floating optimizer state
    (momentum buffers, moments; not step counters)."""
    tensors = [p.data for p in model.parameters()]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    for state in optimizer.state.values():
        tensors += [
            v
            for k, v in sorted(state.items())
            if torch.is_tensor(v) and v.is_floating_point() and k != "step" and v.dim() > 0
        ]
    return tensors
