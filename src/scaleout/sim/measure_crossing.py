"""What a shard call costs beyond itself when the shard runs on another machine.

On one machine a pull's slice and a push's gradient move through the node's shared-memory
object store. Across nodes Ray moves each object from one node's store to the other's (the
raylets' object managers, the kernel's network stack on both ends): more wall time than the
bytes' transfer over the link, and more core-seconds. Measured between two
testnet hosts (network namespaces) of one machine (`benchmarks.testnet.measure_crossing`):
the same calls through a real one-shard `ParameterServer` with the shard on the caller's
host and on the other host, the caller on host 0; the difference, less the link's
transfer of the payload (the simulator adds the link itself, shared with the other
transfers on it), is `Calibration.pull_across` / `push_across`.

`python -m scaleout.sim.measure_crossing ADDRESS APPLY_NS BYTES_PER_S SIZE...` joins the
Ray cluster at ADDRESS (nodes offering the resources `NEAR` and `FAR`) and prints one JSON
line: {"pull": MessageCost, "push": MessageCost}.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from scaleout.sim.calibration import MessageCost
from scaleout.sim.measure_calls import CallCost, measure_shard_messages, message_cost

NEAR, FAR = "near", "far"  # custom Ray resources: the caller's node, the other one


def across(near: MessageCost, far: MessageCost, bytes_per_s: float) -> MessageCost:
    """The cost of `far`'s calls beyond `near`'s at the same sizes: wall time less the
    payload's transfer at `bytes_per_s`, core-seconds (all processes, the caller's)."""
    if near.measured_bytes != far.measured_bytes or not near.measured_core_s:
        raise ValueError("near and far calls need core-seconds measured at the same sizes")
    calls = [
        CallCost(
            wall_s=max(far_s - near_s - nbytes / bytes_per_s, 1e-6),
            cpu_s=max(far_core - near_core, 1e-6),
            caller_cpu_s=max(far_caller - near_caller, 0.0),
        )
        for nbytes, near_s, far_s, near_core, far_core, near_caller, far_caller in zip(
            near.measured_bytes,
            near.measured_s,
            far.measured_s,
            near.measured_core_s,
            far.measured_core_s,
            near.measured_caller_core_s,
            far.measured_caller_core_s,
            strict=True,
        )
    ]
    return message_cost(near.measured_bytes, calls)


def measure(
    apply_ns: float, bytes_per_s: float, sizes: Sequence[int]
) -> tuple[MessageCost, MessageCost]:
    """(pull, push) beyond the same calls on one node, from a driver joined to a cluster
    whose nodes offer `NEAR` (this one) and `FAR`."""
    near_pull, near_push, _ = measure_shard_messages(apply_ns, sizes, resource=NEAR)
    far_pull, far_push, _ = measure_shard_messages(apply_ns, sizes, resource=FAR)
    return across(near_pull, far_pull, bytes_per_s), across(near_push, far_push, bytes_per_s)


def main(argv: list[str]) -> None:
    if len(argv) < 4:
        raise SystemExit("usage: measure_crossing ADDRESS APPLY_NS BYTES_PER_S SIZE...")
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(address=argv[0], logging_level="error")
    try:
        pull, push = measure(float(argv[1]), float(argv[2]), [int(s) for s in argv[3:]])
    finally:
        ray.shutdown()
    print(json.dumps({"pull": pull.model_dump(), "push": push.model_dump()}))


if __name__ == "__main__":
    main(sys.argv[1:])
