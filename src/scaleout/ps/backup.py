"""A shard's backup: a second actor that applies every update the primary applies.

Chain replication of one link (van Renesse & Schneider 2004): a push reaches the primary,
which hands the same encoded gradient to its backup *before* applying it itself (both apply
at once, on two processes), and acknowledges the push only once the backup has applied it
too. The backup sees the primary's updates in the primary's order (Ray runs one caller's
calls to an actor in the order they were made), and steps the same optimizer on the same
gradient, so the two hold the same values and optimizer state, bit for bit.

When the primary dies, its clients promote the backup (`ParameterShard.promote`): it
becomes the primary and starts a backup of its own. Every acknowledged update is in it; the
pushes that were in flight are sent again, and each push carries (client, sequence number)
so that one the backup had already applied is not applied twice. When the backup dies, the
primary starts a new one from its own state and goes on.

The backup is placed on another node than its primary when the cluster has one (a node
lost whole takes only one of the two), on the same node otherwise (it still survives a
process that dies). A node that just lost a shard (a primary or a backup) gets no new backup
for a while: Ray lists a dead node as alive until it has missed its health checks, and a
backup sent there would never start. Starting a backup never fails the primary: when no
node takes one in time, the primary goes on alone and tries again at its next push.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnschedulableError, GetTimeoutError, RayActorError

from scaleout.runtime import kill, spawn

# A backup that has not applied an update after this long is treated as lost.
CONFIRM_TIMEOUT_S = 60.0
# A new backup that has not started and taken the primary's state after this long is given
# up for the next node (Ray may schedule it onto a node that died a moment ago).
BACKUP_START_S = 30.0
MAX_NODES_TRIED = 3  # other nodes tried for a new backup before the primary's own
SHUN_S = 120.0  # a node that lost a shard gets no new backup for this long


@dataclass(frozen=True)
class BackupPolicy:
    """How a primary places its backup (on nodes offering `resource` when set), and the
    keeper that starts it."""

    keeper: Any  # a `BackupKeeper` actor
    resource: str | None = None


class BackupKeeper:
    """Starts backups for the primaries (a Ray actor the driver owns). Ray ends an actor
    with the process that started it: a backup a primary started itself would die with
    its primary, exactly when it is needed. The keeper lives as long as the run, and keeps
    a handle of every backup it started so that Ray does not end them early."""

    def __init__(self) -> None:
        self.started: list[Any] = []  # Ray ends an actor no handle refers to any more

    def spawn(
        self, actor_class: type, args: tuple[Any, ...], node: str | None, resource: str | None
    ) -> Any:  # noqa: ANN401
        """A backup: no CPU reserved (it only applies updates, like its primary), never
        restarted by Ray (a lost backup is replaced by its primary, with the current
        state)."""
        handle = spawn(actor_class, *args, num_cpus=0, resource=resource, node=node)
        self.started.append(handle)
        return handle


class BackupLink:
    """The primary's side of its backup: start it, forward updates, replace it when lost."""

    def __init__(self, policy: BackupPolicy) -> None:
        self.policy = policy
        self.handle: Any = None
        self.node: str | None = None  # where the backup runs
        self.started = 0  # backups started (the first one included)
        self.shunned: dict[str, float] = {}  # node -> until when no backup goes there
        self.retry_at = 0.0  # after a start that failed everywhere: when to try again

    def shun(self, node: str | None) -> None:
        """Place no backup on `node` for a while: it lost a shard, and Ray may still list it
        alive (it declares a node dead only after missed health checks)."""
        if node is not None:
            self.shunned[node] = time.monotonic() + SHUN_S

    def start(
        self, actor_class: type, args: tuple[Any, ...], state: dict[str, Any], node: str
    ) -> Any:  # noqa: ANN401
        """Start a backup (`actor_class(*args)`) and give it `state`, the primary's whole
        state at this moment; return its handle, or None when no node took it in time (the
        primary goes on alone and tries again at its next push).

        Other nodes are tried first (a few, in random order), then the primary's own `node`;
        each has BACKUP_START_S to start the process and take the state."""
        keeper, resource = self.policy.keeper, self.policy.resource
        for where in [*self._other_nodes(node)[:MAX_NODES_TRIED], node]:
            handle = None
            try:
                spawned = keeper.spawn.remote(actor_class, args, where, resource)
                handle = ray.get(spawned, timeout=BACKUP_START_S)
                placed = ray.get(handle.adopt.remote(state, node), timeout=BACKUP_START_S)
            except (RayActorError, ActorUnschedulableError, GetTimeoutError) as error:
                _say(f"a backup could not start on node {where[:8]} ({type(error).__name__})")
                if handle is not None:
                    kill([handle])
                self.shun(where)
                continue
            self.handle, self.node = handle, placed
            self.started += 1
            return handle
        self.handle, self.node = None, None
        self.retry_at = time.monotonic() + BACKUP_START_S
        return None

    def due(self) -> bool:
        """Whether a primary without a backup should try to start one now."""
        return self.handle is None and time.monotonic() >= self.retry_at

    def forward(self, method: str, *args: Any) -> Any:  # noqa: ANN401 - a Ray future
        """Hand an update to the backup (it runs while the primary applies its own)."""
        if self.handle is None:
            return None
        return getattr(self.handle, method).remote(*args)

    def confirm(self, future: Any, shard_id: int) -> bool:  # noqa: ANN401
        """Wait until the backup has applied the update; False if the backup is lost (the
        caller starts a new one)."""
        if future is None:
            return self.handle is not None
        try:
            ray.get(future, timeout=CONFIRM_TIMEOUT_S)
            return True
        except (RayActorError, GetTimeoutError) as error:
            _say(
                f"shard {shard_id}: its backup is lost ({type(error).__name__}); starting a new one"
            )
            kill([self.handle])
            self.shun(self.node)
            self.handle, self.node = None, None
            return False

    def _other_nodes(self, node: str) -> list[str]:
        """Nodes other than `node` that can hold the backup, in random order, shunned ones
        left out."""
        now = time.monotonic()
        candidates = [
            n
            for n in shard_nodes(node, self.policy.resource)
            if n != node and self.shunned.get(n, 0.0) < now
        ]
        random.shuffle(candidates)
        return candidates


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def shard_nodes(caller: str, resource: str | None = None) -> list[str]:
    """The alive nodes that can hold a shard or a backup (offering `resource` when set): the
    caller's first, then by address. Primary i on node i mod their count spreads the shards
    evenly, where `scaleout simulate` puts them; a backup goes to one of the others."""
    alive = [
        n
        for n in ray.nodes()
        if n.get("Alive") and (resource is None or n["Resources"].get(resource))
    ]
    alive.sort(key=lambda n: (n["NodeID"] != caller, n["NodeManagerAddress"], n["NodeID"]))
    return [n["NodeID"] for n in alive]
