"""All-gather and reduce-scatter into one flat tensor, under the name the installed torch
prefers: torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
`all_gather_single` / `reduce_scatter_single` and warns on the old names, which torch 2.4
(our oldest) alone has."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own argument name
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Every rank's `input` (the same size on each) concatenated in rank order into
    `output`, of world size times `input`'s elements."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own argument name
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """`input` reduced over the ranks with `op`; rank r keeps chunk r of it in `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)
