"""One simulated setting's answer: throughput, where the time goes, what crossed the wire."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# What limits a run when it is the busiest: a role's utilisation names the bottleneck.
ROLES = ("replica compute", "worker compute", "shard queue", "coordinator", "network link", "cores")


def bottleneck(utilisation: dict[str, float]) -> str:
    """The busiest role ("cores" only when the machine's cores are busier than any role)."""
    if not utilisation:
        return "?"
    return max(utilisation, key=lambda role: utilisation[role])


@dataclass
class Result:
    machines: int
    examples_per_s: float  # the simulated run's examples over its time (no start-up)
    step_s: float  # time per step of the run (a step: one minibatch of one replica/worker)
    run_s: float
    steps: int
    bottleneck: str
    utilisation: dict[str, float]
    wire_bytes: int  # between machines
    local_bytes: int  # between processes of one machine
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    steady_examples_per_s: float | None = None  # after a warm start, when there is one
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """A JSON row (simulate.json)."""
        out = asdict(self)
        out.update(out.pop("extra"))
        return out
