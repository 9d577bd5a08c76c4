"""How parameter and gradient slices travel between replicas and shards.

fp32 slices travel as numpy arrays, which Ray moves through its shared-memory object store
without pickling the data (a reader on the same node maps it, zero-copy). With a codec from
`scaleout.compress` (the `[compress]` section), a slice travels as the codec's bytes (with
its header and CRC), and with `error_feedback` each sender keeps the residual per key (one
per shard), so what 8 bits cannot carry now is sent later.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from scaleout.compress import CompressSection

Payload = np.ndarray | bytes


class Wire:
    """Encode/decode slices with the configured codec; fp32 is a plain array."""

    def __init__(self, compress: CompressSection | None = None) -> None:
        self.compress = compress
        self.codec_name = compress.codec if compress is not None else "fp32"
        self._codec: Any = None
        if compress is not None and not compress.is_identity:
            self._codec = compress.build()

    def encode(self, values: torch.Tensor, key: int | str | None = None) -> Payload:
        """Encode a slice; `key` names the stream whose residual error feedback keeps."""
        if self._codec is None:
            return values.detach().to("cpu", torch.float32).numpy()
        return self._codec.encode(values.detach(), key).to_bytes()

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

    def __reduce__(self) -> tuple[type[Wire], tuple[CompressSection | None]]:
        return Wire, (self.compress,)
