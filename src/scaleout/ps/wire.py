"""How parameter and gradient slices travel between replicas and shards.

fp32 slices travel as numpy arrays, which Ray moves through its shared-memory object store
without pickling the data (a reader on the same node maps it, zero-copy). With a codec from
`scaleout.compress` (the `[compress]` section), a slice travels as the codec's bytes (with
its header and CRC), and with `error_feedback` each sender keeps the residual per key (one
per shard), so what 8 bits cannot carry now is sent later.

With `compress.link` set, each message goes encoded only where that is faster than raw on
that link (`scaleout.compress.transfer.plan`, one piece: Ray moves an object whole), with
the codec's cost measured in this process at its first message; a raw message carries the
error feedback residual in full. The receiver tells the two apart by the payload's type.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from scaleout.compress import CompressSection, Encoded, ErrorFeedback
from scaleout.compress.link import measure_speed
from scaleout.compress.payload import payload_size
from scaleout.compress.transfer import CodecSpeed, LinkSpeed, plan

Payload = np.ndarray | bytes


class Wire:
    """Encode/decode slices with the configured codec; fp32 is a plain array."""

    def __init__(
        self, compress: CompressSection | None = None, speed: CodecSpeed | None = None
    ) -> None:
        """`speed`: the codec's cost to plan with (the simulator gives the calibrated one);
        None: measured in this process at the first message that needs it."""
        self.compress = compress
        self.codec_name = compress.codec if compress is not None else "fp32"
        self._codec: Any = None
        self._link: LinkSpeed | None = None
        self._speed = speed
        if compress is not None and not compress.is_identity:
            self._codec = compress.build()
            if compress.link is not None:
                self._link = LinkSpeed.parse(compress.link, "compress.link =")

    def encode(self, values: torch.Tensor, key: int | str | None = None) -> Payload:
        """Encode a slice; `key` names the stream whose residual error feedback keeps."""
        if self._codec is None:
            return values.detach().to("cpu", torch.float32).numpy()
        if not self.encodes(values.numel()):
            if isinstance(self._codec, ErrorFeedback):
                values = self._codec.spend(values.detach(), key)
            return values.detach().to("cpu", torch.float32).numpy()
        return self._codec.encode(values.detach(), key).to_bytes()

    def encodes(self, numel: int) -> bool:
        """Whether a message of `numel` values goes encoded (always, without a link)."""
        if self._codec is None:
            return False
        if self._link is None:
            return True
        if self._speed is None:
            self._speed = self.measure_speed()
        compress = self.compress
        assert compress is not None
        size = lambda n: payload_size(compress.codec, (n,), compress.block_size or 0)  # noqa: E731
        return plan(numel, self._link, self._speed, size, pipeline=False).encoded

    def measure_speed(self) -> CodecSpeed:
        """This codec's cost per message in this process (`compress.link.measure_speed`)."""
        assert self._codec is not None
        return measure_speed(self._codec)

    def decode(self, payload: Payload) -> torch.Tensor:
        """A float32 CPU tensor; read-only when it maps Ray's object store (copy to change)."""
        if isinstance(payload, np.ndarray):
            with warnings.catch_warnings():  # Ray hands out read-only views; we only read them
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(payload)
        assert self._codec is not None, "a compressed payload reached an fp32 wire"
        return self._codec.decode(Encoded.from_bytes(payload)).float()

    @staticmethod
    def nbytes(payload: Payload) -> int:
        return payload.nbytes if isinstance(payload, np.ndarray) else len(payload)

    def __reduce__(self) -> tuple[type[Wire], tuple[CompressSection | None]]:
        return Wire, (self.compress,)
