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
`--resume`), a Sandblaster replica mid-portion, a sync worker and a model-parallel grid
worker; a Downpour replica stopped (SIGSTOP: alive but silent, for the watchdog) and, as its
control, one killed and not restarted (the run goes on with one replica); a full disk (a
tmpfs filled up: the run stops with one line, space is freed, `--resume`); and a whole
testnet host with its Ray node, holding a shard primary (three emulated hosts). The last two
need root; without it their rows are left out and a note says why.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.faults_host import lose_a_shard_host
from benchmarks.testnet import available
from scaleout.api import Run, prepare
from scaleout.errors import DiskError
from scaleout.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
KILL_AT = 700  # steps (Downpour, sync), after the checkpoints at 500 (Downpour), 600 (sync)
# Two asynchronous Downpour runs differ a little (the order of the replicas' pushes): the
# faulted runs are compared with the mean of this many fault-free ones, whose spread is shown.
NUM_REFERENCES = 3

DOWNPOUR = (
    "configs/mnist_downpour.toml",
    [
        "downpour.mode=gradients",  # the demo's config runs DiLoCo; these runs push gradients
        "downpour.n_fetch=3",
        "downpour.n_push=3",
        "model.sizes=[784, 256, 10]",
        "model.dropout=0.0",
        "train.steps=2000",
        "train.batch_size=128",
        "train.lr=0.05",
        "train.eval_every=500",
        "train.checkpoint_every=500",
        "downpour.warmstart_steps=0",
        "downpour.shard_backups=1",
        "downpour.shard_checkpoint_every=100",
    ],
)
SYNC = (
    "configs/mnist_sync.toml",
    [
        "data.num_train=16384",
        "model.sizes=[784, 256, 10]",
        "model.dropout=0.0",
        "train.steps=900",
        "train.eval_every=300",
        "train.checkpoint_every=300",
    ],
)
SANDBLASTER = (
    "configs/mnist_sandblaster.toml",
    ["data.num_train=8192", "sandblaster.max_iterations=40", "sandblaster.num_replicas=3"],
)
MODEL_PARALLEL = (
    "configs/autoencoder_model_parallel.toml",
    ["train.steps=60", "train.checkpoint_every=20", "train.eval_every=20"],
)
COMMON = ["data.num_test=10000", "run.num_threads=1"]


@dataclass
class Outcome:
    """What one fault did to its run, beside the fault-free run."""

    fault: str
    survived: bool
    updates_lost: int
    steps_redone: int
    extra_s: float
    quality: float  # accuracy (pp) or test loss (%) against the fault-free run
    quality_unit: str
    note: str = ""

    def rows(self) -> list[Row]:
        f = self.fault
        better = "higher" if self.quality_unit == "pp" else "lower"
        target = -0.3 if self.quality_unit == "pp" else 1.0
        return [
            Row(f"{f}: survived", float(self.survived), "yes (1) / no (0)", "higher", target=1),
            Row(f"{f}: updates lost", self.updates_lost, "updates or steps", "lower", target=0),
            Row(f"{f}: steps redone", self.steps_redone, "steps", "lower"),
            Row(f"{f}: extra wall time", self.extra_s, "s", "lower"),
            Row(f"{f}: vs fault-free", self.quality, self.quality_unit, better, target=target),
        ]


@dataclass
class Done:
    """A finished run: its summary (the last checkpoint's and the driver's) and its time."""

    summary: dict[str, Any]
    seconds: float
    steps: int
    planned: int
    rate: float = 0.0  # the median of the logged examples/s (start-up and evaluations aside)


def _overrides(setup: tuple[str, list[str]], root: Path, name: str, *more: str) -> list[str]:
    return [*setup[1], *COMMON, f"run.out_dir='{root}'", f"run.name='{name}'", *more]


def _train(run: Run, fault: Callable[[Run], None] | None = None) -> Done:
    """Train `run`; `fault(run)` runs in a thread beside it (it waits for its moment)."""
    if fault is not None:
        threading.Thread(target=fault, args=(run,), daemon=True).start()
    started = time.perf_counter()
    result = run.train()
    seconds = time.perf_counter() - started
    planned = run.strategy.plan().total_steps
    rates = [
        r["examples_per_s"] for r in read_metrics(run.run_dir.metrics) if "examples_per_s" in r
    ]
    return Done(result.summary, seconds, result.step, planned, statistics.median(rates or [0.0]))


def _mean(references: list[Done]) -> Done:
    """The fault-free runs as one: mean final accuracy, median seconds and examples/s."""
    accuracy = statistics.mean(r.summary["final_test_accuracy"] for r in references)
    return Done(
        {**references[0].summary, "final_test_accuracy": accuracy},
        statistics.median(r.seconds for r in references),
        references[0].steps,
        references[0].planned,
        statistics.median(r.rate for r in references),
    )


def _spread(name: str, accuracies: list[float]) -> Row:
    """How far apart the fault-free runs ended: the noise the faulted runs are read against."""
    return Row(
        f"{name}: fault-free spread", 100 * (max(accuracies) - min(accuracies)), "pp", "lower"
    )


def _quality(done: Done, reference: Done) -> tuple[float, str]:
    mine, theirs = done.summary.get("final_test_accuracy"), reference.summary
    if mine is not None and theirs.get("final_test_accuracy") is not None:
        return 100 * (mine - theirs["final_test_accuracy"]), "pp"
    loss, expected = done.summary["final_test_loss"], theirs["final_test_loss"]
    return 100 * (loss - expected) / expected, "% test loss"


def _outcome(fault: str, done: Done, reference: Done, redone: int, note: str = "") -> Outcome:
    quality, unit = _quality(done, reference)
    lost = done.summary.get("shard_updates_lost", 0) + (done.planned - done.steps)
    survived = done.steps == done.planned
    extra = done.seconds - reference.seconds
    return Outcome(fault, survived, lost, redone, extra, quality, unit, note)


def _when(condition: Callable[[], bool], action: Callable[[], None]) -> Callable[[Run], None]:
    def wait_then_act(run: Run) -> None:
        deadline = time.monotonic() + 600
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        action()

    return wait_then_act


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# --- faults in this process's runs --------------------------------------------------------------


def _downpour(root: Path, name: str, *more: str) -> Run:
    overrides = _overrides(DOWNPOUR, root, name, *more)
    return prepare(REPO / DOWNPOUR[0], overrides=overrides, overwrite=True)


def _signal_replica_or_shard(
    root: Path,
    reference: Done,
    fault: str,
    pid_of: Callable[[Run], int],
    sig: int,
    more: list[str],
) -> Outcome:
    """Send `sig` to the process `pid_of(run)` names once the run passed `KILL_AT`."""
    faulted = _downpour(root, "_".join(fault.split()[1:3]), *more)
    signalled: list[int] = []
    at: list[int] = []

    def act() -> None:
        signalled.append(pid_of(faulted))
        at.append(faulted.strategy.step)
        _kill(signalled[-1], sig)

    done = _train(faulted, _when(lambda: faulted.strategy.step >= KILL_AT, act))
    for pid in signalled:  # a stopped process the watchdog did not end
        _kill(pid)
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
    return _outcome(fault, done, reference, done.summary.get("steps_lost", 0), note)


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
        reference = _train(
            prepare(config, overrides=_overrides(setup, root, "ref"), overwrite=True)
        )
        faulted = prepare(config, overrides=_overrides(setup, root, "faulted"), overwrite=True)

        def act(r: Run = faulted) -> None:
            _kill(r.strategy.workers.group.pids[1])

        done = _train(faulted, _when(lambda r=faulted, at=at: r.strategy.step >= at, act))
        redone = done.summary.get("steps_redone", 0)
        outcomes.append(_outcome(fault, done, reference, redone))
    return outcomes


def _sandblaster_fault(root: Path) -> Outcome:
    import ray

    config = REPO / SANDBLASTER[0]
    reference = _train(
        prepare(config, overrides=_overrides(SANDBLASTER, root, "ref"), overwrite=True)
    )
    faulted = prepare(config, overrides=_overrides(SANDBLASTER, root, "faulted"), overwrite=True)

    def act(r: Run = faulted) -> None:
        _kill(ray.get(r.strategy.replicas[2].pid.remote()))

    done = _train(faulted, _when(lambda: faulted.strategy.batch_id >= 10, act))
    note = f"replica failures {done.summary.get('replica_failures')}"
    return _outcome("sandblaster replica SIGKILL mid-portion", done, reference, 0, note)


# --- faults that end the driver's own process -------------------------------------------------


def _cli(setup: tuple[str, list[str]], root: Path, name: str, *flags: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "scaleout", "train", setup[0], *flags]
    for override in _overrides(setup, root, name):
        args += ["--set", override]
    return subprocess.Popen(
        args,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a kill takes its Ray processes too
    )


def _summary_of(run_dir: Path) -> dict[str, Any]:
    """A finished run's figures from its files: the last metrics line and checkpoint."""
    from scaleout.checkpoint import CheckpointDir, load_checkpoint

    records = read_metrics(run_dir / "metrics.jsonl")
    evaluated = [r for r in records if "test_accuracy" in r]
    _, meta = load_checkpoint(CheckpointDir(run_dir / "checkpoints").latest())
    return {
        "final_test_accuracy": evaluated[-1]["test_accuracy"],
        "shard_updates_lost": meta.get("shard_updates_lost", 0),
        "step": meta["step"],
    }


def _driver_fault(root: Path, reference: Done) -> Outcome:
    """The driver and its process group SIGKILLed after the checkpoint at 500, then
    `--resume`; the steps since that checkpoint are done again."""
    name = "driver"
    run_dir = root / name
    started = time.perf_counter()
    first = _cli(DOWNPOUR, root, name, "--overwrite")
    try:
        while not any(r.get("step", 0) >= KILL_AT for r in _records(run_dir)):
            if first.poll() is not None:
                raise RuntimeError(f"the run ended before the kill: {first.stderr.read()[-500:]}")
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    killed_at = max(r["step"] for r in _records(run_dir))
    second = _cli(DOWNPOUR, root, name, "--resume")
    _, stderr = second.communicate()
    seconds = time.perf_counter() - started
    if second.returncode != 0:
        raise RuntimeError(f"--resume failed: {stderr[-500:]}")
    resumed_at = int(stderr.split(" at step ")[1].split()[0])
    summary = _summary_of(run_dir)
    done = Done(summary, seconds, summary["step"], reference.planned)
    return _outcome("driver SIGKILL, then --resume", done, reference, killed_at - resumed_at)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


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
        faulted = prepare(config, overrides=_overrides(DOWNPOUR, disk, "disk"), overwrite=True)

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
        resumed = prepare(config, overrides=_overrides(DOWNPOUR, disk, "disk"), resume=True)
        saved = resumed.run_dir.checkpoints.steps()
        result = resumed.train()
        seconds = time.perf_counter() - started
        summary = {**_summary_of(disk / "disk"), **result.summary}
        done = Done(summary, seconds, result.step, reference.planned)
        redone = int(stopped.group(1)) - saved[-1] if stopped and saved else 0
        return _outcome("full disk, then --resume", done, reference, redone, message[:200])
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
    spread = _spread(fault, [r["final_test_accuracy"] for r in loss.references])
    return _outcome(fault, done, reference, 0, note), spread


@register_suite("faults", "injected faults: survived, lost, redone, extra time, accuracy")
def run() -> SuiteResult:
    notes = [__doc__.split("\n\n")[1].replace("\n", " ")]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        root = Path(tmp)
        references = [
            _train(_downpour(root / "downpour", f"reference_{i}")) for i in range(NUM_REFERENCES)
        ]
        reference = _mean(references)
        unguarded = _train(_downpour(root / "downpour", "no_backups", "downpour.shard_backups=0"))
        rows = [
            Row(
                "shard backups: examples/s with / without",
                reference.rate / max(unguarded.rate, 1e-9),
                "x",
                "higher",
            ),
            _spread("downpour", [r.summary["final_test_accuracy"] for r in references]),
        ]
        outcomes += _downpour_faults(root / "downpour", reference)
        outcomes.append(_driver_fault(root / "downpour", reference))
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
