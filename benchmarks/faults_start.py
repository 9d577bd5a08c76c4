"""Suite `faults`, the faults at other moments than mid-run: a Downpour replica killed while
it starts, a shard primary lost during `initialize` (before its backup exists), and SIGTERM
to the driver (what a node's owner sends before taking it) followed by `--resume`. Each is
read against the same fault-free Downpour runs as the mid-run faults."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any
from unittest import mock

import ray

from benchmarks.faults_common import (
    DOWNPOUR,
    KILL_AT,
    Done,
    Outcome,
    cli,
    downpour,
    outcome,
    resume_to_end,
    summary_of,
    train,
    wait_for_step,
)
from scaleout.ps.server import ParameterServer


def _replica_killed_while_starting(root: Path, reference: Done) -> Outcome:
    """Replica 1's actor is killed the moment it is created, before its model and data
    exist: the strategy starts it again after a backoff."""
    run = downpour(root, "replica_start")
    spawn = run.strategy._spawn
    killed: list[int] = []

    def spawn_then_kill(replica_id: int, most_cpus: float | None = None) -> Any:  # noqa: ANN401 - a Replica
        replica = spawn(replica_id, most_cpus)
        if replica_id == 1 and not killed:
            ray.kill(replica.actor, no_restart=True)
            killed.append(replica_id)
        return replica

    run.strategy._spawn = spawn_then_kill  # type: ignore[method-assign]
    done = train(run)
    return outcome("downpour replica killed while starting", done, reference, 0)


def _shard_lost_while_starting(root: Path, reference: Done) -> Outcome:
    """Shard 0's primary is killed for good right after it was created, while it takes its
    initial values and before it has a backup: the server starts it again."""
    create = ParameterServer.create.__func__  # type: ignore[attr-defined]
    killed: list[Any] = []

    def create_then_kill(cls: type, *args: Any, **kwargs: Any) -> ParameterServer:  # noqa: ANN401
        wait = kwargs.pop("wait", True)
        server = create(cls, *args, wait=False, **kwargs)
        if not killed:
            ray.kill(server.shards[0], no_restart=True)
            killed.append(server.shards[0])
        if wait:
            server.wait()
        return server

    run = downpour(root, "shard_start", "downpour.shard_backups=1")
    with mock.patch.object(ParameterServer, "create", classmethod(create_then_kill)):
        done = train(run)
    return outcome("downpour shard primary lost while starting", done, reference, 0)


def _sigterm_then_resume(root: Path, reference: Done) -> Outcome:
    """SIGTERM to the driver alone once the run passed `KILL_AT`: it checkpoints the step
    it reached (its shards too) and exits 143; `--resume` goes on from that step."""
    name = "sigterm"
    run_dir = root / name
    started = time.perf_counter()
    first = cli(DOWNPOUR, root, name, "--overwrite")
    wait_for_step(first, run_dir, KILL_AT, "SIGTERM")
    signalled = time.perf_counter()
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    stop_s = time.perf_counter() - signalled
    if first.returncode != 143:
        raise RuntimeError(f"SIGTERM: exit {first.returncode}, not 143: {stderr[-500:]}")
    stopped_at = summary_of(run_dir)["step"]
    done, resumed_at = resume_to_end(root, name, reference, started)
    note = f"stopped at step {stopped_at}, {stop_s:.1f} s after the signal; resumed there"
    return outcome("driver SIGTERM, then --resume", done, reference, stopped_at - resumed_at, note)


def start_and_stop_faults(root: Path, reference: Done) -> list[Outcome]:
    """The faults of this module, each beside `reference`."""
    return [
        _replica_killed_while_starting(root, reference),
        _shard_lost_while_starting(root, reference),
        _sigterm_then_resume(root, reference),
    ]
