"""A tensor as the bytes it crosses a wire as, under a codec: packed codes and scales where
the codec encodes its size (`Codec.encodes`), else its own values' bytes.

    sent = to_wire(codec, x, key)                       # (B,) uint8
    x_hat = from_wire(codec, sent, x.shape, x.dtype)     # the receiver knows shape and dtype
    assert sent.numel() == wire_bytes(codec, x.shape, x.dtype)

Both ends make the same choice from the size alone (an `OnLink` codec, agreed between the
ranks), so no byte says which form a message took. Why one place: every exchange that sends
codec payloads point to point (a grid's pieces, a pipeline's activations) sends them so.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from scaleout.compress.codecs import Codec
from scaleout.compress.payload import Encoded, layout, pack, packed_size, unpack

__all__ = ["from_wire", "layout_like", "to_wire", "wire_bytes"]


def layout_like(
    codec: Codec, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> Encoded:
    """An `Encoded` with the layout `codec` gives a tensor of `shape` (for `unpack`)."""
    if getattr(codec, "absmax", True) is False:  # fixed-scale table codecs: one scale
        block = 0
    else:
        block = getattr(codec, "block_size", None) or 0
    num_codes, num_scales = layout(codec.name, math.prod(shape), block)
    codes = torch.empty(num_codes, dtype=torch.uint8, device=device)
    scales = torch.empty(num_scales, dtype=torch.float32, device=device)
    return Encoded(codec.name, dtype, tuple(shape), codes, scales, block)


def wire_bytes(codec: Codec | None, shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a tensor of `shape` and `dtype` takes on the wire: raw, or packed codes and
    scales."""
    numel = math.prod(shape)
    if codec is None or not codec.encodes(numel):
        return numel * dtype.itemsize
    return packed_size(layout_like(codec, shape, dtype, torch.device("cpu")))


def to_wire(codec: Codec, x: Tensor, key: Hashable | None = None) -> Tensor:
    """`x` as the bytes it travels as (flat uint8); `key` names the message for codecs that
    keep state per message (cached scales, error feedback)."""
    if codec.encodes(x.numel()):
        return pack(codec.encode(x, key))
    return codec.raw(x, key).contiguous().view(torch.uint8).view(-1)


def from_wire(codec: Codec, sent: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The values of `to_wire`'s bytes `sent`, of `shape` and `dtype`."""
    if codec.encodes(math.prod(shape)):
        like = layout_like(codec, shape, dtype, sent.device)
        return codec.decode(unpack(sent, like)).to(dtype).view(*shape)
    return as_values(sent, dtype).view(*shape)


def as_values(received: Tensor, dtype: torch.dtype) -> Tensor:
    """Raw bytes received as values of `dtype` (copied where they do not start on a value's
    boundary: a view of one buffer after packed pieces of any length)."""
    if received.storage_offset() % dtype.itemsize:
        received = received.clone()
    return received.view(dtype)
