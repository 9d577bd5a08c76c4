"""The `[compress]` section: how messages travel (Downpour pushes, DDP's all-reduce, the
model-parallel exchanges). Codec names come from the codec registry."""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveInt, model_validator

from scaleout.compress.codecs import Codec
from scaleout.compress.link import OnLink
from scaleout.compress.registry import CODEC_NAMES, from_config
from scaleout.compress.transfer import CodecSpeed, LinkSpeed
from scaleout.config import Section

CodecName = Literal[CODEC_NAMES]  # type: ignore[valid-type]


class CompressSection(Section):
    """Compression of every message (Dettmers 2015): see `scaleout.compress`."""

    # fp32: raw; fp16, bf16: 16-bit floats; dynamic8, dynamic8_bnb, static8, mantissa8, linear8:
    # 8-bit codes (`scaleout.compress.tables`); onebit: each value's sign (needs error_feedback)
    codec: CodecName = "fp32"
    block_size: PositiveInt | None = None  # absmax per block of this many values; None: per tensor
    refresh_every: PositiveInt = 1  # recompute the absmax every k calls (the paper: 50)
    # 8-bit codes: "nearest" (to the nearest code) or "paper" (the 2015 kernel's rounding);
    # "paper" applies to dynamic8, static8, mantissa8 and linear8 only
    rounding: Literal["nearest", "paper"] = "nearest"
    exponent_offset: int | None = None  # static8 / mantissa8; None: the codec's default
    error_feedback: bool = False  # keep the quantisation residual and add it to the next message
    # The link messages cross ("1gbit", "10gbit", a rate such as "250mbit"): set, each
    # message (a push, a DDP bucket, an exchange's piece) travels encoded only where that is
    # faster than raw on this link, priced with the codec's cost measured on this machine
    # (`scaleout.compress.transfer`, `scaleout.compress.link`); None: always encoded.
    link: str | None = None

    @model_validator(mode="after")
    def _options_apply(self) -> CompressSection:
        """An option the codec does not have (a block size for fp16) is an error here, not
        in a worker that builds the codec."""
        self.build()  # raises ValueError naming the option and the codecs it applies to
        if self.link is not None:
            LinkSpeed.parse(self.link, "compress.link =")
        return self

    @property
    def is_identity(self) -> bool:
        """Whether messages travel as plain fp32 arrays."""
        return self.codec == "fp32" and not self.error_feedback

    def build(self) -> Codec:
        """The codec this section describes (with error feedback when asked for)."""
        return from_config(self)

    def build_for_collectives(self, speed: CodecSpeed | None = None) -> Codec | None:
        """The codec of DDP's buckets and the model-parallel exchanges: None for fp32; on a
        `link`, an `OnLink` that sends raw what is faster raw there, priced with `speed`
        (None: measured, then agreed by the ranks: `OnLink.agree`)."""
        if self.codec == "fp32":
            return None
        if self.link is None:
            return self.build()
        return OnLink(self.build(), LinkSpeed.parse(self.link, "compress.link ="), speed)
