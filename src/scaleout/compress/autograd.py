"""`compressed(x, codec)`: compress a tensor in forward and its gradient in backward.

This is the paper's model-parallel use (section 2.2, Figure 3): the activations a layer sends
to the next worker and the deltas that come back both cross the wire, so both are
approximated. The function returns decode(encode(x)) and, in backward, decode(encode(grad)),
so a single process can measure what 8-bit (or 1-bit) exchange does to training; the
model-parallel exchange reuses it around its sends.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from scaleout.compress.codecs import Codec
from scaleout.compress.registry import get


class _Compressed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codec: Codec, key: Hashable) -> torch.Tensor:
        ctx.codec, ctx.key = codec, key
        return codec.roundtrip(x, key=(key, "forward", tuple(x.shape)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        key = (ctx.key, "backward", tuple(grad.shape))
        return ctx.codec.roundtrip(grad, key=key), None, None


def compressed(x: torch.Tensor, codec: Codec | str, key: Hashable = None) -> torch.Tensor:
    """decode(encode(x)) with the gradient also passed through the codec.

    `key` names this call site for codecs with state (error feedback, cached scales); the
    forward and backward messages are kept apart under it."""
    if isinstance(codec, str):
        codec = get(codec)
    return _Compressed.apply(x, codec, key)
