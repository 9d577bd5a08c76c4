"""Shard backups: a shard's primary or backup SIGKILLed mid-run loses no acknowledged
update. The reference is the same pushes on shards nobody kills: values and optimizer state
must be equal bit for bit (the backup applied the same updates in the same order)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray
import torch
from ray.exceptions import ObjectReconstructionFailedError

from scaleout.ps import ParameterServer
from scaleout.train.config import TrainSection

ADAGRAD = TrainSection(optimizer="adagrad", lr=0.1)


def pushes(server: ParameterServer, steps: range, kill=None) -> None:  # noqa: ANN001
    """Push gradient k for each k in `steps`, two at a time in flight (as a replica with
    n_push does between collects); call `kill()` after the first push of the range."""
    out = torch.empty(server.numel)
    pending = None
    for k in steps:
        versions, _ = server.pull_into(out)
        grad = torch.sin(torch.arange(server.numel, dtype=torch.float32) * (k + 1))
        sent, _ = server.push(grad, versions)
        if kill is not None and k == steps.start:
            kill()
        if pending is not None:
            server.settle(pending)
        pending = sent
    server.settle(pending)


def pid_of(actor) -> int:  # noqa: ANN001
    return ray.get(actor.info.remote())["pid"]


@contextmanager
def reference_and_backed_up(
    initial: torch.Tensor, num_shards: int, shared_memory: bool = True
) -> Iterator[tuple[ParameterServer, ParameterServer]]:
    """A server nobody kills (the reference) and one whose shards keep backups, both holding
    `initial`; both ended afterwards. `shared_memory` False: every call goes through Ray,
    as from another node."""
    reference = ParameterServer.create(initial, num_shards, ADAGRAD)
    server = ParameterServer.create(
        initial, num_shards, ADAGRAD, backups=1, shared_memory=shared_memory
    )
    try:
        yield reference, server
    finally:
        reference.kill()
        server.kill()


@pytest.mark.parametrize("victim", ["primary", pytest.param("backup", marks=pytest.mark.slow)])
def test_killed_primary_or_backup_loses_no_update(ray_session, victim):
    with reference_and_backed_up(torch.linspace(-1, 1, 1000), 2) as (reference, server):
        pushes(reference, range(30))
        pushes(server, range(10))
        target = server.shards[1] if victim == "primary" else server.backups[1]
        pid = pid_of(target)
        pushes(server, range(10, 30), kill=lambda: os.kill(pid, signal.SIGKILL))
        assert torch.equal(server.values(), reference.values())
        assert server.updates_lost == 0
        infos = server.info()
        assert [i["version"] for i in infos] == [30, 30]
        assert infos[1]["pid"] != pid or victim == "backup"
        if victim == "primary":
            assert server.failovers == 1 and infos[1]["promoted"]
        else:  # the primary replaced its backup (the first one and the new one)
            assert server.failovers == 0 and infos[1]["backups_started"] == 2
        assert all(i["backup"] for i in infos)  # every shard has a backup again
        # the state moved with the updates: the backup steps exactly as the primary would
        pushes(reference, range(30, 35))
        pushes(server, range(30, 35))
        assert torch.equal(server.values(), reference.values())


def lose_first_answer(monkeypatch) -> list[str]:  # noqa: ANN001
    """The next `ray.get` of one answer raises what Ray raises when the node holding that
    answer in its object store was lost before the caller fetched it; the list returned
    gets the lost answer's id."""
    real_get, lost = ray.get, []

    def get(refs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if isinstance(refs, ray.ObjectRef):
            monkeypatch.setattr(ray, "get", real_get)
            lost.append(refs.hex())
            raise ObjectReconstructionFailedError(refs.hex())
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "get", get)
    return lost


@pytest.mark.parametrize("primary", [pytest.param("alive", marks=pytest.mark.slow), "dead"])
def test_a_pull_answer_lost_with_its_node_is_asked_for_again(ray_session, monkeypatch, primary):
    """A pull's answer (over Ray's 100 KB inline limit) waits in the shard's node's store
    until fetched; a node lost in between raises ObjectLostError, not RayActorError. The
    client asks again: a live primary answers (no failover: its backup promoted beside it
    would make two primaries), a dead one is replaced by its backup. Either way the pull
    returns the values a fault-free server holds, and no update is lost or applied twice.
    (Through Ray: a pull from a shard on the caller's node copies its shared slice.)"""
    initial = torch.linspace(-1, 1, 1000)
    with reference_and_backed_up(initial, 2, shared_memory=False) as (reference, server):
        pushes(reference, range(6))
        pushes(server, range(3))
        if primary == "dead":
            os.kill(pid_of(server.shards[0]), signal.SIGKILL)
        lost = lose_first_answer(monkeypatch)
        out = torch.empty(server.numel)
        server.pull_into(out)  # shard 0's answer is lost
        assert len(lost) == 1
        assert server.failovers == (1 if primary == "dead" else 0)
        pushes(server, range(3, 6))
        assert torch.equal(server.values(), reference.values())
        assert server.updates_lost == 0
        assert [i["version"] for i in server.info()] == [6, 6]


@pytest.mark.slow
def test_a_second_failure_is_survived_by_the_new_backup(ray_session):
    with reference_and_backed_up(torch.zeros(64), 1) as (reference, server):
        pushes(reference, range(20))
        for start in (0, 10):
            pid = pid_of(server.shards[0])
            pushes(server, range(start, start + 10), kill=lambda p=pid: os.kill(p, signal.SIGKILL))
            time.sleep(0.2)
        assert server.failovers == 2 and server.updates_lost == 0
        assert torch.equal(server.values(), reference.values())


@pytest.mark.slow
def test_without_backup_a_restart_counts_the_updates_it_lost(ray_session, tmp_path):
    """No backup: Ray restarts the shard from its checkpoint; the client counts the pushes
    it had acknowledged that the restarted shard does not hold, and sends the rest again."""
    initial = torch.zeros(64)
    server = ParameterServer.create(
        initial, 1, ADAGRAD, checkpoint_root=tmp_path, checkpoint_every=4
    )
    try:
        pushes(server, range(10))  # checkpoints at versions 0, 4, 8
        pid = pid_of(server.shards[0])
        pushes(server, range(10, 20), kill=lambda: os.kill(pid, signal.SIGKILL))
        info = server.info()[0]
        restored = info["restored_version"]
        assert restored == 8  # versions 0, 4, 8 were checkpointed before the kill
        # Pushes acknowledged beyond version 8 before the process was gone are lost (a few:
        # SIGKILL lands a moment after the call); those in flight are sent again.
        assert 0 <= server.updates_lost <= 3
        assert server.resent >= 1
        assert info["version"] + server.updates_lost == 20  # each push held once, or lost
    finally:
        server.kill()
