"""What a simulated Downpour run reports (`DownpourSim`): utilisation from the end of the
warm start, the represented replicas' traffic and calls counted in, throughput, staleness
and each replica's compute thread per step, as the real run's pushes.jsonl has them per push.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from scaleout.sim.downpour_modes import Gate
from scaleout.sim.downpour_state import Replica, Shard
from scaleout.sim.result import Result

if TYPE_CHECKING:
    import simpy

    from scaleout.sim.engine import Cluster
    from scaleout.sim.setting import Setting


class RunReport:
    """A mixin of `DownpourSim`: the steady part's start, and the run's `Result`."""

    env: simpy.Environment
    cluster: Cluster
    setting: Setting
    opts: Any  # DownpourSection
    train: Any  # TrainSection
    shards: list[Shard]
    replicas: list[Replica]
    gate: Gate | None
    num_replicas: int
    weight: float
    scale: float
    warm_counts: tuple[int, int, int, dict[str, int]]
    warm_calls: tuple[int, int]
    staleness: list[int]
    pushes: int
    pulls: int
    examples: int
    steady_since: float | None
    driver_busy: float
    paused_s: float
    trained_s: float
    step_ends: list[float]

    if TYPE_CHECKING:  # `ReplicaModes`

        def modes_report(self, replicas: list[Replica]) -> dict[str, Any]: ...

    def _mark(self) -> None:
        """Utilisation from here on: the warm start's one replica would hide the bottleneck
        of the steady part."""
        self.steady_since = self.env.now
        if self.weight > 1:  # the shards serve the represented replicas too
            self.scale = self.weight
            traffic = self.cluster.traffic
            self.warm_counts = (
                traffic.wire_bytes,
                traffic.local_bytes,
                traffic.messages,
                dict(traffic.by_kind),
            )
            self.warm_calls = (self.pushes, self.pulls)
            for shard in self.shards:
                self.cluster.machines[shard.machine].flows = self.weight
            if self.gate is not None:
                self.gate.scale(self.weight)
        self.cluster.mark()
        for shard in self.shards:
            shard.busy = 0.0
        for replica in self.replicas:
            replica.compute_s = replica.fetch_s = replica.push_s = replica.wait_s = 0.0
            replica.steady_steps = 0
        self.driver_busy = 0.0

    def _count_represented(self) -> None:
        """Traffic and calls since the warm start, times `weight`."""
        traffic, (wire, local, messages, by_kind) = self.cluster.traffic, self.warm_counts
        extra = self.weight - 1
        traffic.wire_bytes += round(extra * (traffic.wire_bytes - wire))
        traffic.local_bytes += round(extra * (traffic.local_bytes - local))
        traffic.messages += round(extra * (traffic.messages - messages))
        for kind, nbytes in traffic.by_kind.items():
            traffic.by_kind[kind] = nbytes + round(extra * (nbytes - by_kind.get(kind, 0)))
        self.pushes += round(extra * (self.pushes - self.warm_calls[0]))
        self.pulls += round(extra * (self.pulls - self.warm_calls[1]))

    def _result(self, total: int) -> Result:
        elapsed = self.env.now
        examples = self.examples
        # The steady rate: steps as they end, in the middle of the run after the warm start
        # (without the replicas' first fetches all at once, or the last chunks ending alone).
        ends, first = self.step_ends, self.opts.warmstart_steps
        low, high = first + (len(ends) - first) // 5, first + 9 * (len(ends) - first) // 10
        steady = None
        if high < len(ends) and ends[high] > ends[low]:
            steady = (high - low) * self.scale * self.train.batch_size / (ends[high] - ends[low])
        span = elapsed - (self.steady_since or 0.0)
        replica_busy = [r.compute_s / span for r in self.replicas if r.steps] if span else []
        roles = {
            "replica compute": statistics.mean(replica_busy) if replica_busy else 0.0,
            "shard queue": max(s.busy / span for s in self.shards) if span else 0.0,
            "driver": self.driver_busy / span if span else 0.0,
            "evaluation pauses": self.paused_s / span if span else 0.0,
        }
        stale = self.staleness or [0]
        if self.weight > 1:  # what the represented replicas sent too
            self._count_represented()
        return Result.of_run(
            self.cluster,
            roles,
            steps=total,
            examples=examples,
            step_s=elapsed / total,
            steady_examples_per_s=steady,
            trained_s=self.trained_s,
            num_machines=self.setting.machines,
            extra={
                "replicas": self.num_replicas,
                "simulated_replicas": len(self.replicas),
                "shards": len(self.shards),
                "pushes": self.pushes,
                "pulls": self.pulls,
                "staleness_mean": statistics.mean(stale),
                "staleness_max": max(stale),
                "staleness_histogram": _histogram(stale),
                # a replica's compute thread per step after the warm start, as pushes.jsonl
                # has it per push (compute_s, fetch_s, push_s)
                "replica_step_s": self._replica_step_s(),
                **self.modes_report(self.replicas),
            },
        )

    def _replica_step_s(self) -> dict[str, float]:
        active = [r for r in self.replicas if r.steady_steps]
        if not active:
            return {}
        return {
            part: statistics.mean(getattr(r, f"{part}_s") / r.steady_steps for r in active)
            for part in ("compute", "fetch", "push", "wait")
        }


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
