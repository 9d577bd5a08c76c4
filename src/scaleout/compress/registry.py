"""Codecs by name: `get(name, **options)`, `from_config(section)`, `decode(encoded)`.

`CODEC_NAMES` is the one list of codec names; the `[compress]` section takes its choices
from it.

The option names are those of the config's `[compress]` section (`block_size`,
`refresh_every`, `rounding`, `exponent_offset`) plus `nonfinite`; an option that does not
apply to the chosen codec is an error when it is set to anything but its default, so a
config cannot silently ask for something the codec ignores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scaleout.compress.codecs import Codec, FloatCodec, NonFinite, TableCodec
from scaleout.compress.feedback import ErrorFeedback
from scaleout.compress.onebit import OneBitCodec
from scaleout.compress.payload import ABSMAX_CODECS, FIXED_SCALE_CODECS, Encoded
from scaleout.compress.tables import Rounding

if TYPE_CHECKING:
    from scaleout.compress.config import CompressSection

FLOAT_CODECS = ("fp32", "fp16", "bf16")
EIGHT_BIT_CODECS = ("dynamic8", "dynamic8_bnb", "static8", "mantissa8", "linear8")
CODEC_NAMES = (*FLOAT_CODECS, *EIGHT_BIT_CODECS, "onebit")

_DEFAULTS: dict[str, object] = {
    "block_size": None,
    "refresh_every": 1,
    "rounding": "nearest",
    "exponent_offset": None,
}
_APPLIES: dict[str, tuple[str, ...]] = {
    "block_size": (*ABSMAX_CODECS, "onebit"),
    "refresh_every": ABSMAX_CODECS,
    "rounding": ("dynamic8", "static8", "mantissa8", "linear8"),
    "exponent_offset": FIXED_SCALE_CODECS,
}


def get(
    name: str,
    *,
    block_size: int | None = None,
    refresh_every: int = 1,
    rounding: Rounding = "nearest",
    exponent_offset: int | None = None,
    nonfinite: NonFinite = "raise",
) -> Codec:
    """The codec `name` (one of `CODEC_NAMES`) with its options."""
    if name not in CODEC_NAMES:
        raise ValueError(f"codec {name!r} is unknown; choose one of: {', '.join(CODEC_NAMES)}")
    given = {
        "block_size": block_size,
        "refresh_every": refresh_every,
        "rounding": rounding,
        "exponent_offset": exponent_offset,
    }
    for option, value in given.items():
        if value != _DEFAULTS[option] and name not in _APPLIES[option]:
            raise ValueError(
                f"option {option} = {value!r} does not apply to codec {name!r} (it applies "
                f"to {', '.join(_APPLIES[option])}); leave it at {_DEFAULTS[option]!r}"
            )
    if name in FLOAT_CODECS:
        return FloatCodec(name, nonfinite=nonfinite)
    if name == "onebit":
        return OneBitCodec(block_size, nonfinite=nonfinite)
    return TableCodec(name, block_size, refresh_every, rounding, exponent_offset, nonfinite)


def from_config(section: CompressSection) -> Codec:
    """The codec a `[compress]` section describes, wrapped in `ErrorFeedback` when
    `error_feedback` is true."""
    codec = get(
        section.codec,
        block_size=section.block_size,
        refresh_every=section.refresh_every,
        rounding=section.rounding,
        exponent_offset=section.exponent_offset,
    )
    return ErrorFeedback(codec) if section.error_feedback else codec


def decode(encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode any message with the codec it names (decoding needs no options); into `out`
    when given (see `Codec.decode`)."""
    return get(encoded.codec).decode(encoded, out)
