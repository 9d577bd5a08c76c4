"""Suite `faults`: every fault the library claims to survive, injected into a real run.

Each fault is injected mid-run into a short MNIST run of the strategy it concerns (the
shipped config with fewer examples and steps), and the same run is made without it, one
after the other in this process. Per fault, five rows:

- survived: 1 when the run reached its last step by itself (or, where the fault is the
  driver's own process or its disk, after the one `--resume` its message asks for);
- updates lost: acknowledged parameter-server updates the final model misses (Downpour's
  `shard_updates_lost`), or the planned steps the run never reached;
- steps redone: work done twice: a dead replica's steps handed to another, a group started
  again from its last checkpoint (`steps_redone`), a resumed driver's steps since its
  checkpoint;
- extra wall time: the faulted run's seconds (both processes for a resume) beyond the
  fault-free run's: what the fault cost, detection and recovery included;
- accuracy against the fault-free run, in percentage points (for the autoencoder, which
  has none, its test loss in percent).

The first rows are what the backups cost: the fault-free Downpour run's examples/s with
`shard_backups = 1` over the same run's with 0 (median of the logged windows; every
process on this machine), and how far apart fault-free asynchronous runs end (Downpour
runs are compared with the mean of three, the testnet host's with the mean of two).

Faults: SIGKILL of a Downpour replica, a shard's primary, a shard's backup, the driver (then
`--resume`); a Downpour replica killed while it starts and a shard primary lost while it
starts (`faults_start`); SIGTERM to the driver, then `--resume`; `scaleout scale` from one
replica to two and back, and a testnet host joining and then leaving an elastic run
(`faults_scale`, with the time to join and the examples/s meanwhile); a Sandblaster replica
mid-portion, a sync worker and a model-parallel grid worker; a Downpour replica stopped
(SIGSTOP: alive but silent, for the watchdog) and, as its control, one killed and not
restarted (the run goes on with one replica); a full disk (a tmpfs filled up: the run stops
with one line, space is freed, `--resume`); and a whole testnet host with its Ray node,
holding a shard primary (three emulated hosts). The last two need root; without it their
rows are left out and a note says why.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.faults_common import (
    DOWNPOUR,
    KILL_AT,
    MODEL_PARALLEL,
    NUM_REFERENCES,
    REPO,
    SANDBLASTER,
    SYNC,
    Done,
    Outcome,
    cli,
    downpour,
    kill,
    mean,
    outcome,
    records,
    resume_to_end,
    run_overrides,
    spread_row,
    summary_of,
    train,
    wait_for_step,
    when,
)
from benchmarks.faults_host import lose_a_shard_host
from benchmarks.testnet import available
from scaleout.api import Run, prepare
from scaleout.errors import DiskError

# --- faults in this process's runs --------------------------------------------------------------


def _signal_replica_or_shard(
    root: Path,
    reference: Done,
    fault: str,
    pid_of: Callable[[Run], int],
    sig: int,
    more: list[str],
) -> Outcome:
    """Send `sig` to the process `pid_of(run)` names once the run passed `KILL_AT`."""
    faulted = downpour(root, "_".join(fault.split()[1:3]), *more)
    signalled: list[int] = []
    at: list[int] = []

    def act() -> None:
        signalled.append(pid_of(faulted))
        at.append(faulted.strategy.step)
        kill(signalled[-1], sig)

    done = train(faulted, when(lambda: faulted.strategy.step >= KILL_AT, act))
    for pid in signalled:  # a stopped process the watchdog did not end
        kill(pid)
    note = ""
    # A replica found stuck late, or not restarted: the other one trains alone meanwhile.
    alone = [
        f
        for f in faulted.strategy.failures
        if f.get("kind") == "stuck" or (f.get("kind") == "died" and not f["restarted"])
    ]
    if at and alone:
        until = alone[0]["step"] if alone[0]["restarted"] else done.steps
        found = f", found stuck at step {until}" if alone[0]["kind"] == "stuck" else ""
        note = (
            f"signalled at step {at[0]}{found}: at least {(until - at[0]) / done.planned:.0%} "
            "of the run's steps were trained by the other replica alone, on its own part of "
            "the training set (each Downpour replica owns one)"
        )
    return outcome(fault, done, reference, done.summary.get("steps_lost", 0), note)


def _downpour_faults(root: Path, reference: Done) -> list[Outcome]:
    outcomes = []

    def shard_server(r: Run) -> Any:  # noqa: ANN401
        return r.strategy.shards.servers[0][0]

    def backup_pid(r: Run) -> int:
        import ray

        return ray.get(shard_server(r).backups[0].info.remote())["pid"]

    victims: dict[str, tuple[Callable[[Run], int], int, list[str]]] = {
        "downpour replica SIGKILL": (lambda r: r.strategy.replicas[1].pid(), signal.SIGKILL, []),
        "downpour shard primary SIGKILL": (
            lambda r: shard_server(r).info()[0]["pid"],
            signal.SIGKILL,
            [],
        ),
        "downpour shard backup SIGKILL": (backup_pid, signal.SIGKILL, []),
        "downpour replica stuck (SIGSTOP)": (
            lambda r: r.strategy.replicas[1].pid(),
            signal.SIGSTOP,
            ["downpour.timeout_s=10"],
        ),
        # The control for the stuck replica: what training on with one replica costs.
        "downpour replica lost for good (SIGKILL, max_restarts 0)": (
            lambda r: r.strategy.replicas[1].pid(),
            signal.SIGKILL,
            ["downpour.max_restarts=0"],
        ),
    }
    for fault, (pid_of, sig, more) in victims.items():
        outcomes.append(_signal_replica_or_shard(root, reference, fault, pid_of, sig, more))
    return outcomes


def _lockstep_faults(root: Path) -> list[Outcome]:
    outcomes = []
    for fault, setup, at in [
        ("sync worker SIGKILL", SYNC, KILL_AT),
        ("model-parallel worker SIGKILL", MODEL_PARALLEL, 30),
    ]:
        config = REPO / setup[0]
        reference = train(
            prepare(config, overrides=run_overrides(setup, root, "ref"), overwrite=True)
        )
        faulted = prepare(config, overrides=run_overrides(setup, root, "faulted"), overwrite=True)

        def act(r: Run = faulted) -> None:
            kill(r.strategy.workers.group.pids[1])

        done = train(faulted, when(lambda r=faulted, at=at: r.strategy.step >= at, act))
        redone = done.summary.get("steps_redone", 0)
        outcomes.append(outcome(fault, done, reference, redone))
    return outcomes


def _sandblaster_fault(root: Path) -> Outcome:
    import ray

    config = REPO / SANDBLASTER[0]
    reference = train(
        prepare(config, overrides=run_overrides(SANDBLASTER, root, "ref"), overwrite=True)
    )
    faulted = prepare(config, overrides=run_overrides(SANDBLASTER, root, "faulted"), overwrite=True)

    def act(r: Run = faulted) -> None:
        kill(ray.get(r.strategy.replicas[2].pid.remote()))

    done = train(faulted, when(lambda: faulted.strategy.batch_id >= 10, act))
    note = f"replica failures {done.summary.get('replica_failures')}"
    return outcome("sandblaster replica SIGKILL mid-portion", done, reference, 0, note)


# --- faults that end the driver's own process -------------------------------------------------


def _driver_fault(root: Path, reference: Done) -> Outcome:
    """The driver and its process group SIGKILLed after the checkpoint at 500, then
    `--resume`; the steps since that checkpoint are done again."""
    name = "driver"
    run_dir = root / name
    started = time.perf_counter()
    first = cli(DOWNPOUR, root, name, "--overwrite")
    try:
        wait_for_step(first, run_dir, KILL_AT, "the kill")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    killed_at = max(r["step"] for r in records(run_dir))
    done, resumed_at = resume_to_end(root, name, reference, started)
    return outcome("driver SIGKILL, then --resume", done, reference, killed_at - resumed_at)


def _full_disk_fault(root: Path, reference: Done) -> Outcome | str:
    """The run's disk (a tmpfs) filled up after the checkpoint at 500: the run stops with
    one line, space is freed, `--resume` finishes it."""
    if os.geteuid() != 0:
        return "full disk: left out (mounting a small tmpfs needs root)"
    disk = root / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        return f"full disk: left out (mount: {mounted.stderr.decode().strip()})"
    try:
        config, filler = REPO / DOWNPOUR[0], disk / "filler"
        faulted = prepare(config, overrides=run_overrides(DOWNPOUR, disk, "disk"), overwrite=True)

        def fill(r: Run) -> None:
            while r.strategy.step < KILL_AT:
                time.sleep(0.02)
            with open(filler, "wb", buffering=0) as out:  # unbuffered: close never raises
                try:
                    while True:
                        out.write(b"\0" * (1 << 20))
                except OSError:
                    pass

        started = time.perf_counter()
        threading.Thread(target=fill, args=(faulted,), daemon=True).start()
        try:
            faulted.train()
            message = "the disk never filled"
        except DiskError as error:
            message = str(error)
        filler.unlink(missing_ok=True)
        stopped = re.search(r"stopped at step (\d+)", message)
        resumed = prepare(config, overrides=run_overrides(DOWNPOUR, disk, "disk"), resume=True)
        saved = resumed.run_dir.checkpoints.steps()
        result = resumed.train()
        seconds = time.perf_counter() - started
        summary = {**summary_of(disk / "disk"), **result.summary}
        done = Done(summary, seconds, result.step, reference.planned)
        redone = int(stopped.group(1)) - saved[-1] if stopped and saved else 0
        return outcome("full disk, then --resume", done, reference, redone, message[:200])
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# --- a whole host --------------------------------------------------------------------------------


def _host_fault(root: Path) -> tuple[Outcome, Row] | str:
    """Three testnet hosts: the driver in host 0, shards on hosts 1 and 2 (each primary's
    backup on the other); the host holding shard 0's primary is killed whole."""
    reason = available()
    if reason is not None:
        return f"testnet host lost whole: left out ({reason})"
    loss = lose_a_shard_host(root, steps=1500, kill_after=500, num_train=60000, num_references=2)
    done = Done(loss.lost, loss.lost_s, loss.lost["step"], loss.references[0]["step"])
    summary = {"final_test_accuracy": loss.reference_accuracy}
    reference = Done(summary, loss.reference_s, loss.references[0]["step"], 0)
    failures = [f.get("kind") for f in loss.lost.get("failures", [])]
    note = f"host {loss.victim} killed ({loss.killed} processes); failures {failures}"
    fault = "testnet host with a shard primary lost whole"
    spread = spread_row(fault, [r["final_test_accuracy"] for r in loss.references])
    return outcome(fault, done, reference, 0, note), spread


@register_suite("faults", "injected faults: survived, lost, redone, extra time, accuracy")
def run() -> SuiteResult:
    notes = [__doc__.split("\n\n")[1].replace("\n", " ")]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        root = Path(tmp)
        references = [
            train(downpour(root / "downpour", f"reference_{i}")) for i in range(NUM_REFERENCES)
        ]
        reference = mean(references)
        unguarded = train(downpour(root / "downpour", "no_backups", "downpour.shard_backups=0"))
        rows = [
            Row(
                "shard backups: examples/s with / without",
                reference.rate / max(unguarded.rate, 1e-9),
                "x",
                "higher",
            ),
            spread_row("downpour", [r.summary["final_test_accuracy"] for r in references]),
        ]
        outcomes += _downpour_faults(root / "downpour", reference)
        outcomes.append(_driver_fault(root / "downpour", reference))
        from benchmarks.faults_start import start_and_stop_faults

        outcomes += start_and_stop_faults(root / "downpour", reference)
        from benchmarks.faults_scale import scaling_faults

        scaled, left_out = scaling_faults(root / "downpour", reference)
        outcomes += scaled
        notes += left_out
        disk = _full_disk_fault(root, reference)
        if isinstance(disk, str):
            notes.append(disk)
        else:
            outcomes.append(disk)
        host = _host_fault(root / "host")
        if isinstance(host, str):
            notes.append(host)
        else:
            outcomes.append(host[0])
            rows.append(host[1])
        outcomes.append(_sandblaster_fault(root / "sandblaster"))
        outcomes += _lockstep_faults(root / "lockstep")
    notes += [f"{o.fault}: {o.note}" for o in outcomes if o.note]
    return SuiteResult([*rows, *(row for o in outcomes for row in o.rows())], notes=notes)
