"""Error feedback: carry each message's quantisation error into the next one (1-bit SGD).

For the tensor named `key`, `ErrorFeedback(codec)` sends `v = x + r` instead of x and keeps
`r = v - decode(encode(v))`, the part the receiver did not get. Summed over steps nothing is
lost but the last residual, which is why 1-bit quantisation converges with it and not
without. Residuals are float32 (also for fp16/bf16 tensors) and are dropped when a key's
shape changes (e.g. after DDP rebuilds its buckets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

from scaleout.compress.codecs import Codec
from scaleout.compress.payload import Encoded


class ErrorFeedback(Codec):
    """Wraps a codec; `encode(x, key)` sends x plus the residual kept for `key`."""

    def __init__(self, codec: Codec) -> None:
        if isinstance(codec, ErrorFeedback):
            raise ValueError("ErrorFeedback(codec): codec already has error feedback")
        super().__init__(codec.nonfinite)
        self.codec = codec
        self.name = codec.name
        self.residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def options(self) -> dict[str, object]:
        return self.codec.options

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r})"

    def _key(self, x: torch.Tensor, key: Hashable | None) -> Hashable:
        return key if key is not None else (x.numel(), str(x.device))

    def compensate(self, x: torch.Tensor, key: Hashable | None = None) -> torch.Tensor:
        """x plus the residual kept for `key`, as float32."""
        residual = self.residuals.get(self._key(x, key))
        v = x.detach().float()
        if residual is None or residual.shape != x.shape or residual.device != x.device:
            return v
        return v + residual

    def spend(self, x: torch.Tensor, key: Hashable | None = None) -> torch.Tensor:
        """x plus the residual kept for `key`, as float32, for a message that carries it
        exactly (sent raw): the residual is then spent."""
        v = self.compensate(x, key)
        self.residuals.pop(self._key(x, key), None)
        return v

    def remember(self, key: Hashable | None, sent: torch.Tensor, received: torch.Tensor) -> None:
        """Keep `sent - received` (the error of this message) for `key`. A non-finite
        residual (a flagged message) is not kept: it would poison every later message."""
        residual = sent.float() - received.float()
        if torch.isfinite(residual).all():
            self.residuals[self._key(sent, key)] = residual
        else:
            self.residuals.pop(self._key(sent, key), None)

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Encoded:
        v = self.compensate(x, key)
        encoded = dataclasses.replace(self.codec.encode(v, key), dtype=x.dtype)
        self.remember(key, v.view(x.shape), self.codec.decode(encoded))
        return encoded

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.decode(encoded, out)

    def raw(self, x: torch.Tensor, key: Hashable | None = None) -> torch.Tensor:
        """x plus the residual, which a raw message carries in full (and spends)."""
        return self.spend(x, key).view(x.shape).to(x.dtype)

    def forget(self, key: Hashable) -> None:
        self.residuals.pop(key, None)
        self.codec.forget(key)

    def reset(self) -> None:
        """Forget every residual."""
        self.residuals.clear()
