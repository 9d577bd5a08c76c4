"""A simulated Downpour replica's modes (`downpour.mode`, `downpour.max_staleness`), on top
of its shard calls (`DownpourSim`).

DiLoCo (`mode = "diloco"`, `ReplicaClient.after_step` and `push`): after each step's compute
the replica steps `train.optimizer` on the whole model and zeroes its gradient, on its own
machine; each fetch copies the fetched parameters aside (the anchor); each push first
computes the pseudo-gradient into the gradient buffer (anchor - parameters, scaled by
1 / replicas where there are several: a pass over the model each). Bytes are a gradient
push's and a fetch's, one of each every `n_push` (= `n_fetch`) steps. The shards step the
outer optimizer on each push: Nesterov's momentum SGD priced as `"momentum"` per value (the
same work per value), plain SGD as `"sgd"`; their checkpoints hold its state.
The replica's step is priced per value (`Calibration.apply_s`), as a shard's update is.

Bounded staleness (`max_staleness = S`, `ReplicaClient._open_windows`, `ps.staleness.Windows`):
before a step with no window open the replica asks shard 0 to open its window, a small call
served in shard 0's queue, decided there by the library's own `Windows`; a refused replica
sleeps (`GATE_FIRST_PAUSE_S`, doubling to `GATE_MAX_PAUSE_S`) and asks again. Once it is
open the replica fetches (as it does before every step whose count `n_fetch` divides). A
push is due `n_push` steps after the last one; after it the replica waits until every shard
applied it (the answers collected), then closes its window with another such call. At the
end of a chunk a window still open is pushed at once with the steps it holds
(`ReplicaClient.release`: every shard's slice, as a whole push), applied and closed, so no
replica idles holding one: a chunk of c steps makes ceil(c / n_push) pushes. A window left
open longer than `downpour.timeout_s` is closed by the next one asked for
(`StalenessPolicy.expire_s`), in simulated time, and counted (`windows_expired`); every
push's staleness respects the bound but there. Where representatives stand for `weight`
replicas each, a simulated update counts `weight` of the run's, so the gate bounds simulated
windows by `floor(S / weight)`: a push's staleness in the run's updates then stays within
S (a coarser gate than the run's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import simpy

from scaleout.ps.staleness import Windows
from scaleout.sim.downpour_state import Replica, Shard
from scaleout.sim.engine import Process

if TYPE_CHECKING:
    from scaleout.sim.calibration import Calibration, MessageCost
    from scaleout.sim.engine import Cluster

GATE_FIRST_PAUSE_S = 0.001  # `ReplicaClient._open_windows`: the first sleep after a refusal
GATE_MAX_PAUSE_S = 0.05  # doubling up to this


class Gate:
    """Shard 0's windows (`Windows`, the library's decision and expiry, at simulated
    times) and the calls made to it."""

    def __init__(self, bound: int, expire_s: float) -> None:
        self.bound = bound  # in the run's updates
        self.windows = Windows(bound, expire_s)
        self.calls = 0

    def scale(self, weight: float) -> None:
        """Each simulated update stands for `weight` of the run's from now on."""
        self.windows.bound = math.floor(self.bound / weight)

    def try_open(self, client: str, now: float) -> bool:
        """`Windows.try_open` at simulated time `now`."""
        return self.windows.try_open(client, client, now=now)

    def close(self, client: str) -> None:
        self.windows.close(client)


class ReplicaModes:
    """A mixin of `DownpourSim`: DiLoCo's inner steps and the staleness bound's gate."""

    env: simpy.Environment
    cluster: Cluster
    cal: Calibration
    opts: Any  # DownpourSection
    train: Any  # TrainSection
    numel: int
    num_replicas: int
    shards: list[Shard]
    gate: Gate | None

    if TYPE_CHECKING:  # `ShardCalls`, `ReplicaThreads`

        def _serve(self, shard: Shard, work: Process) -> Process: ...
        def _call(
            self, machine: int, cost: MessageCost, nbytes: int, caller: bool, times: float = 1.0
        ) -> Process: ...
        def _in_order(
            self, replica: Replica, shard: Shard
        ) -> tuple[simpy.Event | None, simpy.Event]: ...
        def _copy(self, replica: Replica) -> Process: ...
        def _zero_s(self) -> float: ...

    @property
    def diloco(self) -> bool:
        return bool(self.opts.mode == "diloco")

    def shard_optimizer(self) -> tuple[str, str]:
        """What a shard steps on a push: (the optimizer its update is priced as, the one
        whose state its checkpoints hold)."""
        if not self.diloco:
            return self.train.optimizer, self.train.optimizer
        outer = self.opts.outer_optimizer
        return ("sgd" if outer == "sgd" else "momentum"), outer

    # --- DiLoCo ----------------------------------------------------------------------------

    def _inner_step(self, replica: Replica) -> Process:
        """DiLoCo, after a step's compute: `train.optimizer` on the whole model, then the
        gradient zeroed (`after_step`), on the replica's machine; nothing otherwise."""
        if not self.diloco:
            return
        seconds = self.cal.apply_s(self.train.optimizer, self.numel) + self._zero_s()
        yield from self.cluster.machines[replica.machine].work(seconds)

    def _anchor(self, replica: Replica) -> Process:
        """DiLoCo, after a fetch: the fetched parameters copied aside."""
        if self.diloco:
            yield from self._copy(replica)

    def _pseudo_gradient(self, replica: Replica) -> Process:
        """DiLoCo, before a push: anchor - parameters into the gradient buffer, scaled by
        1 / replicas where there are several."""
        if not self.diloco:
            return
        for _ in range(2 if self.num_replicas > 1 else 1):
            yield from self._copy(replica)

    # --- bounded staleness -----------------------------------------------------------------

    def _gate_call(self, replica: Replica, decide: Callable[[], bool]) -> Process:
        """One small call to shard 0 (after this replica's calls before it), decided by
        `decide` as the shard serves it; returns its answer."""
        shard = self.shards[0]
        before, done = self._in_order(replica, shard)
        assert self.gate is not None
        self.gate.calls += 1
        yield from self._call(replica.machine, self.cal.pull, 0, caller=True)
        yield from self.cluster.send(replica.machine, shard.machine, 0, "gate")
        if before is not None:
            yield before
        answer: list[bool] = []

        def serve() -> Process:
            yield from self._call(shard.machine, self.cal.pull, 0, caller=False)
            answer.append(decide())

        yield from self._serve(shard, serve())
        done.succeed()
        yield from self.cluster.send(shard.machine, replica.machine, 0, "gate")
        return answer[0]

    def _open_window(self, replica: Replica) -> Process:
        """Ask shard 0 until it opens this replica's window (nothing without a bound); the
        seconds waited go to `replica.wait_s` and `replica.waits`."""
        gate = self.gate
        if gate is None:
            return
        started, pause = self.env.now, GATE_FIRST_PAUSE_S
        client = f"replica{replica.index}"

        def opens() -> bool:
            return gate.try_open(client, self.env.now)

        while not (yield from self._gate_call(replica, opens)):
            yield self.env.timeout(pause)
            pause = min(2 * pause, GATE_MAX_PAUSE_S)
        replica.window_open = True
        replica.wait_s += self.env.now - started
        replica.waits.append(self.env.now - started)

    def _close_window(self, replica: Replica) -> Process:
        """After a push: wait until every shard applied it, then close the window."""
        gate = self.gate
        if gate is None:
            return
        if replica.pending:
            yield self.env.all_of(replica.pending)
            machine = self.cluster.machines[replica.machine]
            yield from machine.work(self.cal.collect_push_s(len(replica.pending)))
            replica.pending = []
        client = f"replica{replica.index}"

        def closes() -> bool:
            gate.close(client)
            return True

        yield from self._gate_call(replica, closes)
        replica.window_open = False

    def modes_report(self, replicas: list[Replica]) -> dict[str, Any]:
        """The result's fields of the modes: the mode, and with a bound what the gate did
        (`wait_s_mean`: seconds a replica waited at the gate per push window)."""
        out: dict[str, Any] = {"mode": self.opts.mode}
        gate = self.gate
        if gate is None:
            return out
        waits = [w for r in replicas for w in r.waits]
        out.update(
            max_staleness=gate.bound,
            wait_s_mean=sum(waits) / len(waits) if waits else 0.0,
            wait_s_max=max(waits, default=0.0),
            windows_refused=gate.windows.refused,
            windows_expired=gate.windows.expired,
            gate_calls=gate.calls,
        )
        return out
