"""A pipeline stage whose activations, and the gradients that come back for them, cross
between stages as codec payloads (Dettmers 2015 section 2.2: model parallelism sends both).

    module = CodedStage(stage, activation_codec("dynamic8"), receives=not first, sends=not last)
    # (N, ...) -> (B,) float32 payload, from (B',) payload, and so on along the pipeline

A stage that sends ends in `encode_activation`: its output becomes a header (the shape and
dtype) and the activation's wire bytes (`scaleout.compress.wire`), viewed as float32, the
tensor kind torch's pipelining moves and differentiates. The gradient that comes back for
it is such a payload too, decoded in backward. A stage that receives starts with
`decode_activation`, the inverse: its backward sends the gradient as a payload. So both
directions cost the codec's bytes, and the pipeline's schedules run unchanged. Payloads are
opaque bit patterns: nothing between the stages may compute on them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor, nn

from scaleout.compress.codecs import Codec
from scaleout.compress.feedback import ErrorFeedback
from scaleout.compress.link import OnLink
from scaleout.compress.registry import get
from scaleout.compress.wire import from_wire, to_wire, wire_bytes

__all__ = [
    "ACTIVATION_DTYPES",
    "CodedStage",
    "activation_codec",
    "decode_activation",
    "encode_activation",
    "payload_numel",
]

# the float dtypes an activation may have, by the id its header names them with
ACTIVATION_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _payload(codec: Codec, x: Tensor, key: Hashable) -> Tensor:
    """(B,) float32: [dtype, ndim, *shape] as int64, then `x`'s wire bytes, zero-padded to
    whole float32 values."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"a coded pipeline activation must be a float tensor, got {x.dtype}")
    header = torch.tensor([ACTIVATION_DTYPES.index(x.dtype), x.dim(), *x.shape], dtype=torch.int64)
    body = to_wire(codec, x.detach(), key)
    pad = -(header.numel() * 8 + body.numel()) % 4
    parts = [header.to(body.device).view(torch.uint8), body, body.new_zeros(pad)]
    return torch.cat(parts).view(torch.float32)


def _values(codec: Codec, payload: Tensor) -> Tensor:
    """The tensor `_payload` carries."""
    raw = payload.detach().contiguous().view(torch.uint8)
    dtype_id, ndim = raw[:16].view(torch.int64).tolist()
    head = 8 * (2 + ndim)
    shape = raw[16:head].view(torch.int64).tolist()
    dtype = ACTIVATION_DTYPES[dtype_id]
    size = wire_bytes(codec, shape, dtype)
    return from_wire(codec, raw[head : head + size].clone(), shape, dtype)


def payload_numel(codec: Codec, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The float32 values of the payload an activation of `shape` and `dtype` sends."""
    return (8 * (2 + len(shape)) + wire_bytes(codec, shape, dtype) + 3) // 4


class _Encode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, codec: Codec, key: Hashable) -> Tensor:  # noqa: ANN401
        ctx.codec = codec  # (its backward decodes: no key)
        return _payload(codec, x, (key, "forward"))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN401
        return _values(ctx.codec, grad), None, None


class _Decode(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, payload: Tensor, codec: Codec, key: Hashable) -> Tensor:  # noqa: ANN401
        ctx.codec, ctx.key = codec, key
        return _values(codec, payload)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN401
        return _payload(ctx.codec, grad, (ctx.key, "backward")), None, None


def encode_activation(x: Tensor, codec: Codec, key: Hashable = None) -> Tensor:
    """`x` as a float32 payload; its gradient, a payload from the receiver, decoded."""
    return _Encode.apply(x, codec, key)


def decode_activation(payload: Tensor, codec: Codec, key: Hashable = None) -> Tensor:
    """The activation a payload carries; its gradient sent back as a payload."""
    return _Decode.apply(payload, codec, key)


class CodedStage(nn.Module):
    """`stage` between a decode of what it receives and an encode of what it sends, with
    `codec` (see `activation_codec`). It holds no parameters of its own: `stage`'s are its
    parameters under `inner.`."""

    def __init__(self, stage: nn.Module, codec: Codec, receives: bool, sends: bool) -> None:
        super().__init__()
        self.inner, self.codec = stage, codec
        self.receives, self.sends = receives, sends

    def forward(self, x: Tensor) -> Tensor:
        if self.receives:
            x = decode_activation(x, self.codec, "received")
        x = self.inner(x)
        if self.sends:
            x = encode_activation(x, self.codec, "sent")
        return x


def activation_codec(codec: Codec | str) -> Codec:
    """`codec` as activations cross with it: non-finite values sent flagged (they decode to
    NaN, so a stage never leaves the pipeline), and no error feedback, as each
    micro-batch's activation is a message of its own, not a sum over steps. An `OnLink`
    codec stays on its link (it sends raw what is faster raw)."""
    if isinstance(codec, str):
        return get(codec, nonfinite="flag")
    if isinstance(codec, OnLink):
        return OnLink(activation_codec(codec.codec), codec.link, codec.speed)
    if isinstance(codec, ErrorFeedback):
        codec = codec.codec
    return get(codec.name, **{**codec.options, "nonfinite": "flag"})  # type: ignore[arg-type]
