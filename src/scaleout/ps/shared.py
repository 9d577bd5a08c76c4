"""Slices and gradients shared through memory between the processes of one node.

Through Ray, a pull makes the shard put its slice into the object store and the caller wait
for the call's answer; a push puts the gradient into the store. Each such call costs many
times a copy of the slice, and on a busy node it also waits for the shard's and the
raylet's processes to get a core.

Where a replica and a shard share a node, the shard keeps its slice in an anonymous shared
file (`os.memfd_create`) that the replica maps: a pull is one copy under a shared lock, with
no call and no other process scheduled. A push is a small call that names where the
gradient lies in the client's own shared inbox (`SharedSlice`); the shard reads it from
there. A replica accumulates its gradient in such an inbox itself (in one buffer while the
shards read the others), so its push copies nothing; a gradient from elsewhere is copied
in first. Another process opens such a file as `/proc/<pid>/fd/<fd>` (same user), so
nothing is left behind when processes die: the kernel frees the memory with its last user.

Locks (`flock`, per open file): the owner holds its region's lock exclusively while it
changes the values (an optimizer step, a restore) and their version, and a reader holds it
shared while it copies, so a pull sees one version of a slice, as a call to the shard does.
The owner also holds a second file's lock for its whole life: a reader who can take that
lock knows the owner died (the kernel dropped its locks) and goes through Ray instead,
where the failure is handled (a backup promoted, a restart waited for).

Linux only (memfd, /proc); elsewhere `available()` is False and every call goes through Ray.
"""

from __future__ import annotations

import fcntl
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

HEADER_FLOATS = 16  # 64 bytes before the values: the version (int64), and alignment
_VERSION = 0  # index of the version in the header's int64 view


def available() -> bool:
    """Whether this process can share memory with its node's others here (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


@dataclass(frozen=True)
class RegionRef:
    """Where a process of `node` finds a region (small: it travels inside calls)."""

    node: str
    pid: int
    fd: int
    alive_fd: int
    numel: int  # float32 values after the header


@dataclass(frozen=True)
class SharedSlice:
    """A push's gradient, lying in its client's inbox region: values [offset, offset+numel)."""

    region: RegionRef
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    def of(self, values: torch.Tensor) -> torch.Tensor:
        """This slice of a region's `values` (numel,)."""
        return values[self.offset : self.offset + self.numel]


def _map(path: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(header as int64, values as float32) of the region file at `path`."""
    storage = torch.from_file(path, shared=True, size=HEADER_FLOATS + numel, dtype=torch.float32)
    return storage[:HEADER_FLOATS].view(torch.int64), storage[HEADER_FLOATS:]


class Region:
    """A float32 vector (numel,) this process owns and its node's others may map."""

    def __init__(self, numel: int, node: str, name: str = "scaleout") -> None:
        self.fd = os.memfd_create(name)
        os.ftruncate(self.fd, 4 * (HEADER_FLOATS + numel))
        self._header, self.values = _map(f"/proc/self/fd/{self.fd}", numel)
        self.alive_fd = os.memfd_create(f"{name}-alive")
        fcntl.flock(self.alive_fd, fcntl.LOCK_EX)  # held until this process ends
        self.ref = RegionRef(node, os.getpid(), self.fd, self.alive_fd, numel)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the region's lock exclusively: no reader copies meanwhile."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def publish(self, version: int) -> None:
        """Set the version readers see with the values (inside `writing()`)."""
        self._header[_VERSION] = version


class OwnerDied(Exception):
    """The region's owner ended: ask it through Ray instead."""


class RegionView:
    """Another process's region, mapped: read its values, or write an inbox's."""

    def __init__(self, ref: RegionRef) -> None:
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        self.ref = ref
        self.fd = os.open(path, os.O_RDWR)
        try:
            self.alive_fd = os.open(f"/proc/{ref.pid}/fd/{ref.alive_fd}", os.O_RDONLY)
        except OSError:
            os.close(self.fd)
            raise
        self._header, self.values = _map(path, ref.numel)

    def owner_alive(self) -> bool:
        try:
            fcntl.flock(self.alive_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.alive_fd, fcntl.LOCK_UN)
        return False

    def read_into(self, out: torch.Tensor) -> int:
        """Copy the values into `out` (numel,); their version. Raises `OwnerDied`."""
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        try:
            out.copy_(self.values)
            version = int(self._header[_VERSION])
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        if not self.owner_alive():  # its last values may be from before a failure
            raise OwnerDied(f"process {self.ref.pid} ended")
        return version

    def close(self) -> None:
        for fd in (self.fd, self.alive_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def open_view(ref: RegionRef | None, node: str) -> RegionView | None:
    """A view of `ref` when it lies on `node` (this process's) and can be opened; None: go
    through Ray. A region that cannot be opened (no access to the owner's /proc entry, or
    the owner ended) says so in one warning."""
    if ref is None or ref.node != node or not available():
        return None
    try:
        return RegionView(ref)
    except OSError as err:
        warnings.warn(
            f"cannot map process {ref.pid}'s shared memory ({err}); its pulls and pushes go "
            "through Ray's object store",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


class Inbox:
    """A client's gradients in `count` shared buffers of `numel` values: a push names its
    slices where they lie (`SharedSlice`). A buffer is handed out again (`take`) only once
    no push that named it is in flight (`in_flight`), so a push sent again after a failure
    still finds its values.

    Filled in one of two ways: `put` copies a gradient (of any tensor) into a free buffer;
    a client that accumulates its gradient in a buffer itself (`take(hold=True)`, then
    `buffer`: the parameters' `.grad` point into it) pushes its slices with no copy
    (`piece`), then `release`s it."""

    def __init__(self, numel: int, node: str, count: int = 3) -> None:
        self.region = Region(numel * count, node, "scaleout-inbox")
        self.numel, self.count = numel, count
        self.next = 0
        self.sent_with: list[list[object]] = [[] for _ in range(count)]  # pushes per buffer
        self.held: set[int] = set()

    def buffer(self, index: int) -> torch.Tensor:
        """Buffer `index` (numel,)."""
        return self.region.values[index * self.numel : (index + 1) * self.numel]

    def index_of(self, values: torch.Tensor) -> int | None:
        """Which buffer `values` (numel,) is; None: not one of ours."""
        if values.numel() != self.numel or values.dtype != torch.float32:
            return None
        for index in range(self.count):
            if values.data_ptr() == self.buffer(index).data_ptr():
                return index
        return None

    def take(self, in_flight: Callable[[object], bool], hold: bool = False) -> int | None:
        """The next buffer in turn that is neither held nor named by a push in flight, or
        None. `hold`: it stays held (not handed out again) until `release`d: a client
        accumulating in it, or a push thread not yet sending it."""
        for k in range(self.count):
            index = (self.next + k) % self.count
            if index in self.held or any(in_flight(p) for p in self.sent_with[index]):
                continue
            self.next = (index + 1) % self.count
            self.sent_with[index] = []
            if hold:
                self.held.add(index)
            return index
        return None

    def release(self, index: int) -> None:
        """Buffer `index` is no longer held (its pushes, if any, name it now)."""
        self.held.discard(index)

    def piece(self, index: int, start: int = 0, stop: int | None = None) -> SharedSlice:
        """Values [start, stop) of buffer `index`, to send."""
        stop = self.numel if stop is None else stop
        return SharedSlice(self.region.ref, index * self.numel + start, stop - start)

    def put(self, grad: torch.Tensor, in_flight: Callable[[object], bool]) -> SharedSlice | None:
        """Copy `grad` (numel,) into a buffer no push in flight names; the slice to send
        (`sent(slice, push)` then), or None when every buffer is named."""
        index = self.take(in_flight)
        if index is None:
            return None
        self.buffer(index).copy_(grad)
        return self.piece(index)

    def sent(
        self, piece: SharedSlice, push: object, in_flight: Callable[[object], bool] | None = None
    ) -> None:
        """`piece`'s buffer is named by `push` now (and, given `in_flight`, no longer by
        the pushes that have landed: a buffer pushed from again and again keeps no list)."""
        index = piece.offset // self.numel
        if in_flight is not None:
            self.sent_with[index] = [p for p in self.sent_with[index] if in_flight(p)]
        self.sent_with[index].append(push)

    def values(self, piece: SharedSlice) -> torch.Tensor:
        """The values `piece` (of this inbox) names (numel,)."""
        return piece.of(self.region.values)


class Views:
    """Regions of other processes this one reads from (a shard: its clients' inboxes),
    opened once each; the oldest is closed beyond `limit` (clients that ended)."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._views: dict[RegionRef, RegionView] = {}

    def values(self, piece: SharedSlice) -> torch.Tensor:
        """The values `piece` names (numel,), in the owner's memory: copy before it is free."""
        view = self._views.get(piece.region)
        if view is None:
            view = RegionView(piece.region)
            self._views[piece.region] = view
            if len(self._views) > self.limit:
                oldest = next(iter(self._views))
                self._views.pop(oldest).close()
        return piece.of(view.values)
