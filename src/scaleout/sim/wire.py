"""One message between two machines, as the simulator prices it: encoded on the sender's
cores, sent over the link (the latency, then the bytes on the sender's tx and the
receiver's rx), decoded on the receiver's cores. The 8-bit paper's transfer speed-ups are
this sum for fp32 against a codec's."""

from __future__ import annotations

from scaleout.compress.payload import payload_size
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
