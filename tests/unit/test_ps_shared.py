"""Shared memory between a parameter-server shard and the clients on its node: the regions
and their locks against plain tensors, and the server's pulls and pushes through them
against a server whose every call goes through Ray (as from another node)."""

from __future__ import annotations

import threading

import pytest
import torch

from scaleout.ps import shared
from scaleout.train.config import TrainSection

pytestmark = pytest.mark.skipif(not shared.available(), reason="shared memory needs Linux")

SGD = TrainSection(optimizer="sgd", lr=1.0)


def test_a_view_reads_the_owners_values_and_version():
    region = shared.Region(1000, node="here")
    with region.writing():
        region.values.copy_(torch.arange(1000, dtype=torch.float32))
        region.publish(7)
    view = shared.open_view(region.ref, "here")
    assert view is not None
    out = torch.empty(1000)
    assert view.read_into(out) == 7
    assert torch.equal(out, torch.arange(1000, dtype=torch.float32))
    region.values.add_(1)  # the same memory, not a copy
    view.read_into(out)
    assert out[0] == 1
    view.close()


def test_a_reader_waits_while_the_owner_writes():
    region = shared.Region(10, node="here")
    view = shared.RegionView(region.ref)
    out = torch.empty(10)
    with region.writing():
        reader = threading.Thread(target=view.read_into, args=(out,))
        reader.start()
        reader.join(timeout=0.3)
        assert reader.is_alive()  # blocked on the owner's exclusive lock
        region.values.fill_(5.0)
        region.publish(1)
    reader.join(timeout=5)
    assert not reader.is_alive() and torch.equal(out, torch.full((10,), 5.0))


def test_only_regions_on_this_node_that_can_be_opened_are_viewed():
    region = shared.Region(10, node="here")
    assert shared.open_view(region.ref, "another node") is None
    assert shared.open_view(None, "here") is None
    gone = shared.RegionRef("here", 2**22 + 17, 3, 4, 10)  # no such process
    with pytest.warns(RuntimeWarning, match="go through Ray"):
        assert shared.open_view(gone, "here") is None


def test_an_inbox_hands_out_slices_the_shard_reads_and_keeps_those_in_flight():
    inbox = shared.Inbox(4, node="here", count=2)
    in_flight: set[str] = set()
    first = inbox.put(torch.ones(4), in_flight.__contains__)
    second = inbox.put(torch.full((4,), 2.0), in_flight.__contains__)
    assert first is not None and second is not None
    inbox.sent(first, "push 1")
    inbox.sent(second, "push 2")
    views = shared.Views(limit=1)
    assert torch.equal(views.values(first), torch.ones(4))
    assert torch.equal(views.values(second), torch.full((4,), 2.0))
    assert first.nbytes == 16 and second.offset == 4
    in_flight.update(["push 1", "push 2"])
    assert inbox.put(torch.zeros(4), in_flight.__contains__) is None  # both still needed
    in_flight.discard("push 2")
    third = inbox.put(torch.zeros(4), in_flight.__contains__)
    assert third is not None and third.offset == second.offset
    assert torch.equal(inbox.values(first), torch.ones(4))  # untouched while in flight


def test_an_inbox_hands_out_a_buffer_neither_held_nor_named_and_knows_its_own():
    inbox = shared.Inbox(6, node="here", count=2)
    in_flight: set[str] = set()
    first = inbox.take(in_flight.__contains__, hold=True)
    assert first == 0 and inbox.index_of(inbox.buffer(0)) == 0
    assert inbox.index_of(torch.zeros(6)) is None and inbox.index_of(inbox.buffer(1)[:3]) is None
    assert inbox.take(in_flight.__contains__, hold=True) == 1  # 0 is held
    assert inbox.take(in_flight.__contains__) is None  # both held
    inbox.buffer(first).copy_(torch.arange(6.0))
    for name, (start, stop) in (("shard 0", (0, 4)), ("shard 1", (4, 6))):
        piece = inbox.piece(first, start, stop)
        inbox.sent(piece, name)
        assert torch.equal(shared.Views().values(piece), torch.arange(6.0)[start:stop])
    in_flight.update(["shard 0", "shard 1"])
    inbox.release(first)
    assert inbox.take(in_flight.__contains__) is None  # 0 named by pushes in flight, 1 held
    in_flight.discard("shard 0")
    assert inbox.take(in_flight.__contains__) is None  # shard 1 still reads 0
    in_flight.discard("shard 1")
    assert inbox.take(in_flight.__contains__) == 0


def test_a_shard_without_shared_memory_warns_and_serves_through_calls(monkeypatch):
    from scaleout.ps import shard as shard_module

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("memfd_create refused")

    monkeypatch.setattr(shared, "Region", refuse)
    with pytest.warns(RuntimeWarning, match="go through Ray"):
        shard = shard_module.ParameterShard(0, 4, SGD)
    shard.initialize(torch.ones(4).numpy())
    assert shard.region_ref() is None
    payload, version = shard.pull()
    assert version == 0 and torch.equal(torch.from_numpy(payload), torch.ones(4))
