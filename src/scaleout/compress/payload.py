"""`Encoded`: a compressed tensor, and its byte format with a validated header.

A payload on disk or on the wire is

    header  "SOCQ", version u8, codec id u8, dtype id u8, flags u8, ndim u8, 3 zero bytes,
            block_size u64, shape u64 * ndim, code bytes u64, scale count u64
    codes   the codec's bytes (8-bit codes, packed bits or raw fp16/bf16/fp32)
    scales  float32 little-endian (absmax per block, 10^K, or 1-bit means)
    crc32   u32 of everything before it, when flag bit 0 is set

all little-endian. `Encoded.from_bytes` checks every field against the others (the lengths
must be exactly those the codec implies for the shape and block size, the scales finite)
and raises `CorruptPayload` otherwise: a truncated, padded or, with the CRC, bit-flipped
payload is refused, never decoded into garbage. Without the CRC a flipped code byte cannot
be noticed; the CRC is on by default.

`pack`/`unpack` give the same codes and scales as one uint8 tensor without a header, for
collectives where every rank already knows the layout (the DDP hook).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch

from scaleout.errors import UserError

MAGIC = b"SOCQ"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBB3xQ")  # magic, version, codec, dtype, flags, ndim, block_size
_U64 = struct.Struct("<Q")
_CRC = struct.Struct("<I")
MAX_NDIM = 64
MAX_NUMEL = 1 << 48

_EMPTY_CODES = torch.empty(0, dtype=torch.uint8)
FLAG_CRC = 1
FLAG_NONFINITE = 2

CODEC_IDS = {
    "fp32": 1,
    "fp16": 2,
    "bf16": 3,
    "dynamic8": 4,
    "dynamic8_bnb": 5,
    "static8": 6,
    "mantissa8": 7,
    "linear8": 8,
    "onebit": 9,
}
DTYPE_IDS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
FIXED_SCALE_CODECS = ("static8", "mantissa8")  # one scale, 10^K
ABSMAX_CODECS = ("dynamic8", "dynamic8_bnb", "linear8")


class CorruptPayload(UserError):
    """Bytes that are not a complete, consistent payload of this format."""


def layout(codec: str, numel: int, block_size: int) -> tuple[int, int]:
    """(number of code bytes, number of float32 scales) that `codec` writes for `numel`
    values; `block_size` 0 means one scale (or one pair) for the whole tensor."""
    num_blocks = 1 if block_size == 0 else math.ceil(numel / block_size)
    if codec == "fp32":
        return 4 * numel, 0
    if codec in ("fp16", "bf16"):
        return 2 * numel, 0
    if codec == "onebit":
        return math.ceil(numel / 8), 2 * num_blocks
    if codec in FIXED_SCALE_CODECS:
        return numel, 1
    assert codec in ABSMAX_CODECS, codec
    return numel, num_blocks


def payload_size(codec: str, shape: tuple[int, ...], block_size: int, crc: bool = True) -> int:
    """Bytes of `Encoded.to_bytes` for a tensor of `shape`: what a message of it weighs on
    the wire (the simulator counts bytes with this)."""
    codes, scales = layout(codec, math.prod(shape), block_size)
    head = _HEAD.size + _U64.size * (len(shape) + 2)
    return head + codes + 4 * scales + (_CRC.size if crc else 0)


@dataclass(frozen=True)
class Encoded:
    """A compressed tensor: what `Codec.encode` returns and `Codec.decode` takes.

    `codes` is uint8 (see `layout`), `scales` float32; `dtype` and `shape` are the original
    tensor's, which decoding restores. `nonfinite` marks a message whose input held Inf or
    NaN (codecs built with `nonfinite="flag"`): it decodes to all NaN.
    """

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    codes: torch.Tensor  # (num_code_bytes,) uint8
    scales: torch.Tensor  # (num_scales,) float32
    block_size: int = 0  # 0: one scale for the whole tensor
    nonfinite: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales: what crosses the wire without the header."""
        return self.codes.numel() + 4 * self.scales.numel()

    def to_bytes(self, crc: bool = True) -> bytes:
        """The payload format above; `crc` appends a CRC32 (keep it on for anything stored)."""
        flags = (FLAG_CRC if crc else 0) | (FLAG_NONFINITE if self.nonfinite else 0)
        head = _HEAD.pack(
            MAGIC,
            VERSION,
            CODEC_IDS[self.codec],
            DTYPE_IDS[self.dtype],
            flags,
            len(self.shape),
            self.block_size,
        )
        dims = b"".join(_U64.pack(d) for d in self.shape)
        lengths = _U64.pack(self.codes.numel()) + _U64.pack(self.scales.numel())
        codes = self.codes.detach().contiguous().cpu().numpy().tobytes()
        scales = self.scales.detach().float().contiguous().cpu().numpy().astype("<f4").tobytes()
        body = head + dims + lengths + codes + scales
        return body + _CRC.pack(zlib.crc32(body)) if crc else body

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Encoded:
        """Parse and validate a payload; `CorruptPayload` names the first inconsistency."""
        data = memoryview(data).cast("B")
        if len(data) < _HEAD.size:
            raise CorruptPayload(f"payload of {len(data)} bytes is shorter than the header")
        magic, version, codec_id, dtype_id, flags, ndim, block_size = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise CorruptPayload(f"not a scaleout payload (magic {bytes(magic)!r})")
        if version != VERSION:
            raise CorruptPayload(f"payload format version {version}; this reader knows {VERSION}")
        codec = _by_value(CODEC_IDS, codec_id, "codec id")
        dtype = _by_value(DTYPE_IDS, dtype_id, "dtype id")
        if flags & ~(FLAG_CRC | FLAG_NONFINITE):
            raise CorruptPayload(f"unknown flag bits {flags:#04x}")
        if ndim > MAX_NDIM:
            raise CorruptPayload(f"ndim {ndim} > {MAX_NDIM}")
        pos = _HEAD.size
        end_of_lengths = pos + 8 * (ndim + 2)
        if len(data) < end_of_lengths:
            raise CorruptPayload(f"payload of {len(data)} bytes ends inside the header")
        fields = [_U64.unpack_from(data, pos + 8 * i)[0] for i in range(ndim + 2)]
        shape, (num_codes, num_scales) = tuple(fields[:ndim]), fields[ndim:]
        numel = math.prod(shape)
        if numel > MAX_NUMEL:
            raise CorruptPayload(f"shape {shape} holds {numel} values, more than {MAX_NUMEL}")
        _check_block_size(codec, block_size, numel)
        expected = layout(codec, numel, block_size)
        if (num_codes, num_scales) != expected:
            raise CorruptPayload(
                f"{codec} payload for shape {shape}, block_size {block_size} must hold "
                f"{expected[0]} code bytes and {expected[1]} scales, header says "
                f"{num_codes} and {num_scales}"
            )
        has_crc = bool(flags & FLAG_CRC)
        total = end_of_lengths + num_codes + 4 * num_scales + (_CRC.size if has_crc else 0)
        if len(data) != total:
            raise CorruptPayload(
                f"payload is {len(data)} bytes, its header implies {total} "
                f"({'truncated' if len(data) < total else 'trailing bytes'})"
            )
        if has_crc:
            (stored,) = _CRC.unpack_from(data, total - _CRC.size)
            if zlib.crc32(data[: total - _CRC.size]) != stored:
                raise CorruptPayload("CRC32 mismatch: the payload was altered")
        code_bytes = bytearray(data[end_of_lengths : end_of_lengths + num_codes])
        codes = torch.frombuffer(code_bytes, dtype=torch.uint8) if num_codes else _EMPTY_CODES
        start = end_of_lengths + num_codes
        raw = bytearray(data[start : start + 4 * num_scales])
        scales = torch.frombuffer(raw, dtype=torch.float32) if num_scales else torch.empty(0)
        if not torch.isfinite(scales).all():
            raise CorruptPayload("payload holds a non-finite scale")
        if codec in ABSMAX_CODECS and (scales < 0).any():
            raise CorruptPayload("payload holds a negative absmax scale")
        if codec in FIXED_SCALE_CODECS and not (scales > 0).all():
            raise CorruptPayload("payload holds a non-positive fixed scale")
        return cls(codec, dtype, shape, codes, scales, block_size, bool(flags & FLAG_NONFINITE))


def _by_value(ids: dict, value: int, what: str):  # noqa: ANN202 - key type varies
    for key, known in ids.items():
        if known == value:
            return key
    raise CorruptPayload(f"unknown {what} {value}")


def _check_block_size(codec: str, block_size: int, numel: int) -> None:
    blocked = codec in ABSMAX_CODECS or codec == "onebit"
    if block_size and not blocked:
        raise CorruptPayload(f"{codec} payload with block_size {block_size}")
    if block_size > MAX_NUMEL:
        raise CorruptPayload(f"block_size {block_size} out of range")


def pack(encoded: Encoded) -> torch.Tensor:
    """Codes, scales and a nonfinite flag byte as one uint8 tensor, on the codes' device."""
    device = encoded.codes.device
    scales = encoded.scales.to(device, torch.float32).contiguous().view(torch.uint8).view(-1)
    flag = torch.full((1,), int(encoded.nonfinite), dtype=torch.uint8, device=device)
    return torch.cat([encoded.codes.view(-1), scales, flag])


def packed_size(encoded: Encoded) -> int:
    return encoded.codes.numel() + 4 * encoded.scales.numel() + 1


def unpack(buffer: torch.Tensor, like: Encoded) -> Encoded:
    """The inverse of `pack` for a payload laid out like `like` (same codec, shape, blocks)."""
    num_codes = like.codes.numel()
    assert buffer.numel() == packed_size(like), "payload size mismatch"
    scales = buffer[num_codes:-1].clone().view(torch.float32)  # clone: float32 alignment
    nonfinite = bool(buffer[-1].item())
    return Encoded(
        like.codec, like.dtype, like.shape, buffer[:num_codes], scales, like.block_size, nonfinite
    )
