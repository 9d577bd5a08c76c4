"""Distributed arrays (COTS HPC section 4.2, DistBelief section 3): the only communication of
a model-parallel network, hidden behind one differentiable exchange.

A global (N, C, H, W) array is partitioned over H and W among the workers of a process group.
Worker i holds the values of its **output window** out_i (what it computed) and needs those of
its **input window** in_i (what its neurons read; see `scaleout.comm.windows`). The exchange

    buffer_i[p] = sum over workers j with p in out_j of local_j[p]      for p in in_i

gives worker i a local buffer over in_i; when the output windows tile the array (the forward
pass of a partitioned layer) the sum has one term and the buffer is a consistent copy of
in_i. Pixels of in_i that no worker owns are zero. Overlapping output windows are summed,
which is exactly what the backward pass needs: the exchange is linear, and its adjoint is the
same exchange with the roles of the windows swapped, so the gradient of each received value
goes back to its owner, where the contributions of all readers are summed.

Communication schedule of one exchange (forward or backward), on every worker i at once:

1. cut the pieces out_i ∩ in_j for every j != i whose intersection is non-empty (any worker,
   not only grid neighbours: wide receptive fields reach far workers) and pack them;
2. one `all_to_all_single` with split sizes (N*C*pixels per peer, 0 where nothing is
   exchanged), or `batch_isend_irecv` with one send / receive per non-empty piece;
3. add every received piece, and the worker's own piece out_i ∩ in_i (never sent), into a
   zero buffer over in_i, in the order of the sending rank, so the sums are deterministic.
   Where the pieces tile in_i (the forward pass) they are copied, with no zeroing; where the
   worker's own piece is all of in_i, the buffer is a view of its local array.

Buffers keep the memory layout of the local array (the layers keep theirs in (H, W, C, N)
order), so copying into them and reading them are contiguous.

With a `codec` (`scaleout.compress`, e.g. dynamic8: the 8-bit paper's model-parallel use)
each piece sent to another worker is encoded and packed into bytes before step 2 and decoded
after it; the worker's own piece is never compressed. Gradients are compressed the same way.
A piece the codec would rather send raw (`Codec.encodes`: an `OnLink` codec on a link where
raw is faster for its size, the same choice on both ends) travels as its float bytes in the
same byte buffer.

Every worker of the group must take part in every exchange (it is a collective), and in the
backward pass too: each worker's loss must depend on its buffer. Exchanges where no pair of
distinct workers shares a pixel skip the collective on all workers alike (every worker builds
the plan from the same global windows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from scaleout.comm.windows import Window, intersections
from scaleout.compress import Codec
from scaleout.compress.wire import from_wire, to_wire, wire_bytes

__all__ = ["DistributedArray", "ExchangePlan", "Transport", "exchange"]

Transport = Literal["all_to_all", "p2p"]
TRANSPORTS = ("all_to_all", "p2p")


@dataclass(frozen=True)
class ExchangePlan:
    """What one worker sends and receives in an exchange, from the windows of all workers.

    `sends` lists (j, out_rank ∩ in_j) and `receives` (j, in_rank ∩ out_j), both by rank j and
    only where non-empty; the worker's own piece (j == rank) is included in both and copied
    locally. `collective` is whether any two distinct workers exchange anything.
    """

    rank: int
    world_size: int
    output: Window
    input: Window
    sends: tuple[tuple[int, Window], ...]
    receives: tuple[tuple[int, Window], ...]
    collective: bool

    @classmethod
    def build(cls, rank: int, outputs: Sequence[Window], inputs: Sequence[Window]) -> ExchangePlan:
        """Plan for worker `rank` from every worker's output and input window (index = rank)."""
        if len(outputs) != len(inputs):
            raise ValueError(
                f"need one output and one input window per worker, got {len(outputs)} outputs "
                f"and {len(inputs)} inputs"
            )
        if not 0 <= rank < len(outputs):
            raise ValueError(f"rank {rank} is outside a group of {len(outputs)} workers")
        pieces = intersections(outputs, inputs)  # (i, j): out_i ∩ in_j, i sends to j
        return cls(
            rank,
            len(outputs),
            outputs[rank],
            inputs[rank],
            tuple((j, p) for (i, j), p in sorted(pieces.items()) if i == rank),
            tuple((i, p) for (i, j), p in sorted(pieces.items()) if j == rank),
            any(i != j for i, j in pieces),
        )

    def transposed(self) -> ExchangePlan:
        """The adjoint exchange (gradients flow from input windows back to their owners)."""
        return ExchangePlan(
            self.rank,
            self.world_size,
            self.input,
            self.output,
            self.receives,
            self.sends,
            self.collective,
        )

    @cached_property
    def receives_tile(self) -> bool:
        """Whether the received pieces cover the input window exactly once (no zeroing and no
        sums needed: each piece is copied into its place)."""
        pieces = [p for _, p in self.receives]
        if sum(p.num_pixels for p in pieces) != self.input.num_pixels:
            return False
        return all(a.intersect(b).is_empty for k, a in enumerate(pieces) for b in pieces[k + 1 :])

    @cached_property
    def is_identity(self) -> bool:
        """Whether the buffer is the worker's own values over its input window alone."""
        return self.receives == ((self.rank, self.input),)

    def bytes_sent(self, batch: int, channels: int, element_size: int = 4) -> int:
        """Bytes this worker sends to other workers in one exchange."""
        pixels = sum(p.num_pixels for j, p in self.sends if j != self.rank)
        return pixels * batch * channels * element_size


def _check_local(local: Tensor, window: Window) -> None:
    if local.dim() != 4 or tuple(local.shape[2:]) != window.shape:
        raise ValueError(
            f"local array has shape {tuple(local.shape)}; the worker's window needs "
            f"(N, C, {window.shape[0]}, {window.shape[1]})"
        )


def _empty_like(local: Tensor, shape: tuple[int, int]) -> Tensor:
    """An uninitialised (N, C, *shape) array with `local`'s order of dimensions in memory."""
    n, c = local.shape[:2]
    sizes = (n, c, *shape)
    order = [0, 1, 2, 3]
    if not local.is_contiguous():
        order = sorted(order, key=lambda d: -local.stride(d))  # outermost first
    buffer = local.new_empty([sizes[d] for d in order])
    return buffer.permute([order.index(d) for d in range(4)])


def exchange(
    local: Tensor,
    plan: ExchangePlan,
    group: dist.ProcessGroup | None = None,
    transport: Transport = "all_to_all",
    codec: Codec | None = None,
) -> Tensor:
    """One exchange without autograd: `local` (N, C, *out shape) -> buffer (N, C, *in shape).

    `plan.rank` must be this process's rank in `group` (the default group when None)."""
    _check_local(local, plan.output)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    n, c = local.shape[:2]
    remote_sends = [(j, p) for j, p in plan.sends if j != plan.rank]
    remote_receives = [(j, p) for j, p in plan.receives if j != plan.rank]
    outgoing = [local[(..., *p.relative_to(plan.output))].reshape(-1) for _, p in remote_sends]
    if codec is None:
        recv_sizes = [p.num_pixels * n * c for _, p in remote_receives]
        empty = local.new_empty(0)  # gives the transport's buffers their dtype and device
    else:
        # one key per piece, for codecs that keep scales per key (refresh_every > 1)
        keys = [(plan.output, plan.input, j) for j, _ in remote_sends]
        outgoing = [to_wire(codec, t, key) for t, key in zip(outgoing, keys, strict=True)]
        shapes = [(n, c, *p.shape) for _, p in remote_receives]
        recv_sizes = [wire_bytes(codec, shape, local.dtype) for shape in shapes]
        empty = local.new_empty(0, dtype=torch.uint8)  # packed codes and scales
    incoming: list[Tensor] = []
    if plan.collective:
        assert dist.get_rank(group) == plan.rank, "plan built for another rank"
        assert dist.get_world_size(group) == plan.world_size, "plan built for another group"
        peers_out = [j for j, _ in remote_sends]
        peers_in = [j for j, _ in remote_receives]
        transfer = _all_to_all if transport == "all_to_all" else _point_to_point
        incoming = transfer(
            outgoing, peers_out, recv_sizes, peers_in, plan.world_size, empty, group
        )
    if codec is not None:
        incoming = [
            from_wire(codec, t, shape, local.dtype).reshape(-1)
            for t, shape in zip(incoming, shapes, strict=True)
        ]
    if plan.is_identity:
        return local[(..., *plan.input.relative_to(plan.output))]
    buffer = _empty_like(local, plan.input.shape)  # (N, C, in rows, in cols)
    if not plan.receives_tile:
        buffer.zero_()
    received = iter(incoming)
    for j, piece in plan.receives:  # by sending rank: deterministic sums
        target = buffer[(..., *piece.relative_to(plan.input))]
        if j == plan.rank:
            value = local[(..., *piece.relative_to(plan.output))]
        else:
            value = next(received).view(n, c, *piece.shape)
        if plan.receives_tile:
            target.copy_(value)
        else:
            target += value
    return buffer


def _all_to_all(
    outgoing: list[Tensor],
    peers_out: list[int],
    recv_sizes: list[int],
    peers_in: list[int],
    world_size: int,
    empty: Tensor,
    group: dist.ProcessGroup | None,
) -> list[Tensor]:
    """All pieces in one `all_to_all_single` with split sizes (0 for peers that exchange
    nothing); returns the received pieces as views of one buffer, in `peers_in` order."""
    send_splits, recv_splits = [0] * world_size, [0] * world_size
    for j, piece in zip(peers_out, outgoing, strict=True):
        send_splits[j] = piece.numel()
    for j, size in zip(peers_in, recv_sizes, strict=True):
        recv_splits[j] = size
    send = torch.cat(outgoing) if outgoing else empty
    recv = empty.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    return list(recv.split(recv_sizes)) if recv_sizes else []


def _point_to_point(
    outgoing: list[Tensor],
    peers_out: list[int],
    recv_sizes: list[int],
    peers_in: list[int],
    world_size: int,
    empty: Tensor,
    group: dist.ProcessGroup | None,
) -> list[Tensor]:
    """One isend per piece sent and one irecv per piece received, in one batch."""

    def global_rank(j: int) -> int:
        return j if group is None else dist.get_global_rank(group, j)

    incoming = [empty.new_empty(size) for size in recv_sizes]
    ops = [
        dist.P2POp(dist.isend, piece.contiguous(), global_rank(j), group)
        for j, piece in zip(peers_out, outgoing, strict=True)
    ] + [
        dist.P2POp(dist.irecv, piece, global_rank(j), group)
        for j, piece in zip(peers_in, incoming, strict=True)
    ]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return incoming


class _Exchange(torch.autograd.Function):
    """exchange() forward; the transposed exchange of the gradient backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        local: Tensor,
        plan: ExchangePlan,
        group: dist.ProcessGroup | None,
        transport: Transport,
        codec: Codec | None,
    ) -> Tensor:
        ctx.options = (group, transport, codec)  # type: ignore[attr-defined]
        ctx.plan = plan  # type: ignore[attr-defined]
        return exchange(local, plan, group, transport, codec)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad_local = exchange(grad, ctx.plan.transposed(), *ctx.options)
        return grad_local, None, None, None, None


class DistributedArray:
    """One worker's view of a partitioned (N, C, H, W) array: `array(local)` returns the
    buffer over this worker's input window, differentiably (see the module docstring).

    `outputs[i]` and `inputs[i]` are worker i's windows in global coordinates, i its rank in
    `group` (the default process group when None); `codec` compresses what crosses the
    wire (see the module docstring).
    """

    def __init__(
        self,
        outputs: Sequence[Window],
        inputs: Sequence[Window],
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        transport: Transport = "all_to_all",
        codec: Codec | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if rank is None:
            rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.plan = ExchangePlan.build(rank, outputs, inputs)
        self.outputs, self.inputs = tuple(outputs), tuple(inputs)  # every worker's windows
        self.group = group
        self.transport: Transport = transport
        self.codec = codec

    @property
    def output(self) -> Window:
        return self.plan.output

    @property
    def input(self) -> Window:
        return self.plan.input

    def bytes_sent(
        self,
        batch: int,
        channels: int,
        dtype: torch.dtype = torch.float32,
        backward: bool = False,
    ) -> int:
        """Bytes this worker puts on the wire in one exchange of a (batch, channels, H, W)
        array (packed codes and scales with a codec); `backward`: in the exchange of its
        gradient, which sends back what the forward received."""
        pieces = self.plan.receives if backward else self.plan.sends
        return sum(
            wire_bytes(self.codec, (batch, channels, *piece.shape), dtype)
            for j, piece in pieces
            if j != self.plan.rank
        )

    def pair_bytes(
        self,
        batch: int,
        channels: int,
        dtype: torch.dtype = torch.float32,
        backward: bool = False,
    ) -> dict[tuple[int, int], int]:
        """{(i, j): bytes worker i sends worker j} in one exchange, for every pair of
        distinct workers that exchange anything (what a simulator of the whole grid needs;
        `bytes_sent` is row `rank` of it)."""
        out = {}
        for (i, j), piece in intersections(self.outputs, self.inputs).items():
            if i != j:
                pair = (j, i) if backward else (i, j)
                out[pair] = wire_bytes(self.codec, (batch, channels, *piece.shape), dtype)
        return out

    def __call__(self, local: Tensor) -> Tensor:
        """local (N, C, *output shape) -> buffer (N, C, *input shape)."""
        return _Exchange.apply(local, self.plan, self.group, self.transport, self.codec)

    def __repr__(self) -> str:
        return (
            f"DistributedArray(rank={self.plan.rank}, world={self.plan.world_size}, "
            f"output={self.output}, input={self.input}, transport={self.transport!r})"
        )
