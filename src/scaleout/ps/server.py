"""The client side of the sharded parameter server.

`ParameterServer` holds the shard actors and their ranges of the flat parameter vector.
Pulls and pushes go to all shards at once (one Ray call per shard, in parallel): a pull
waits for every slice and writes it into the caller's flat buffer; a push returns at once
with one future per shard, so the caller can go on computing while the shards apply it.
The object is small and serialisable, so the driver hands it to every replica.

A shard on the caller's node is reached through shared memory (`scaleout.ps.shared`,
`shared_memory=True`): a pull copies its slice under its lock, without a call; a push
calls the shard with where the gradient lies in this client's shared memory: in the
buffer the replica accumulated it in (`gradient_buffer`), or in an inbox it is copied
into. A shard found dead there is asked through Ray, which handles the failure.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

from scaleout.compress import CompressSection
from scaleout.nn.optim import OptimizerOptions
from scaleout.ps import shared
from scaleout.ps.backup import BackupKeeper, BackupPolicy, shard_nodes
from scaleout.ps.layout import shard_ranges
from scaleout.ps.same_node import RETRY_SECONDS, SameNodeShards
from scaleout.ps.shard import ParameterShard, ShardLost
from scaleout.ps.staleness import StalenessPolicy
from scaleout.ps.wire import Wire
from scaleout.runtime import describe_failure, kill, reraise_user_error, restart_backoff_s, spawn

START_ATTEMPTS = 4  # a shard's start: the first and 3 more after it died while starting


@dataclass
class Push:
    """One shard's part of a push, kept until the shard acknowledges it (it is sent again
    after a failover or a restart)."""

    slot: int
    payload: Any  # an ObjectRef of the encoded slice, or a SharedSlice in our inbox
    base_version: int
    seq: int
    future: Any
    shard: Any = None  # the actor it was sent to last
    steps: int = 1  # training steps the gradient holds (the shards' schedule counts them)


class ParameterServer(SameNodeShards):
    """The client side of S shards holding one flat vector (`ranges[i]` on shard i).

    Each copy of the object (the driver's, each replica's) is one client with its own id:
    its pushes to shard i are numbered 1, 2, ... so that a push sent again after a failure
    is applied once. A client that finds a shard dead promotes its backup (when it has one)
    or waits for Ray to restart it from its checkpoint, then counts the acknowledged pushes
    the shard no longer holds (`updates_lost`: zero with a backup).
    """

    def __init__(
        self,
        shards: list[Any],
        ranges: list[tuple[int, int]],
        compress: CompressSection | None,
        backups: list[Any] | None = None,
        shared_memory: bool = True,
    ) -> None:
        self.shards = list(shards)
        self.backups = list(backups) if backups is not None else [None] * len(shards)
        self.ranges = ranges
        self.compress = compress
        self.wire = Wire(compress)  # pushes (gradients), as configured
        self.pull_wire = Wire()  # pulls (parameters) in fp32
        self.client = uuid.uuid4().hex
        self.seqs = [0] * len(shards)  # pushes sent to each shard
        self.acked = [0] * len(shards)  # the last push each shard acknowledged
        self.updates_lost = self.failovers = self.resent = 0
        self._unacked: list[list[Push]] = [[] for _ in shards]  # in flight, in order
        self._lock = threading.RLock()  # a replica's fetch and push threads share this
        self.keeper: Any = None  # starts the backups (the driver's copy ends it)
        self._initial: torch.Tensor | None = None  # until every shard holds its slice
        self._start_step = 0
        self._pending: list[Any] = []
        self._start_again: Callable[[int], Any] | None = None  # the driver's copy, starting
        self.shared_memory = shared_memory and shared.available()
        self._init_nearby()

    @classmethod
    def create(
        cls,
        initial: torch.Tensor,
        num_shards: int,
        optimizer: OptimizerOptions,
        compress: CompressSection | None = None,
        checkpoint_root: Path | None = None,
        checkpoint_every: int | None = None,
        checkpoint_seconds: float | None = None,
        max_restarts: int = 10,
        resource: str | None = None,
        wait: bool = True,
        backups: int = 0,
        shared_memory: bool = True,
        start_step: int = 0,
        staleness: StalenessPolicy | None = None,
    ) -> ParameterServer:
        """Start `num_shards` shard actors holding `initial` (P,), or their checkpoints in
        `checkpoint_root/shard_<i>` when they have some; each applies pushed gradients with
        the optimizer `optimizer` names, at the learning rate its schedule gives the global
        step (`start_step` plus the steps the pushes applied carried).

        With `resource`, shards run only on nodes that offer that custom Ray resource. With
        `backups` = 1 every shard keeps a backup that applies every update too (placed on
        another node when there is one); a primary that dies is replaced by its backup, not
        restarted by Ray. `shared_memory`: clients on a shard's node pull and push through
        shared memory (False: through Ray's object store, as across nodes). `staleness`:
        what the shards do with stale pushes, and the bound on staleness
        (`scaleout.ps.staleness`; None: pushes are applied as they come).
        """
        if backups not in (0, 1):
            raise ValueError(f"backups = {backups}: a shard keeps 0 or 1 backup")
        # The keeper beside the caller (the driver): a backup dies with the process that
        # started it, so the keeper must not sit on a node that may be lost with a primary.
        here = ray.get_runtime_context().get_node_id()
        keeper = spawn(BackupKeeper, num_cpus=0, node=here) if backups else None
        policy = BackupPolicy(keeper, resource) if backups else None
        ranges = shard_ranges(initial.numel(), num_shards)
        # With backups, primary i on node i mod N, no other: Ray never restarts a primary
        # (its backup takes over), and its "SPREAD" put both of two shards on one of two
        # nodes in 4 runs of 4 one day (a soft node affinity is no help: Ray places an actor
        # that asks for no resources on any node).
        nodes = shard_nodes(here, resource) if backups else []

        def start_shard(i: int) -> Any:  # noqa: ANN401 - an actor handle
            start, stop = ranges[i]
            return spawn(
                ParameterShard,
                i,
                stop - start,
                optimizer,
                compress,
                str(checkpoint_root / f"shard_{i}") if checkpoint_root else None,
                checkpoint_every,
                checkpoint_seconds,
                policy,
                staleness,
                num_cpus=0,
                max_restarts=0 if backups else max_restarts,
                resource=resource,
                node=nodes[i % len(nodes)] if len(nodes) > 1 else None,
            )

        shards = [start_shard(i) for i in range(len(ranges))]
        flat = initial.detach().to("cpu", torch.float32)
        server = cls(shards, ranges, compress, shared_memory=shared_memory)
        # with backups Ray never restarts a primary: one lost before its backup exists
        # is started again here (from its checkpoint, or the initial values)
        server._start_again = start_shard if backups else None
        server.keeper = keeper
        server._initial = flat
        server._start_step = start_step
        server._pending = [
            shard.initialize.remote(flat[start:stop].numpy(), start_step)
            for shard, (start, stop) in zip(shards, ranges, strict=True)
        ]
        if wait:
            server.wait()
        return server

    def wait(self) -> None:
        """Wait until every shard holds its initial slice (or its checkpoint) and its
        backup: `create(..., wait=False)` lets several servers start their processes at
        once."""
        if not self._pending:
            return
        answers = [self._initialized(i, pending) for i, pending in enumerate(self._pending)]
        self.backups = [backup for _, backup in answers]
        self._pending, self._initial = [], None
        self._start_again = None

    def _initialized(self, slot: int, pending: Any) -> tuple[int, Any]:  # noqa: ANN401
        """Shard `slot`'s answer to `initialize`. A shard that died while starting (before
        it held its slice, or its backup existed) is restarted after a backoff, by Ray or,
        with backups, here; up to `START_ATTEMPTS` times."""
        assert self._initial is not None
        start, stop = self.ranges[slot]
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return ray.get(pending)
            except RayActorError as error:
                if attempt == START_ATTEMPTS:
                    raise ShardLost(
                        f"parameter-server shard {slot} died {attempt} times while starting: "
                        f"{describe_failure(error)[:200]}"
                    ) from None
                time.sleep(restart_backoff_s(attempt))
                if self._start_again is not None:
                    kill([self.shards[slot]])
                    self.shards[slot] = self._start_again(slot)
                values = self._initial[start:stop].numpy()
                pending = self.shards[slot].initialize.remote(values, self._start_step)
        raise AssertionError("unreachable")

    def __reduce__(self) -> tuple[type[ParameterServer], tuple[Any, ...]]:
        return ParameterServer, (
            self.shards,
            self.ranges,
            self.compress,
            self.backups,
            self.shared_memory,
        )

    @property
    def numel(self) -> int:
        return self.ranges[-1][1]

    def pull_into(self, out: torch.Tensor) -> tuple[list[int], int]:
        """Fetch every shard's slice into `out` (P,); return (versions, bytes received)."""
        versions, received, called = [0] * len(self.shards), 0, []
        for i, (start, stop) in enumerate(self.ranges):
            view = self._view(i)
            if view is None:
                called.append(i)
                continue
            self._wait_applied(i)
            try:
                versions[i] = view.read_into(out[start:stop])
                received += 4 * (stop - start)
            except (shared.OwnerDied, OSError):  # through Ray, which handles the failure
                with self._lock:
                    self._forget(i)
                called.append(i)
        results = self._each(lambda i: self.shards[i].pull.remote(), called) if called else []
        for i, (payload, version) in zip(called, results, strict=True):
            start, stop = self.ranges[i]
            out[start:stop].copy_(self.pull_wire.decode(payload))
            versions[i] = version
            received += Wire.nbytes(payload)
        return versions, received

    def push(
        self, grads: torch.Tensor, base_versions: list[int], steps: int = 1
    ) -> tuple[list[Push], int]:
        """Send each shard its slice of `grads` (P,), the sum over `steps` training steps;
        return (pushes, bytes sent) at once. `settle(pushes)` waits for the shards to apply
        them."""
        pushes, sent = [], 0
        with self._lock:
            gradients = self._gradients
            buffer = gradients.index_of(grads) if gradients is not None else None
        for slot, ((start, stop), version) in enumerate(
            zip(self.ranges, base_versions, strict=True)
        ):
            payload = self.wire.encode(grads[start:stop], key=slot)  # key: the shard
            self.seqs[slot] += 1
            with self._lock:
                # Where the shard finds it until it is acknowledged: our gradient buffer
                # (handed out again only then), our inbox, or the object store. Not the
                # caller's own memory: that is zeroed and refilled before a push sent again
                # after a failure.
                local = self._shared_piece(slot, payload, buffer)
                ref = local if local is not None else ray.put(payload)
                push = Push(slot, ref, version, self.seqs[slot], None, steps=steps)
                if local is not None:
                    self._inbox_of(local, slot).sent(local, push, self._in_flight)
                self._send(push)
                self._unacked[slot].append(push)
            pushes.append(push)
            sent += Wire.nbytes(payload)
        if buffer is not None:
            with self._lock:  # its pushes name it now
                assert gradients is not None
                gradients.release(buffer)
        return pushes, sent

    def _send(self, push: Push) -> None:
        push.shard = shard = self.shards[push.slot]
        push.future = shard.push.remote(
            push.payload, push.base_version, self.client, push.seq, push.steps
        )

    def settle(self, pushes: list[Push]) -> list[tuple[int, int, float]]:
        """Wait until every push is applied: (version, staleness, the factor the staleness
        rule put on its step) per shard. Pushes to a
        shard that died are sent again to its successor (its backup, or the shard Ray
        restarted) in their order, before any other call of this client reaches it; the
        sequence numbers keep one the successor had applied from being applied twice."""
        results = []
        for push in pushes:
            deadline = time.monotonic() + RETRY_SECONDS
            while True:
                try:
                    applied = ray.get(push.future)
                    break
                except RayActorError:
                    self._recover(push.slot, push.shard, deadline)  # sends it again
            with self._lock:
                self.acked[push.slot] = max(self.acked[push.slot], push.seq)
                self._unacked[push.slot].remove(push)
            results.append(applied)
        return results

    # --- bounded staleness (`staleness.max_staleness`) -------------------------------------

    def open_window(self, owner: str = "") -> bool:
        """Open this client's window before a fetch (shard 0 keeps them); False: the bound
        holds it back, ask again."""
        opened = self._each(lambda i: self.shards[i].open_window.remote(self.client, owner), [0])
        return bool(opened[0])

    def close_window(self) -> None:
        """This client's push is applied on every shard: its window closes."""
        self._each(lambda i: self.shards[i].close_window.remote(self.client), [0])

    def drop_windows(self, owner: str) -> None:
        """Close the windows of replica `owner`'s clients (it failed)."""
        self._each(lambda i: self.shards[i].drop_windows.remote(owner), [0])

    def set_outer_delay(self, delay: int) -> None:
        """DiLoCo scaled to `delay` replicas: every shard's outer momentum applies once per
        `delay` pushes (`ParameterShard.set_outer_delay`)."""
        self._each(lambda i: self.shards[i].set_outer_delay.remote(delay))

    def values(self) -> torch.Tensor:
        """The whole parameter vector, uncompressed (P,)."""
        slices = self._each(lambda i: self.shards[i].values.remote())
        return torch.from_numpy(np.concatenate(slices))  # a writable copy of the slices

    def checkpoint(self) -> list[str | None]:
        """Checkpoint every shard (a shard that cannot write, e.g. on a full disk, raises
        its own one-line `UserError`)."""
        return self._each(lambda i: self.shards[i].checkpoint.remote())

    def info(self) -> list[dict[str, Any]]:
        return self._each(lambda i: self.shards[i].info.remote())

    def kill(self) -> None:
        """End the shards, their backups and the keeper (the backups the shards started
        since this copy last looked end with the keeper, which started them)."""
        kill([*self.shards, *(b for b in self.backups if b is not None)])
        if self.keeper is not None:
            kill([self.keeper])

    # --- failures ----------------------------------------------------------------------------

    def _each(self, call: Callable[[int], Any], slots: list[int] | None = None) -> list[Any]:
        """Call every shard in parallel; a call to a shard that died goes to its successor.

        A shard's answer of more than Ray's inline limit (100 KB: a pull, `values()`) waits
        in its node's object store until fetched; a node lost in between takes the answer
        with it (`ObjectLostError`, not `RayActorError`). The call is made again: a shard
        that died with its node answers `RayActorError` then and is replaced; one that lives
        answers again. Each call made here (a pull, `values`, `info`, a checkpoint,
        `initialize`) may be made twice. `slots`: only those shards (all by default)."""
        slots = list(range(len(self.shards))) if slots is None else slots
        called = {i: self.shards[i] for i in slots}
        futures = {i: call(i) for i in slots}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + RETRY_SECONDS
        for i in slots:
            while True:
                try:
                    results[i] = ray.get(futures[i])
                    break
                except RayActorError:
                    self._recover(i, called[i], deadline)
                    called[i] = self.shards[i]
                    futures[i] = call(i)
                except ObjectLostError:
                    if time.monotonic() > deadline:
                        raise
                    called[i] = self.shards[i]
                    futures[i] = call(i)
                except RayTaskError as error:  # a shard's own one-line error, not Ray's banner
                    reraise_user_error(error)
                    raise
        return [results[i] for i in slots]

    def _recover(self, slot: int, failed: Any, deadline: float) -> None:  # noqa: ANN401
        """Shard `slot` died: promote its backup, or give Ray time to restart it; then
        count this client's acknowledged pushes that the shard no longer holds, and send
        the pushes in flight again."""
        with self._lock:
            if failed is self.shards[slot] or self.backups[slot] is None:
                self._recover_locked(slot, deadline)  # else: another thread did already

    def _replace(self, slot: int, deadline: float) -> None:
        """Promote shard `slot`'s backup, or give Ray a moment to restart the shard."""
        backup = self.backups[slot]
        if backup is not None:
            try:
                self.backups[slot] = ray.get(backup.promote.remote())
            except RayActorError:
                raise ShardLost(
                    f"parameter-server shard {slot} and its backup both died; continue the "
                    "run with --resume from the last checkpoint"
                ) from None
            self.shards[slot] = backup
            self.failovers += 1
            return
        if time.monotonic() > deadline:
            raise ShardLost(
                f"parameter-server shard {slot} died and did not come back in "
                f"{RETRY_SECONDS:g} s; continue the run with --resume from the last "
                "checkpoint"
            )
        time.sleep(0.2)

    def _recover_locked(self, slot: int, deadline: float) -> None:
        # Until the successor answers, nothing else of this client may reach it: a push
        # sent to a restarted shard before the count would hide the updates it lost.
        while True:
            self._replace(slot, deadline)
            try:
                asked = self.shards[slot].applied_for.remote(self.client)
                held = ray.get(asked, timeout=max(deadline - time.monotonic(), 1.0))
                break
            except (RayActorError, GetTimeoutError):
                continue  # still restarting, or its successor died too
        self.updates_lost += max(self.acked[slot] - held, 0)
        self.acked[slot] = min(self.acked[slot], held)
        self._forget(slot)  # its successor is asked where its slice lies
        for push in self._unacked[slot]:  # in their order, before anything else of ours
            self._materialize(push)
            self._send(push)
            self.resent += 1
