"""One simulated setting's answer: throughput, where the time goes, what crossed the wire."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from scaleout.sim.engine import Cluster


def bottleneck(utilisation: dict[str, float]) -> str:
    """The busiest role ("cores" only when the machine's cores are busier than any role)."""
    if not utilisation:
        return "?"
    return max(utilisation, key=lambda role: utilisation[role])


@dataclass
class Result:
    machines: int
    # the run's examples over the time `scaleout train` stamps on its last metrics line:
    # no start-up, and the last chunk's answer is the end (the final evaluation and
    # checkpoint come after that stamp, and are in `run_s`)
    examples_per_s: float
    step_s: float  # time per step of the run (a step: one minibatch of one replica/worker)
    run_s: float
    steps: int
    bottleneck: str
    utilisation: dict[str, float]
    wire_bytes: int  # between machines
    local_bytes: int  # between processes of one machine
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    # after a warm start (Downpour) or the first iteration (Sandblaster), when there is one;
    # utilisation is of that steady part too
    steady_examples_per_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_run(
        cls,
        cluster: Cluster,
        roles: dict[str, float],
        steps: int,
        examples: int,
        step_s: float,
        steady_examples_per_s: float | None,
        extra: dict[str, Any],
        trained_s: float,
        after: dict[str, float] | None = None,
        num_machines: int | None = None,
    ) -> Result:
        """A finished simulation's result: the strategy's `roles` (utilisation by role),
        then the busiest link and cores of any machine (and `after`), the traffic;
        `trained_s`: when the last training chunk was answered; `num_machines`: the run's,
        when the simulation used other machines (representatives of them)."""
        elapsed, machines = cluster.env.now, cluster.machines
        utilisation = {
            **roles,
            "network link": max(max(m.tx.utilisation(), m.rx.utilisation()) for m in machines),
            "cores": max(m.cores.utilisation() for m in machines),
            **(after or {}),
        }
        traffic = cluster.traffic
        return cls(
            machines=num_machines or len(machines),
            examples_per_s=examples / trained_s,
            steady_examples_per_s=steady_examples_per_s,
            step_s=step_s,
            run_s=elapsed,
            steps=steps,
            bottleneck=bottleneck(utilisation),
            utilisation=utilisation,
            wire_bytes=traffic.wire_bytes,
            local_bytes=traffic.local_bytes,
            bytes_by_kind=dict(traffic.by_kind),
            extra=extra,
        )

    def row(self) -> dict[str, Any]:
        """A JSON row (simulate.json)."""
        out = asdict(self)
        out.update(out.pop("extra"))
        return out
