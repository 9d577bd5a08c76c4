"""8-bit approximation of messages (Dettmers 2015) and the codecs it is compared with.

    codec = scaleout.compress.get("dynamic8", block_size=4096)
    encoded = codec.encode(tensor)          # Encoded: uint8 codes + float32 scales
    data = encoded.to_bytes()               # header, lengths, CRC32
    tensor = codec.decode(Encoded.from_bytes(data))

Codecs (`CODEC_NAMES`): fp32, fp16, bf16, dynamic8 (the 2015 dynamic tree), dynamic8_bnb
(bitsandbytes' map), static8, mantissa8, linear8, onebit. `ErrorFeedback(codec)` carries
each message's error into the next; `OnLink(codec, link)` sends raw what is faster raw on a
link; `ddp_hook` plugs a codec into PyTorch DDP; `compressed(x, codec)` compresses
activations in forward and gradients in backward. See shared/notes/codecs.md for the
tables and the original kernel's rounding.
"""

from scaleout.compress.autograd import compressed
from scaleout.compress.codecs import Codec, FloatCodec, NonFiniteInput, TableCodec
from scaleout.compress.config import CompressSection
from scaleout.compress.ddp import ddp_hook
from scaleout.compress.feedback import ErrorFeedback
from scaleout.compress.link import OnLink
from scaleout.compress.onebit import OneBitCodec
from scaleout.compress.payload import CorruptPayload, Encoded
from scaleout.compress.registry import CODEC_NAMES, EIGHT_BIT_CODECS, decode, from_config, get

__all__ = [
    "CODEC_NAMES",
    "EIGHT_BIT_CODECS",
    "Codec",
    "CompressSection",
    "CorruptPayload",
    "Encoded",
    "ErrorFeedback",
    "FloatCodec",
    "NonFiniteInput",
    "OnLink",
    "OneBitCodec",
    "TableCodec",
    "compressed",
    "ddp_hook",
    "decode",
    "from_config",
    "get",
]
