"""A codec that sends a message 8-bit only where that is faster on a given link.

`OnLink(codec, link)` is the codec for the messages of a collective (DDP's gradient buckets,
the model-parallel exchanges), the counterpart of `scaleout.ps.wire.Wire` for the
parameter server's pushes. Both ends of a collective message must make the same choice
(the sizes of an all-gather or an all-to-all are agreed in advance, and a receiver must
know how to read what arrives), so every rank prices with the same `CodecSpeed`:
`agree(group)` measures the codec in each process and takes, per term, the slowest rank's
(an all-reduce of four numbers, once, before the first message). The choice is then a
function of the message's size alone, the same on every rank.

- a point-to-point message (an exchange's piece): `transfer.plan` in one piece, raw or
  encoded where that is priced at most `transfer.ENCODE_MARGIN` of raw's time;
- a gradient bucket of `numel` values among W ranks: raw is DDP's all-reduce, 8 bits the
  hook's encode, all-gather of the W payloads, decodes and sum (`average_8bit`). `agree`
  times both schedules between the ranks at `TIMED_SIZES` (medians, the slowest rank's)
  and compares them at a bucket's size, interpolated between the two sizes around it
  (extrapolated along the last two beyond them); without them (one process, a
  simulation) both are priced on `link` as rings (`allreduce_s`). The timed schedules hold
  what the rings leave out: the collectives' own fixed costs, and the codec's work on
  every rank at once, which the rings misprice at both small and large sizes. Timed sizes
  are interpolated rather than fitted with one line, so that one disturbed timing moves
  the price only between its neighbours.

Without `agree` (one process, a simulation) the speed given, or measured in this process,
decides.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from scaleout.compress.codecs import Codec
from scaleout.compress.feedback import ErrorFeedback
from scaleout.compress.flat_collectives import all_gather_flat
from scaleout.compress.payload import Encoded, pack, payload_size, unpack
from scaleout.compress.transfer import ENCODE_MARGIN, CodecSpeed, LinkSpeed, median_s, plan


def measure_speed(codec: Codec) -> CodecSpeed:
    """`codec`'s cost per message in this process: encode and serialise, then parse and
    decode (`CodecSpeed.measure` at its default sizes and repeats; no residual or absmax
    state is kept)."""
    probe = ("measure_speed",)
    try:
        return CodecSpeed.measure(
            lambda x: codec.encode(x, probe).to_bytes(),
            lambda data: codec.decode(Encoded.from_bytes(data)).float(),
        )
    finally:
        codec.forget(probe)


def allreduce_s(
    numel: int, world: int, link: LinkSpeed, speed: CodecSpeed | None, wire_bytes: int
) -> float:
    """Seconds to average a bucket of `numel` float32 values over `world` ranks on `link`:
    a ring all-reduce raw (`speed` None), else the hook's encode, ring all-gather of
    `wire_bytes` payloads and `world` decodes."""
    if speed is None:
        return 2 * (world - 1) * link.seconds(4 * numel // world)
    gather = (world - 1) * link.seconds(wire_bytes)
    return speed.send_s(numel) + gather + world * speed.receive_s(numel)


class OnLink(Codec):
    """`codec`, for messages that cross `link`: `encodes(numel)` and
    `encodes_allreduce(numel, world)` say which go 8-bit (see the module docstring);
    `raw(x, key)` is what a message sent raw carries (with error feedback, x plus the
    residual, which it spends)."""

    def __init__(self, codec: Codec, link: LinkSpeed, speed: CodecSpeed | None = None) -> None:
        if isinstance(codec, OnLink):
            raise ValueError("OnLink(codec): codec is on a link already")
        super().__init__(codec.nonfinite)
        self.codec, self.name, self.link, self.speed = codec, codec.name, link, speed
        base = codec.codec if isinstance(codec, ErrorFeedback) else codec
        self.block_size = int(getattr(base, "block_size", None) or 0)
        self._choices: dict[tuple[int, int], bool] = {}
        # a bucket's average as `agree` timed it between `timed_world` ranks: seconds raw
        # and 8-bit at each of `TIMED_SIZES`
        self.timed: tuple[list[float], list[float]] | None = None
        self.timed_world = 0

    @property
    def options(self) -> dict[str, object]:
        return self.codec.options

    def __repr__(self) -> str:
        return f"OnLink({self.codec!r}, {self.link!r})"

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Encoded:
        return self.codec.encode(x, key)

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.decode(encoded, out)

    def forget(self, key: Hashable) -> None:
        self.codec.forget(key)

    def raw(self, x: torch.Tensor, key: Hashable | None = None) -> torch.Tensor:
        """What a message of `x` sent raw carries (the wrapped codec's `raw`)."""
        return self.codec.raw(x, key)

    def agree(self, group: dist.ProcessGroup | None = None, buckets: bool = True) -> None:
        """Measure the codec here and, for DDP's `buckets`, time a bucket's average raw and
        8-bit between the ranks; price with the slowest rank's costs from now on (a
        collective: every rank of `group` calls it alike, once, before its first message;
        the timing sends `TIMED_REPEATS` buckets of each of `TIMED_SIZES` both ways, so it
        takes longer the slower the link)."""
        mine = self.speed or measure_speed(self.codec)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            base = self.codec.codec if isinstance(self.codec, ErrorFeedback) else self.codec
            both = (False, True) if buckets else ()
            timed = [_time_average(coded, base, group) for coded in both]
            terms = [*mine.to_dict().values(), *(t for times in timed for t in times)]
            agreed = torch.tensor(terms, dtype=torch.float64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            values = agreed.tolist()
            mine = CodecSpeed(*values[:4])
            if buckets:
                count = len(TIMED_SIZES)
                self.timed = (values[4 : 4 + count], values[4 + count :])
                self.timed_world = dist.get_world_size(group)
        self.speed = mine
        self._choices.clear()

    def _speed(self) -> CodecSpeed:
        if self.speed is None:  # one process: its own cost decides
            self.speed = measure_speed(self.codec)
        return self.speed

    def _wire_bytes(self, numel: int) -> int:
        return payload_size(self.name, (numel,), self.block_size)

    def encodes(self, numel: int) -> bool:
        if (numel, 1) not in self._choices:
            chosen = plan(numel, self.link, self._speed(), self._wire_bytes, pipeline=False)
            self._choices[(numel, 1)] = chosen.encoded
        return self._choices[(numel, 1)]

    def encodes_allreduce(self, numel: int, world: int) -> bool:
        """Whether a bucket of `numel` values averaged over `world` ranks goes 8-bit."""
        if (numel, world) not in self._choices:
            if self.timed is not None and world == self.timed_world:
                raw, coded = (_interpolate(TIMED_SIZES, times, numel) for times in self.timed)
            else:
                speed, wire = self._speed(), self._wire_bytes(numel)
                raw = allreduce_s(numel, world, self.link, None, 0)
                coded = allreduce_s(numel, world, self.link, speed, wire)
            self._choices[(numel, world)] = coded <= ENCODE_MARGIN * raw
        return self._choices[(numel, world)]


def average_8bit(
    x: torch.Tensor, codec: Codec, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The mean of `x` over the ranks as `ddp_hook` takes it, at once: encode, pack, one
    all-gather of the payloads, decode each and sum them in rank order, divide."""
    world = dist.get_world_size(group)
    encoded = codec.encode(x)
    payload = pack(encoded)
    gathered = torch.empty(world * payload.numel(), dtype=torch.uint8)
    all_gather_flat(gathered, payload, group=group)
    mean, _ = mean_of_payloads(gathered, encoded, codec, world)
    return mean.view(x.shape)


def mean_of_payloads(
    gathered: torch.Tensor, like: Encoded, codec: Codec, world: int, keep: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mean (float32, flat) of the `world` packed payloads laid out like `like` in
    `gathered`, decoded and summed in rank order (so every rank gets the same bits); and
    rank `keep`'s decoded values (for error feedback), or None."""
    total = torch.zeros(like.numel, dtype=torch.float32, device=gathered.device)
    kept = None
    for source, chunk in enumerate(gathered.view(world, -1)):  # rank order
        decoded = codec.decode(unpack(chunk, like)).view(-1)
        total += decoded.float()
        if source == keep:
            kept = decoded
    return total.div_(world), kept


TIMED_SIZES = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)  # values
TIMED_REPEATS = 7


def _time_average(coded: bool, codec: Codec, group: dist.ProcessGroup | None) -> list[float]:
    """Median seconds of a bucket's average over `group` at each of `TIMED_SIZES`, raw (an
    all-reduce) or 8-bit (`average_8bit`); the largest first, so that the link is busy
    when the small ones are timed, as in a run."""
    seconds = {}
    for numel in sorted(TIMED_SIZES, reverse=True):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        if coded:
            call = lambda x=x: average_8bit(x, codec, group)  # noqa: E731
        else:
            call = lambda x=x: dist.all_reduce(x.clone(), group=group)  # noqa: E731
        seconds[numel] = median_s(call, TIMED_REPEATS)
    return [seconds[numel] for numel in TIMED_SIZES]


def _interpolate(sizes: tuple[int, ...], values: list[float], numel: int) -> float:
    """`values` (at increasing `sizes`) at `numel`: linear between the two sizes around it,
    along the first or last two beyond them."""
    right = next((i for i, size in enumerate(sizes) if size >= numel), len(sizes) - 1)
    right = max(right, 1)
    (x0, y0), (x1, y1) = (sizes[right - 1], values[right - 1]), (sizes[right], values[right])
    return max(y0 + (y1 - y0) * (numel - x0) / (x1 - x0), 0.0)
