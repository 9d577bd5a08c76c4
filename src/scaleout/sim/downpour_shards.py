"""A simulated Downpour replica's calls to the parameter-server shards (`DownpourSim`).

A shard is one actor: its calls queue and are served one at a time, on its machine's
cores (`_serve`); with represented replicas it stays busy for theirs too, while the caller
goes on (`_release`). A pull is the shard's side (its slice into the object store), the
slice across the link, and the caller's side; a push is the caller's side (encode, into
the object store), the payload across the link, and the shard's update (decode, the
optimizer's step, a checkpoint now and then), forwarded to the shard's backup when it has
one and answered once the backup has applied it too. Costs are the calibration's.

A pull from a shard on the replica's machine (`downpour.shared_memory`) is no call: once the
shard has applied the replica's own pushes, the caller copies the slice from shared memory,
waiting only for the update the shard holds its lock for (`scaleout.ps.shared`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import simpy

from scaleout.sim.calibration import MessageCost
from scaleout.sim.downpour_state import Replica, Shard
from scaleout.sim.engine import Process
from scaleout.sim.sync import checkpoint_bytes

if TYPE_CHECKING:
    from scaleout.sim.calibration import Calibration, ModelCost
    from scaleout.sim.engine import Cluster


class ShardCalls:
    """A mixin of `DownpourSim`: one replica's pulls and pushes, and the shards' side."""

    env: simpy.Environment
    cluster: Cluster
    cal: Calibration
    cost: ModelCost
    numel: int
    opts: Any  # DownpourSection
    train: Any  # TrainSection
    shards: list[Shard]
    scale: float
    pull_bytes: list[int]
    push_bytes: list[int]
    push_codecs: list[str]
    staleness: list[int]
    pushes: int
    pulls: int

    if TYPE_CHECKING:  # `ReplicaModes`

        def shard_optimizer(self) -> tuple[str, str]: ...
        def _pseudo_gradient(self, replica: Replica) -> Process: ...
        def _close_window(self, replica: Replica) -> Process: ...

    def _zero_s(self) -> float:
        """A replica zeroing its gradient after a push: as measured after a step (cold from
        memory) where the model was, else back to back."""
        if self.cost.zero_s is not None:
            return self.cost.zero_s
        return self.cal.zero_s(self.numel)

    def _state_bytes(self, shard: Shard) -> int:
        """What a shard's checkpoint writes: its values and its optimizer's state."""
        return checkpoint_bytes(shard.numel, self.shard_optimizer()[1])

    def _serve(self, shard: Shard, work: Process) -> Process:
        """`work` in the shard's actor, after the calls queued before (one at a time)."""
        turn = shard.queue.request()
        yield turn
        started = self.env.now
        yield from work
        own = self.env.now - started
        shard.busy += own * self.scale
        self._release(shard.queue, turn, own)

    def _release(self, queue: simpy.Resource, turn: simpy.Event, own: float) -> None:
        """Free a one-at-a-time actor after a call that took `own` seconds; with represented
        replicas it serves theirs too: it stays busy `(weight - 1) * own` longer, while the
        caller goes on."""
        if self.scale > 1:
            self.env.process(self._hold(queue, turn, (self.scale - 1) * own))
        else:
            queue.release(turn)

    def _hold(self, queue: simpy.Resource, turn: simpy.Event, seconds: float) -> Process:
        yield self.env.timeout(seconds)
        queue.release(turn)

    def _in_order(self, replica: Replica, shard: Shard) -> tuple[simpy.Event | None, simpy.Event]:
        """Ray runs one submitter's calls to an actor in the order they were submitted: a
        pull sent right after a push waits at the shard until that push (its payload still
        crossing the link) is applied. Returns (the call before this one, this one's end);
        taken as the call's process starts, which is in the order the calls were made."""
        before = replica.calls.get(shard.index)
        replica.calls[shard.index] = done = self.env.event()
        return before, done

    def _call(
        self, machine: int, cost: MessageCost, nbytes: int, caller: bool, times: float = 1.0
    ) -> Process:
        """The caller's or the callee's side of one call (its share of the wall time and of
        the cores it keeps busy, and its hops' wait for the cores on a busy machine), or of
        `times` such calls one after another."""
        wall, cpu = cost.sides(nbytes)[0 if caller else 1]
        hop_wait = times * self._hop_wait(nbytes)
        yield from self.cluster.machines[machine].call(times * wall, times * cpu, hop_wait)

    def _hop_wait(self, nbytes: int) -> float:
        """What one call of `nbytes` waits for cores on a machine whose cores are all busy
        (`LockstepCost.hop_wait_s`, measured for a replica's pull and push; 0 without)."""
        after = self.cal.lockstep.get("shard_calls")
        return after.hop_wait(nbytes) if after is not None else 0.0

    def _cross(
        self,
        source: int,
        dest: int,
        nbytes: int,
        kind: str,
        cost: MessageCost | None,
        to_shard: bool,
        alone: bool = False,
    ) -> Process:
        """`nbytes` of a call's object from machine `source` to `dest`: over the link and,
        meanwhile, Ray's object managers moving it between the nodes' stores (`cost`:
        `Calibration.pull_across` / `push_across`, wall time beyond the link's transfer
        and core-seconds, priced on the receiving machine; nothing on one machine or
        without a measurement). A shard's machine receives the represented replicas'
        objects too, meanwhile. `alone`: one flow on the links (`Cluster.send`)."""
        send = self.cluster.send(source, dest, nbytes, kind, alone)
        if source == dest or cost is None:
            yield from send
            return
        machine = self.cluster.machines[dest]
        wall = nbytes / machine.link.bandwidth + cost.seconds(nbytes)
        cpu = cost.cpu_s(nbytes)
        if to_shard and self.scale > 1:
            self.env.process(machine.call((self.scale - 1) * wall, (self.scale - 1) * cpu))
        yield self.env.all_of([self.env.process(send), self.env.process(machine.call(wall, cpu))])

    def _pull(
        self, replica: Replica, shard: Shard, versions: list[int] | None, kind: str = "pull"
    ) -> Process:
        """One shard's slice on its way to the replica: the shard's side and the crossing;
        its version into `versions` (None: a look that the next push's staleness ignores)."""
        nbytes = self.pull_bytes[shard.index]
        before, done = self._in_order(replica, shard)
        if before is not None:
            yield before
        if self.opts.shared_memory and shard.machine == replica.machine:
            if shard.applying is not None:  # its lock, held for an update
                yield shard.applying
            done.succeed()
            if versions is not None:
                versions[shard.index] = shard.version
            yield from self.cluster.send(shard.machine, replica.machine, nbytes, kind)
            return
        # the shard puts its slice into the object store
        yield from self._serve(shard, self._call(shard.machine, self.cal.pull, nbytes, False))
        done.succeed()
        if versions is not None:
            versions[shard.index] = shard.version
        across = self.cal.pull_across
        yield from self._cross(shard.machine, replica.machine, nbytes, kind, across, False)

    def _pull_all(self, replica: Replica, versions: list[int] | None, kind: str) -> Process:
        """`ParameterServer.pull_into`: every shard's slice asked for at once, waited for
        together, then taken and copied into the parameters one after another by the
        replica's one thread (the caller's sides in turn, not side by side)."""
        pulls = [self.env.process(self._pull(replica, s, versions, kind)) for s in self.shards]
        yield self.env.all_of(pulls)
        for nbytes in self.pull_bytes:
            yield from self._call(replica.machine, self.cal.pull, nbytes, caller=True)

    def _apply(self, replica: Replica, shard: Shard, base_version: int) -> Process:
        nbytes = self.push_bytes[shard.index]
        before, done = self._in_order(replica, shard)
        across = self.cal.push_across
        yield from self._cross(replica.machine, shard.machine, nbytes, "push", across, True)
        if before is not None:
            yield before
        yield from self._serve(shard, self._update(shard, nbytes, base_version))
        done.succeed()

    def _update(self, shard: Shard, nbytes: int, base_version: int) -> Process:
        """The shard takes a push: the call's callee side, decode, the optimizer's step
        (DiLoCo: the outer one), and every `shard_checkpoint_every` updates a checkpoint."""
        codec = self.push_codecs[shard.index]
        seconds = self.cal.codec_s(codec, shard.numel, "decode") + self.cal.apply_s(
            self.shard_optimizer()[0], shard.numel
        )
        yield from self._call(shard.machine, self.cal.push, nbytes, caller=False)
        replicated = None
        if shard.backup is not None:  # the payload to the backup, put into the object store
            yield from self._call(shard.machine, self.cal.push, nbytes, caller=True)
            replicated = self.env.process(self._replicate(shard, nbytes, seconds))
        shard.applying = applied = self.env.event()  # its lock, while it steps
        yield from self.cluster.machines[shard.machine].work(seconds)
        shard.applying = None
        applied.succeed()
        if replicated is not None:  # the push is answered once the backup has applied it
            yield replicated
        self.staleness.append(round((shard.version - base_version) * self.scale))
        shard.version += 1
        shard.updates += 1
        every = self.opts.shard_checkpoint_every
        if every and shard.updates % every == 0:
            state = self._state_bytes(shard)
            yield self.env.timeout(state / self.cal.checkpoint_bytes_per_s)

    def _replicate(self, shard: Shard, nbytes: int, seconds: float) -> Process:
        """The backup's side of a push (`ParameterShard.replicate`): the payload crosses to
        the backup's machine, which applies it as the primary does, meanwhile."""
        assert shard.backup is not None
        across = self.cal.push_across
        # one flow: the primary's actor forwards the represented replicas' pushes one after
        # another, each while it holds its queue (`_release`), not all at once
        yield from self._cross(shard.machine, shard.backup, nbytes, "backup", across, True, True)
        if self.scale > 1:  # it applies the represented replicas' pushes too, meanwhile
            self.env.process(self._backup_side(shard.backup, nbytes, seconds, self.scale - 1))
        yield from self._backup_side(shard.backup, nbytes, seconds, 1.0)

    def _backup_side(self, machine: int, nbytes: int, seconds: float, times: float) -> Process:
        """`times` pushes taken and applied by a backup on `machine`: priced by what they
        cost, not by how long the one simulated took (on a busy machine that would count
        its wait for the cores as more work)."""
        yield from self._call(machine, self.cal.push, nbytes, caller=False, times=times)
        yield from self.cluster.machines[machine].work(times * seconds)

    def _fetch(self, replica: Replica, versions: list[int]) -> Process:
        self.pulls += 1
        yield from self._pull_all(replica, versions, "pull")

    def _push(self, replica: Replica) -> Process:
        """A push from the compute thread (threads off, a flush, or a bounded replica's
        release at its chunk's end), of the steps since its last: DiLoCo's pseudo-gradient
        computed, the previous push applied and its answers collected
        (`_collect(wait=True)`), the gradient sent, its buffer zeroed; with a staleness
        bound, this push applied too and its window closed."""
        machine = self.cluster.machines[replica.machine]
        replica.steps_pushed = replica.steps
        yield from self._pseudo_gradient(replica)
        if replica.pending:
            yield self.env.all_of(replica.pending)
            yield from machine.work(self.cal.collect_push_s(len(replica.pending)))
        replica.pending = []
        yield from self._send(replica, list(replica.versions))
        yield from machine.work(self._zero_s())
        yield from self._close_window(replica)

    def _send(self, replica: Replica, versions: list[int]) -> Process:
        """Encode the gradient per shard and put each slice into the object store; the
        shards apply them meanwhile (`replica.pending`)."""
        machine = self.cluster.machines[replica.machine]
        encode = sum(
            self.cal.codec_s(self.push_codecs[s.index], s.numel, "encode") for s in self.shards
        )
        yield from machine.work(encode)
        for nbytes in self.push_bytes:  # into the object store, a call per shard
            yield from self._call(replica.machine, self.cal.push, nbytes, caller=True)
        self.pushes += 1
        replica.pending += [
            self.env.process(self._apply(replica, s, versions[s.index])) for s in self.shards
        ]
