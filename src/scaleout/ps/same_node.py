"""The parameter server's client side for the shards on its own node: shared memory.

`scaleout.ps.shared` holds the regions and their locks; this is how a `ParameterServer`
client uses them. Per shard on its node it maps the shard's slice once (`_view`, asked
through Ray for where it lies, again after a failover or a restart), and a pull copies from
there after the shard has applied this client's own pushes (`_wait_applied`). A push names
where the shard finds its slice (`_shared_piece`): in the gradient buffer the replica
accumulated it in (`gradient_buffer`: one in use, the others pushed or waiting for the
push thread), or in a per-shard inbox it is copied into. A buffer is handed out or written
again only once no push in flight names it (`_in_flight`); a push sent again after a
failure goes through the object store instead (`_materialize`), since its successor may be
on another node.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from scaleout.ps import shared
from scaleout.ps.wire import Payload

if TYPE_CHECKING:
    from scaleout.ps.server import Push

GRADIENT_BUFFERS = 4  # per client (`gradient_buffer`)
# A shard restarted by Ray takes a few seconds to come back; callers retry this long.
RETRY_SECONDS = 120.0


class SameNodeShards:
    """A mixin of `ParameterServer`: its pulls and pushes through shared memory."""

    shards: list[Any]
    ranges: list[tuple[int, int]]
    shared_memory: bool
    _lock: threading.RLock
    _unacked: list[list[Push]]

    def _init_nearby(self) -> None:
        count = len(self.shards)
        self._views: list[shared.RegionView | None] = [None] * count
        self._view_for: list[Any] = [None] * count  # the shard handle each was asked
        self._inboxes: list[shared.Inbox | None] = [None] * count
        self._gradients: shared.Inbox | None = None  # whole gradients (`gradient_buffer`)

    def _view(self, slot: int) -> shared.RegionView | None:
        """Shard `slot`'s slice mapped, when it shares this node (asked once per shard)."""
        if not self.shared_memory:
            return None
        with self._lock:  # a replica's fetch and push threads both ask
            shard = self.shards[slot]
            if self._view_for[slot] is not shard:
                self._forget(slot)
                try:
                    ref = ray.get(shard.region_ref.remote(), timeout=RETRY_SECONDS)
                except (RayActorError, RayTaskError, GetTimeoutError):
                    return None  # the call through Ray meets the failure and handles it
                node = ray.get_runtime_context().get_node_id()
                self._views[slot], self._view_for[slot] = shared.open_view(ref, node), shard
            return self._views[slot]

    def _wait_applied(self, slot: int) -> None:
        """Until shard `slot` has taken this client's pushes so far: a pull sees them, as a
        call queued behind them at the shard would (a failed one is handled where it is
        settled)."""
        with self._lock:
            futures = [push.future for push in self._unacked[slot]]
        if futures:
            ray.wait(futures, num_returns=len(futures), fetch_local=False)

    def _forget(self, slot: int) -> None:
        view, self._views[slot], self._view_for[slot] = self._views[slot], None, None
        if view is not None:
            view.close()

    def _in_flight(self, push: Push) -> bool:
        """Whether `push` still needs the shared buffer it names (unacknowledged, and not
        sent again through the object store)."""
        return isinstance(push.payload, shared.SharedSlice) and any(
            p is push for p in self._unacked[push.slot]
        )

    def _in_inbox(self, slot: int, values: np.ndarray) -> shared.SharedSlice | None:
        """`values` copied into a free buffer of this client's inbox for shard `slot`, when
        the shard shares this node; None: send them through the object store. A buffer is
        free once the push it carried has been acknowledged."""
        view = self._view(slot)
        if view is None:
            return None
        inbox = self._inboxes[slot]
        if inbox is None:  # on the shard's node, which `_view` found to be ours
            inbox = self._inboxes[slot] = shared.Inbox(values.size, view.ref.node)
        return inbox.put(torch.from_numpy(values), self._in_flight)

    def gradient_buffer(self) -> torch.Tensor | None:
        """A buffer (P,) in this client's shared memory to accumulate the next gradient in
        (its values as last left): `push` names the slices of the shards on this node where
        they lie, with no copy, and hands the buffer back. None where no shard shares this
        node, or while every buffer is handed out or named by a push in flight."""
        if not self.shared_memory:
            return None
        with self._lock:
            if self._gradients is None:
                views = [self._view(slot) for slot in range(len(self.shards))]
                local = [view for view in views if view is not None]
                if not local:
                    return None
                numel = self.ranges[-1][1]
                # one in use, two queued for a replica's push thread, one in flight
                self._gradients = shared.Inbox(numel, local[0].ref.node, GRADIENT_BUFFERS)
            gradients = self._gradients
            index = gradients.take(self._in_flight, hold=True)
            return None if index is None else gradients.buffer(index)

    def _shared_piece(
        self, slot: int, payload: Payload, buffer: int | None
    ) -> shared.SharedSlice | None:
        """Where shard `slot`'s slice of this push lies in our shared memory: in the
        gradient buffer `buffer` as it is, or copied into the shard's inbox; None: send it
        through the object store (another node, or a compressed payload)."""
        if not isinstance(payload, np.ndarray):
            return None
        if buffer is not None and self._view(slot) is not None:
            assert self._gradients is not None
            return self._gradients.piece(buffer, *self.ranges[slot])
        return self._in_inbox(slot, payload)

    def _inbox_of(self, piece: shared.SharedSlice, slot: int) -> shared.Inbox:
        gradients = self._gradients
        if gradients is not None and piece.region == gradients.region.ref:
            return gradients
        inbox = self._inboxes[slot]
        assert inbox is not None
        return inbox

    def _materialize(self, push: Push) -> None:
        """A push sent again may reach a successor on another node: its gradient goes into
        the object store (its buffer is kept until it is acknowledged)."""
        if isinstance(push.payload, shared.SharedSlice):
            inbox = self._inbox_of(push.payload, push.slot)
            push.payload = ray.put(inbox.values(push.payload).numpy())
