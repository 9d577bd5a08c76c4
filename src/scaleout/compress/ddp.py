"""A DDP communication hook that sends compressed gradients (Dettmers 2015, section 4).

    model = DistributedDataParallel(model)
    model.register_comm_hook(None, scaleout.compress.ddp_hook("dynamic8"))

Schedule per gradient bucket (flat, N values) on each of W ranks:

1. (error feedback) add the residual kept for this bucket;
2. encode: N one-byte codes plus the scales, packed with a flag byte into ONE uint8 tensor
   (all ranks have the same bucket sizes, so the same payload size);
3. one all-gather (`all_gather_single`): every rank receives every rank's payload. Codes cannot be
   all-reduced (a sum of codes means nothing), hence the gather;
4. decode all W payloads, the rank's own included (the 2015 code kept its own gradient in
   32 bits, which makes replicas drift apart under DDP), sum them in rank order, divide by
   W and write the bucket. Every rank computes exactly the same sum, so the replicas stay
   bitwise identical;
5. (error feedback) keep `sent - decode(own payload)` as the residual.

With an `OnLink` codec (`[compress] link`), a bucket goes 8-bit only where the encode, the
gather and the decodes are faster than the float32 all-reduce (`OnLink.encodes_allreduce`:
both as the ranks timed them in `OnLink.agree`, else priced as rings on the link; the same
choice on every rank); otherwise it is all-reduced raw, as with `fp32`, carrying the
error-feedback residual in full.

Traffic: each rank receives (W - 1) * (N + 4 * blocks) bytes, against about 8 N (W - 1) / W
for a float32 ring all-reduce, so the gather wins for W < 8 (DeepSpeed's all-to-all +
all-gather scheme would be needed beyond). The `fp32` codec uses a plain all-reduce.

State (residuals, cached scales) is keyed by bucket index and dropped when the bucket's
parameters change, which DDP does when it rebuilds its buckets after the first iteration.
Non-finite gradients are sent flagged rather than raised, so that no rank leaves the
collective: they decode to NaN on every rank alike, as an fp32 all-reduce would.
"""

# No `from __future__ import annotations`: DDP checks this hook's annotations at run time.
from collections.abc import Callable

import torch
import torch.distributed as dist

from scaleout.compress.codecs import Codec
from scaleout.compress.feedback import ErrorFeedback
from scaleout.compress.flat_collectives import all_gather_flat
from scaleout.compress.link import OnLink, mean_of_payloads
from scaleout.compress.payload import pack
from scaleout.compress.registry import get

Hook = Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def ddp_hook(
    codec: Codec | str,
    error_feedback: bool | None = None,
    process_group: dist.ProcessGroup | None = None,
    **options: object,
) -> Hook:
    """A hook for `DistributedDataParallel.register_comm_hook(None, hook)`.

    `codec`: a name (with `options` as for `get`) or a codec; an `ErrorFeedback` codec turns
    error feedback on; an `OnLink` codec sends raw the buckets that are faster raw on its
    link (agree its speed first: `OnLink.agree`). `error_feedback` None means on for
    `onebit` only (it does not train without it), off otherwise. The hook ignores DDP's
    `state` argument and communicates on `process_group` (None: the default group).
    """
    link = codec if isinstance(codec, OnLink) else None
    if link is not None:
        codec = link.codec
    if isinstance(codec, ErrorFeedback):
        error_feedback = True if error_feedback is None else error_feedback
        codec = codec.codec
    if isinstance(codec, str):
        base = get(codec, **options, nonfinite="flag")  # type: ignore[arg-type]
    else:
        if options:
            raise ValueError("ddp_hook: give options with a codec name, not with a codec")
        base = get(codec.name, **{**codec.options, "nonfinite": "flag"})  # type: ignore[arg-type]
    if error_feedback is None:
        error_feedback = base.name == "onebit"
    sender: Codec = ErrorFeedback(base) if error_feedback else base
    signatures: dict[int, tuple] = {}

    def compressed_allgather_hook(
        state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()  # (N,) flat gradients, not yet averaged
        world = dist.get_world_size(process_group)

        def raw() -> torch.futures.Future[torch.Tensor]:  # DDP's own float32 average
            work = dist.all_reduce(buffer.div_(world), group=process_group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        if base.name == "fp32":
            return raw()
        index = bucket.index()
        signature = tuple((id(p), p.numel()) for p in bucket.parameters())
        if signatures.get(index) != signature:  # new bucket or rebuilt buckets
            sender.forget(index)
            signatures[index] = signature
        if link is not None and not link.encodes_allreduce(buffer.numel(), world):
            if error_feedback:  # the residual travels in full, and is spent
                buffer.copy_(sender.spend(buffer, index))  # type: ignore[union-attr]
            return raw()
        sent = sender.compensate(buffer, index) if error_feedback else buffer
        encoded = base.encode(sent, key=index)
        payload = pack(encoded)  # (P,) uint8: codes, scales, flag
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buffer.device)
        work = all_gather_flat(gathered, payload, group=process_group, async_op=True)
        rank = dist.get_rank(process_group)

        def average(fut: torch.futures.Future) -> torch.Tensor:
            fut.wait()
            keep = rank if error_feedback else None
            mean, own = mean_of_payloads(gathered, encoded, base, world, keep)
            if own is not None:
                sender.remember(index, sent, own)  # type: ignore[union-attr]
            buffer.copy_(mean)
            return buffer

        return work.get_future().then(average)

    compressed_allgather_hook.codec = sender  # type: ignore[attr-defined]
    return compressed_allgather_hook
