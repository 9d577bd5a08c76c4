"""One message between two machines, as the simulator prices it: encoded on the sender's
cores, sent over the link (the latency, then the bytes on the sender's tx and the
receiver's rx), decoded on the receiver's cores. The 8-bit paper's transfer speed-ups are
this sum for fp32 against a codec's."""

from __future__ import annotations

from scaleout.compress import CompressSection
from scaleout.compress.payload import payload_size
from scaleout.compress.transfer import CodecSpeed
from scaleout.ps.wire import Wire
from scaleout.sim.calibration import Calibration
from scaleout.sim.engine import Cluster, Link


def transfer_s(
    calibration: Calibration, link: Link, numel: int, codec: str = "fp32", block_size: int = 0
) -> float:
    """Seconds from the sender's tensor of `numel` fp32 values to the receiver's, through
    `codec` ("fp32": as is; `block_size` 0: one scale); the bytes are the library's
    payload (`payload_size`)."""
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    cluster = Cluster(2, float(calibration.cores), link)
    sender, receiver = cluster.machines
    nbytes = payload_size(codec, (numel,), block_size)

    def message():  # noqa: ANN202 - a SimPy process
        yield from sender.work(calibration.codec_s(codec, numel, "encode"))
        yield from cluster.send(0, 1, nbytes, "message")
        yield from receiver.work(calibration.codec_s(codec, numel, "decode"))

    done = cluster.env.process(message())
    cluster.run(done)
    return cluster.env.now


def codec_speed(calibration: Calibration, codec: str) -> CodecSpeed:
    """The calibrated codec cost as a call cost plus a cost per value (a line through its
    prices at 4k and 256k values), as `transfer.plan` takes it."""
    small, large = 1 << 12, 1 << 18
    fits = []
    for which in ("encode", "decode"):
        a, b = (calibration.codec_s(codec, n, which) for n in (small, large))
        per_value = max(0.0, (b - a) / (large - small))
        fits.append((max(0.0, a - per_value * small), per_value))
    (send_call, send_value), (receive_call, receive_value) = fits
    return CodecSpeed(send_call, send_value, receive_call, receive_value)


def wire_codec(calibration: Calibration, compress: CompressSection, numel: int) -> str:
    """The codec a parameter-server `Wire` sends `numel` values with: `compress.codec`, or
    fp32 where `compress.link` is set and raw is faster on it (the library's own choice,
    priced with the calibrated codec cost instead of one measured at run time)."""
    if compress.is_identity or compress.codec == "fp32":
        return "fp32"
    if compress.link is None:
        return compress.codec
    wire = Wire(compress, speed=codec_speed(calibration, compress.codec))
    return compress.codec if wire.encodes(numel) else "fp32"


def link_codec_speed(calibration: Calibration, compress: CompressSection) -> CodecSpeed | None:
    """The calibrated codec cost that a collective's codec on `compress.link` chooses raw or
    8-bit with (`CompressSection.build_for_collectives`); None without a link or a codec."""
    if compress.link is None or compress.codec == "fp32":
        return None
    return codec_speed(calibration, compress.codec)
