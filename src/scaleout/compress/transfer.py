"""Whether a message should travel 8-bit or raw, and in how many pieces.

8 bits move a quarter of the bytes but cost an encode on the sender and a decode on the
receiver. On a slow link (100 Mbit, 1 Gbit) that is always worth it from a few thousand
values on; on a fast one (10 Gbit, shared memory) or for a tiny message the codec's fixed
cost per call can exceed the wire time it saves, and 8 bits would slow the transfer down.
`plan()` prices both from two measured things and picks the faster:

- the link (`LinkSpeed`): bytes per second each way and one-way latency, by name
  (`1gbit`, `10gbit`, `ib56`, ...), as a rate (`250mbit`), or measured: a line through
  messages timed by size (`LinkSpeed.from_times`);
- the codec on this machine (`CodecSpeed.measure`): seconds per call and per value for
  the sender's side (encode, serialise) and the receiver's (deserialise, decode).

A pipelined message is cut into chunks of `chunk` values, and chunk k + 1 is encoded while
chunk k is on the wire and k - 1 is decoded: with k chunks of c values the message takes

    latency + e(c) + w(c) + d(c) + (k - 1) * max(e(c), w(c), d(c))

(e, w, d: encode, wire and decode time of one chunk), so a large message costs about its
wire time alone. Raw is `latency + 4 n / bandwidth`. 8 bits are chosen only where they are
priced at most `ENCODE_MARGIN` of raw's time. Both ends of a point-to-point
transfer must compute the same plan: they agree on one `CodecSpeed` first (the sender's).
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from scaleout.errors import ConfigError

# Named links: (bytes/s each way, one-way latency in seconds, incl. the network stack).
LINKS: dict[str, tuple[float, float]] = {
    "100mbit": (100e6 / 8, 100e-6),
    "1gbit": (1e9 / 8, 50e-6),
    "10gbit": (10e9 / 8, 20e-6),
    "ib56": (56e9 / 8 * 64 / 66, 2e-6),  # FDR InfiniBand 4x, 64b/66b coding
}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(k|m|g)?(bit|b)?\s*$", re.IGNORECASE)
# No finer pipelining (values per piece): below this a piece's fixed costs (the codec's
# calls, a message each way) are not all in `CodecSpeed` and the link's line, so smaller
# pieces are priced faster than they travel.
MIN_CHUNK = 1 << 20
# 8 bits only where predicted at most this share of raw's time: a codec measured once, alone,
# costs more beside a busy network stack, so a plan that predicts only a small gain from
# encoding can be slower than raw.
ENCODE_MARGIN = 0.8


@dataclass(frozen=True)
class LinkSpeed:
    """One direction of a link: payload bytes per second and the fixed seconds of a
    message (latency, incl. the network stack)."""

    bytes_per_s: float
    latency_s: float

    @classmethod
    def parse(cls, text: str, what: str = "--link") -> LinkSpeed:
        """A link by name (`1gbit`, `ib56`, ...) or rate (`250mbit`, `40MB`); `what`
        names the option in the error."""
        key = text.strip().lower()
        if key in LINKS:
            return cls(*LINKS[key])
        match = _RATE.match(key)
        if match is None or match.group(3) is None:
            raise ConfigError(
                f"{what} {text!r}: give one of {', '.join(LINKS)} or a rate such as 250mbit"
            )
        value = float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9, None: 1.0}[match.group(2)]
        per_s = value / 8 if match.group(3).lower() == "bit" else value
        if per_s <= 0:
            raise ConfigError(f"{what} {text!r}: the rate must be > 0")
        return cls(per_s, 50e-6)

    @classmethod
    def from_times(cls, measured: list[tuple[int, float]]) -> LinkSpeed:
        """The line through messages timed by size, (bytes, seconds) at two or more sizes:
        the median of the slopes between every two sizes, and the median intercept under
        it (Theil-Sen), so that one disturbed size does not bend it."""
        slopes = [(t1 - t0) / (b1 - b0) for b0, t0 in measured for b1, t1 in measured if b1 > b0]
        if not slopes:
            raise ValueError("LinkSpeed.from_times needs messages of at least two sizes")
        slope = max(statistics.median(slopes), 1e-15)
        intercept = statistics.median(t - slope * b for b, t in measured)
        return cls(1 / slope, max(intercept, 0.0))

    def seconds(self, nbytes: int) -> float:
        """One message of `nbytes` on this link, latency included."""
        return self.latency_s + nbytes / self.bytes_per_s


def median_s(call: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The median seconds of `repeats` timed calls of `call()`, after `warmup` calls."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@dataclass(frozen=True)
class CodecSpeed:
    """A codec's cost on this machine: seconds per call plus seconds per value, on the
    sender (encode + serialise) and on the receiver (deserialise + decode)."""

    send_call_s: float
    send_value_s: float
    receive_call_s: float
    receive_value_s: float

    def send_s(self, numel: int) -> float:
        return self.send_call_s + self.send_value_s * numel

    def receive_s(self, numel: int) -> float:
        return self.receive_call_s + self.receive_value_s * numel

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def measure(
        cls,
        send: Callable[[torch.Tensor], Any],
        receive: Callable[[Any], torch.Tensor],
        sizes: tuple[int, int] = (4096, 1 << 18),
        repeats: int = 5,
    ) -> CodecSpeed:
        """Time `send(x)` and `receive(send(x))` at two sizes (median of `repeats` timed
        calls after one warm-up) and fit a call cost and a cost per value to each; a few
        milliseconds with the C kernels."""
        fits = []
        for side in ("send", "receive"):
            seconds = []
            for numel in sizes:
                x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
                message = send(x)
                call = (lambda x=x: send(x)) if side == "send" else (lambda m=message: receive(m))
                seconds.append(median_s(call, repeats))
            per_value = max(0.0, (seconds[1] - seconds[0]) / (sizes[1] - sizes[0]))
            fits.append((max(0.0, seconds[0] - per_value * sizes[0]), per_value))
        (send_call, send_value), (receive_call, receive_value) = fits
        return cls(send_call, send_value, receive_call, receive_value)


@dataclass(frozen=True)
class Plan:
    """How one message of `numel` values travels, and what each way was priced at."""

    numel: int
    encoded: bool  # False: raw, as the values' own dtype
    chunk: int  # values per piece (== numel: one piece)
    seconds: float  # the chosen way's predicted time
    raw_s: float  # raw's predicted time

    @property
    def num_chunks(self) -> int:
        return max(1, math.ceil(self.numel / self.chunk))

    def pieces(self) -> list[tuple[int, int]]:
        """(start, stop) of each piece, in order."""
        return [
            (start, min(start + self.chunk, self.numel))
            for start in range(0, max(self.numel, 1), self.chunk)
        ]


def encoded_s(
    numel: int, chunk: int, link: LinkSpeed, speed: CodecSpeed, wire_bytes: Callable[[int], int]
) -> float:
    """Predicted seconds for `numel` values encoded in pieces of `chunk` (the pipeline in
    the module docstring; a last, shorter piece is priced as a whole one)."""
    chunk = min(chunk, numel)
    num_chunks = math.ceil(numel / chunk)
    encode, wire, decode = (
        speed.send_s(chunk),
        wire_bytes(chunk) / link.bytes_per_s,
        speed.receive_s(chunk),
    )
    return link.latency_s + encode + wire + decode + (num_chunks - 1) * max(encode, wire, decode)


def plan(
    numel: int,
    link: LinkSpeed,
    speed: CodecSpeed,
    wire_bytes: Callable[[int], int],
    raw_bytes_per_value: int = 4,
    pipeline: bool = True,
) -> Plan:
    """Raw, or encoded where it is priced at most `ENCODE_MARGIN` of raw's time, for a
    message of `numel` values; with `pipeline`, encoded in the best of one piece and pieces
    of MIN_CHUNK (2^20), 2^21, ... values.
    `wire_bytes(n)`: an encoded piece of n values' size on the wire (`payload_size`)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    raw = link.seconds(raw_bytes_per_value * numel)
    if numel == 0:
        return Plan(0, False, 1, raw, raw)
    chunks = [numel]
    if pipeline:
        chunk = MIN_CHUNK
        while chunk < numel:
            chunks.append(chunk)
            chunk *= 2
    best = min(chunks, key=lambda c: encoded_s(numel, c, link, speed, wire_bytes))
    seconds = encoded_s(numel, best, link, speed, wire_bytes)
    if seconds <= ENCODE_MARGIN * raw:
        return Plan(numel, True, best, seconds, raw)
    return Plan(numel, False, numel, raw, raw)
