"""FSDP2's all-gather and reduce-scatter with compressed payloads (Dettmers 2015, applied to
sharded data parallelism).

    all_gather, reduce_scatter = fsdp_comms("dynamic8")
    module.set_custom_all_gather(all_gather)          # each FSDPModule (torch's FSDP2 API)
    module.set_custom_reduce_scatter(reduce_scatter)

- All-gather (the parameters, before a block's forward and backward): each rank encodes its
  flat shard, one all-gather moves the packed payloads, and every rank decodes all of them,
  its own included, so every rank computes with the same weights. The shards themselves,
  which the optimizer steps, stay exact.
- Reduce-scatter (the gradients, after a block's backward): each rank encodes the chunk of
  its flat gradient that each other rank owns, one all-to-all moves the payloads, and each
  rank sums the decoded chunks with its own exact one (SUM, or AVG divided by the ranks).

With an `OnLink` codec (`[compress] link`), a payload goes 8-bit only where that is faster
than float32 on the link for a message of the shard's size (`OnLink.encodes`), the same
choice on every rank (the sizes are the same). Non-finite values are sent flagged and decode
to NaN on every rank, so no rank leaves a collective. Why payloads and not a hook: FSDP2
calls these two objects for every collective it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# (torch 2.13 keeps FSDP2's collective interfaces in a private module; `set_custom_*` is public)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from scaleout.compress.codecs import Codec
from scaleout.compress.flat_collectives import all_gather_flat, reduce_scatter_flat
from scaleout.compress.link import OnLink
from scaleout.compress.payload import pack, unpack
from scaleout.compress.registry import get

__all__ = ["CodedAllGather", "CodedReduceScatter", "fsdp_comms"]


class _Coded:
    """What both collectives share: the codec (flagging non-finite values) and the choice
    of raw or coded per message size."""

    def __init__(self, codec: Codec) -> None:
        self.link = codec if isinstance(codec, OnLink) else None
        base = codec.codec if isinstance(codec, OnLink) else codec
        self.codec = get(base.name, **{**base.options, "nonfinite": "flag"})  # type: ignore[arg-type]

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def coded(self, numel: int) -> bool:
        return self.link is None or self.link.encodes(numel)

    def payload(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """`x` encoded and packed into one uint8 tensor, and the encoding (its layout)."""
        encoded = self.codec.encode(x.float())
        return pack(encoded), encoded

    def decoded(self, chunk: torch.Tensor, like: object) -> torch.Tensor:
        return self.codec.decode(unpack(chunk, like)).view(-1)  # type: ignore[arg-type]


class CodedAllGather(_Coded, AllGather):
    """FSDP2's all-gather of flat shards, the shards sent as payloads of the codec."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if not self.coded(input_tensor.numel()):
            return all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        payload, encoded = self.payload(input_tensor)
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
        all_gather_flat(gathered, payload, group=group)
        shards = output_tensor.view(world, -1)  # (world, shard)
        for rank, chunk in enumerate(gathered.view(world, -1)):
            shards[rank].copy_(self.decoded(chunk, encoded))
        return None  # done: FSDP waits only on a Work


class CodedReduceScatter(_Coded, ReduceScatter):
    """FSDP2's reduce-scatter of a flat gradient, each rank's chunk sent to its owner as a
    payload of the codec."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        average = op == dist.ReduceOp.AVG
        if not (average or op == dist.ReduceOp.SUM):
            raise ValueError(f"a compressed reduce-scatter sums or averages; FSDP asked {op}")
        if not self.coded(output_tensor.numel()):
            return reduce_scatter_flat(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = input_tensor.view(world, -1)  # (world, chunk): chunk r is rank r's
        payloads = [self.payload(chunk) for chunk in chunks]
        size = payloads[0][0].numel()  # the same for every chunk of equal length
        sent = torch.cat([p for p, _ in payloads])  # (world * size,) uint8
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        total = chunks[rank].float().clone()
        for source, chunk in enumerate(received.view(world, size)):
            if source != rank:
                total += self.decoded(chunk, payloads[rank][1])
        output_tensor.copy_(total.div_(world) if average else total)
        return None


def fsdp_comms(codec: Codec | str, **options: object) -> tuple[CodedAllGather, CodedReduceScatter]:
    """The all-gather and reduce-scatter for `FSDPModule.set_custom_all_gather` and
    `set_custom_reduce_scatter`, sending payloads of `codec` (a name with `options`, or a
    codec; an `OnLink` codec sends raw what is faster raw)."""
    if isinstance(codec, str):
        codec = get(codec, **options)  # type: ignore[arg-type]
    return CodedAllGather(codec), CodedReduceScatter(codec)
