"""Shared memory between a parameter-server shard and the clients on its node: the regions
and their locks against plain tensors, and the server's pulls and pushes through them
against a server whose every call goes through Ray (as from another node)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch

from scaleout.ps import ParameterServer, shared
from tests.unit.test_ps_shared import SGD

pytestmark = pytest.mark.skipif(not shared.available(), reason="shared memory needs Linux")


def test_a_view_of_an_owner_that_died_says_so():
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from scaleout.ps import shared; r = shared.Region(100, 'here'); "
            "print(r.ref.pid, r.ref.fd, r.ref.alive_fd, flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        pid, fd, alive_fd = map(int, owner.stdout.readline().split())
        view = shared.RegionView(shared.RegionRef("here", pid, fd, alive_fd, 100))
        out = torch.empty(100)
        assert view.read_into(out) == 0 and view.owner_alive()
        owner.kill()
        owner.wait()
        with pytest.raises(shared.OwnerDied):
            view.read_into(out)
        view.close()
    finally:
        owner.kill()
        owner.wait()


def servers(initial: torch.Tensor, num_shards: int, **options):  # noqa: ANN003, ANN201
    """The same shards twice: clients on this node through shared memory, and through Ray."""
    return (
        ParameterServer.create(initial, num_shards, SGD, **options),
        ParameterServer.create(initial, num_shards, SGD, shared_memory=False, **options),
    )


def test_pulls_and_pushes_through_shared_memory_equal_those_through_ray(ray_session):
    initial = torch.linspace(-1, 1, 1001)
    local, remote = servers(initial, 3)
    try:
        for k in range(4):
            grad = torch.sin(torch.arange(1001, dtype=torch.float32) * (k + 1))
            for server in (local, remote):
                out = torch.empty(1001)
                versions, received = server.pull_into(out)
                assert versions == [k] * 3 and received == 4004
                pushes, sent = server.push(grad, versions)
                assert sent == 4004
                local_path = all(isinstance(p.payload, shared.SharedSlice) for p in pushes)
                assert local_path == (server is local)
                assert server.settle(pushes) == [(k + 1, 0, 1.0)] * 3
        assert torch.equal(local.values(), remote.values())
        assert [i["bytes_in"] for i in local.info()] == [i["bytes_in"] for i in remote.info()]
    finally:
        local.kill()
        remote.kill()


def test_a_pull_sees_the_clients_own_pushes(ray_session):
    """A pull right after a push, before it is settled, sees it applied: a call queued
    behind it at the shard would."""
    initial = torch.zeros(5000)
    server = ParameterServer.create(initial, 2, SGD)
    try:
        out = torch.empty(5000)
        for k in range(1, 6):
            versions, _ = server.pull_into(out)
            assert torch.equal(out, torch.full((5000,), -float(k - 1)))
            assert versions == [k - 1, k - 1]
            server.push(torch.ones(5000), versions)  # not settled
    finally:
        server.kill()


def test_an_inbox_buffer_is_written_again_only_once_acknowledged(ray_session):
    server = ParameterServer.create(torch.zeros(100), 1, SGD)
    try:
        sent = [server.push(torch.ones(100), [0])[0][0] for _ in range(4)]
        kinds = [type(p.payload) for p in sent]
        assert kinds[:3] == [shared.SharedSlice] * 3  # three buffers, none acknowledged
        assert isinstance(sent[3].payload, ray.ObjectRef)  # the fourth waits for none
        server.settle(sent)
        assert isinstance(server.push(torch.ones(100), [0])[0][0].payload, shared.SharedSlice)
        torch.testing.assert_close(server.values(), torch.full((100,), -5.0))
    finally:
        server.kill()


def test_a_shard_restarted_by_ray_is_found_through_ray_then_shared_again(ray_session, tmp_path):
    initial = torch.arange(10, dtype=torch.float32)
    server = ParameterServer.create(initial, 2, SGD, checkpoint_root=tmp_path, checkpoint_every=1)
    try:
        out = torch.empty(10)
        versions, _ = server.pull_into(out)
        server.settle(server.push(torch.ones(10), versions)[0])
        pid = server.info()[1]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.info()[1]["pid"] == pid and time.monotonic() < deadline:
            time.sleep(0.2)
        versions, _ = server.pull_into(out)  # the dead process's memory is not read
        assert torch.equal(out, initial - 1) and versions == [1, 1]
        server.pull_into(out)
        view = server._views[1]
        assert view is not None and view.ref.pid == server.info()[1]["pid"] != pid
    finally:
        server.kill()


def test_a_push_from_the_gradient_buffer_names_it_and_equals_one_through_ray(ray_session):
    """A client that accumulates in `gradient_buffer()` pushes its slices where they lie (no
    copy): the shards apply what they would through Ray. A buffer is handed out again only
    once pushed from and no push in flight names it."""
    initial = torch.linspace(-1, 1, 1001)
    local, remote = servers(initial, 3)
    try:
        for k in range(4):
            grad = torch.sin(torch.arange(1001, dtype=torch.float32) * (k + 1))
            buffer = local.gradient_buffer()
            assert buffer is not None and buffer.shape == (1001,)
            buffer.copy_(grad)
            others = [local.gradient_buffer() for _ in range(3)]  # held: 4 in all
            assert all(b is not None for b in others) and local.gradient_buffer() is None
            pushes, sent = local.push(buffer, [k] * 3)
            assert sent == 4004
            regions = {p.payload.region for p in pushes}
            assert len(regions) == 1  # the buffer itself, sliced per shard
            pieces = [(p.payload.offset % 1001, p.payload.numel) for p in pushes]
            assert pieces == [(start, stop - start) for start, stop in local.ranges]
            assert local.gradient_buffer() is None  # named by the pushes in flight
            remote_pushes, _ = remote.push(grad, [k] * 3)
            assert local.settle(pushes) == remote.settle(remote_pushes) == [(k + 1, 0, 1.0)] * 3
            for other in others:  # pushed from with nothing to send (a compressed push would)
                local._gradients.release(local._gradients.index_of(other))
        assert torch.equal(local.values(), remote.values())
    finally:
        local.kill()
        remote.kill()


@pytest.mark.parametrize("threads", [False, True])
def test_a_replica_client_trains_through_its_shared_buffers_as_through_ray(ray_session, threads):
    """`ReplicaClient` moves to another shared buffer after each push (its parameters'
    `.grad` point into the one in use) and every gradient reaches the shards as through
    Ray; with its push thread too, which gets the buffer itself. (A linear loss: its
    gradients do not depend on which parameters the fetch thread had brought.)"""
    from torch import nn

    from scaleout.ps.client import ReplicaClient

    results, used = [], []
    xs = torch.randn(9, 4, 6, generator=torch.Generator().manual_seed(1))
    for shared_memory in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(6, 5)
        initial = torch.cat([p.detach().flatten() for p in model.parameters()])
        server = ParameterServer.create(initial, 2, SGD, shared_memory=shared_memory)
        client = ReplicaClient([(model.parameters(), server)], n_fetch=1, n_push=2, threads=threads)
        buffers = set()
        try:
            for x in xs:
                client.before_step()
                model(x).sum().backward()
                client.after_backward()
                buffers.add(client.groups[0].flat.grads.data_ptr())
            client.flush()
            results.append(server.values())
            used.append(len(buffers))
        finally:
            client.close()
            server.kill()
    expected = torch.cat([initial[:30] - xs.sum((0, 1)).repeat(5), initial[30:] - 36.0])
    torch.testing.assert_close(results[1], expected)
    assert torch.equal(results[0], results[1])
    assert used[0] >= 3 and used[1] == 1  # own memory, then shared buffers; own only
