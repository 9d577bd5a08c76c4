"""How parameter and gradient slices travel between replicas and shards.

fp32 slices travel as numpy arrays, which Ray moves through its shared-memory object store
without pickling the data (a reader on the same node maps it, zero-copy). With a codec from
`scaleout.compress` (the `[compress]` section), a slice travels as the codec's bytes.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

Payload = np.ndarray | bytes


class Wire:
    """Encode/decode slices with the configured codec; fp32 is a plain array."""

    def __init__(self, compress: dict[str, Any] | None = None) -> None:
        self.compress = dict(compress or {})
        self.codec_name = self.compress.get("codec", "fp32")
        self._codec = None
        if self.codec_name != "fp32":
            from scaleout.compress import get  # the codec room; absent codecs fail here

            options = {
                k: v
                for k, v in self.compress.items()
                if k in ("block_size", "refresh_every", "rounding", "exponent_offset")
                and v is not None
            }
            self._codec = get(self.codec_name, **options)

    def encode(self, values: torch.Tensor) -> Payload:
        if self._codec is None:
            return values.detach().to("cpu", torch.float32).numpy()
        return self._codec.encode(values.detach()).to_bytes()

    def decode(self, payload: Payload) -> torch.Tensor:
        """A float32 CPU tensor; read-only when it maps Ray's object store (copy to change)."""
        if isinstance(payload, np.ndarray):
            with warnings.catch_warnings():  # Ray hands out read-only views; we only read them
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(payload)
        from scaleout.compress import Encoded

        assert self._codec is not None, "a compressed payload reached an fp32 wire"
        return self._codec.decode(Encoded.from_bytes(payload)).float()

    @staticmethod
    def nbytes(payload: Payload) -> int:
        return payload.nbytes if isinstance(payload, np.ndarray) else len(payload)

    def __reduce__(self) -> tuple[type[Wire], tuple[dict[str, Any]]]:
        return Wire, (self.compress,)
