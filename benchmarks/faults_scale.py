"""Suite `faults`, replicas joining and leaving a running Downpour run: `scaleout scale` from
one replica to two and back, and an elastic run that a testnet host joins and then leaves
(its Ray node killed whole). Each row says how long a new replica took from what asked for
it (the command; the host's `ray start`) to its first push, the examples/s while it joined
against before, the updates lost (none may be), and the accuracy against fault-free runs."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.faults_common import Done, Outcome, downpour, outcome, train
from benchmarks.faults_host import CONFIG, last_meta
from benchmarks.testnet import available, testnet_cluster
from scaleout.api import Run
from scaleout.metrics import read_metrics
from scaleout.strategies.downpour.scaling import request_scale

GROW_AT, SHRINK_AT = 500, 1300  # steps of the 2000-step fault-free Downpour run
HOST_STEPS, HOST_JOINS_AT, HOST_LEAVES_AT = 1500, 300, 900
HOST_FAULT = "testnet host joins, then leaves an elastic run"


def _rate_while_joining(records: list[dict[str, Any]], asked: int, joined: int) -> float | None:
    """The median examples/s of the windows from the step a replica was asked for to the
    one it joined at, over the median of the windows before (the first window aside: it
    holds the start)."""
    before = [r["examples_per_s"] for r in records[1:] if r["step"] <= asked]
    during = [r["examples_per_s"] for r in records if asked < r["step"] <= joined + 1]
    if not during:  # joined within one window: the window it joined in
        during = [r["examples_per_s"] for r in records if r["step"] > asked][:1]
    if not before or not during:
        return None
    return statistics.median(during) / statistics.median(before)


def _metric_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "examples_per_s" in r]


def _joins(events: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first replica asked to join, and its joining (first push)."""
    asked = next(e for e in events if e["event"] == "asked to join")
    joined = next(e for e in events if e["event"] == "joined" and e["replica"] == asked["replica"])
    # (StopIteration: it never joined; the caller's row says so)
    return asked, joined


def _scale_one_two_one(root: Path, reference: Done) -> Outcome:
    """The fault-free Downpour run started with one replica, `scaleout scale` to two once it
    passed `GROW_AT` and back to one once it passed `SHRINK_AT` (the request a file the
    command writes, as from another shell)."""
    run = downpour(root, "scale", "downpour.num_replicas=1")

    def scale(r: Run) -> None:
        for step, count in ((GROW_AT, 2), (SHRINK_AT, 1)):
            while r.strategy.step < step:
                time.sleep(0.02)
            request_scale(r.run_dir.path, count)

    done = train(run, scale)
    events = run.strategy.events
    asked, joined = _joins(events)
    left = [e for e in events if e["event"] == "left"]
    dip = _rate_while_joining(_metric_records(run.run_dir.path), asked["step"], joined["step"])
    note = (
        f"one replica, then two from step {asked['step']}, one again from step "
        f"{left[0]['step'] if left else '?'} ({left[0]['detail'] if left else 'never left'}); "
        "compared with the fault-free runs of two replicas throughout"
    )
    redone = done.summary.get("steps_lost", 0)
    out = outcome("downpour scale 1 -> 2 -> 1 (scaleout scale)", done, reference, redone, note)
    out.join_s, out.dip = joined["first_push_s"], dip
    out.join_target = 10.0  # seconds from the command to the new replica's first push
    return out


def _host_joins_and_leaves(root: Path) -> Outcome | str:
    """Two testnet hosts; host 0 runs the driver, the shards and one replica (it offers one
    CPU). An elastic run (`max_replicas = 2`) passes `HOST_JOINS_AT`: host 1 starts its Ray
    node with a CPU, and the run starts a replica there; once it passed `HOST_LEAVES_AT`
    host 1 is killed whole, and the run goes on with one replica. The reference: the same
    run with one replica and no host joining."""
    reason = available()
    if reason is not None:
        return f"testnet host joining and leaving: left out ({reason})"
    root.mkdir(parents=True, exist_ok=True)
    configs = {}
    for name, extra in (("alone", ""), ("elastic", "elastic = true\nmax_replicas = 2\n")):
        text = CONFIG.format(
            name=name,
            out=root / "runs",
            steps=HOST_STEPS,
            num_train=60000,
            num_replicas=1,
            pin=extra,
        )
        configs[name] = root / f"{name}.toml"
        configs[name].write_text(text)
    resources = [{"ps": 100}, {}]
    with testnet_cluster(num_cpus=[1, 1], resources=resources, started=1) as cluster:
        started = time.perf_counter()
        alone = cluster.train(
            0, configs["alone"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        if alone.wait(timeout=900) != 0:
            raise RuntimeError(f"the reference run failed: {alone.stderr.read()[-800:]!r}")
        alone_s = time.perf_counter() - started
        started = time.perf_counter()
        run = cluster.train(
            0, configs["elastic"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        output: list[str] = []
        threading.Thread(target=lambda: output.extend(run.stderr), daemon=True).start()
        run_dir = root / "runs" / "elastic"
        _wait_for(run, run_dir, lambda rs: rs[-1]["step"] >= HOST_JOINS_AT)
        joined_at = time.time()
        cluster.join(1)
        _wait_for(run, run_dir, _joined_and_past(HOST_LEAVES_AT))
        cluster.kill_host(1)
        if run.wait(timeout=900) != 0:
            raise RuntimeError(f"the elastic run failed: {''.join(output)[-1500:]}")
        elastic_s = time.perf_counter() - started
    meta, reference = last_meta(run_dir), last_meta(root / "runs" / "alone")
    asked, joined = _joins(meta["scaling"])
    dip = _rate_while_joining(_metric_records(run_dir), asked["step"], joined["step"])
    done = Done(meta, elastic_s, meta["step"], HOST_STEPS)
    fault = HOST_FAULT
    left = [e for e in meta["scaling"] if e["event"] == "left"]
    note = (
        f"host 1 joined at step {asked['step']} (its `ray start` to the new replica's first "
        f"push: {joined['at'] - joined_at:.1f} s), left at step "
        f"{left[0]['step'] if left else '?'}; compared with the run of one replica alone"
    )
    alone_done = Done(reference, alone_s, reference["step"], HOST_STEPS)
    out = outcome(fault, done, alone_done, meta.get("steps_lost", 0), note)
    out.join_s, out.dip = joined["at"] - joined_at, dip
    return out


def _joined_and_past(step: int) -> Callable[[list[dict[str, Any]]], bool]:
    """Metrics lines that show a replica joined (its first push) and the run past `step`."""

    def met(records: list[dict[str, Any]]) -> bool:
        joined = any(c.startswith("+") for r in records for c in r.get("replicas_changed", []))
        return joined and records[-1]["step"] >= step

    met.__doc__ = f"a replica joined and the run passed step {step}"
    return met


def _wait_for(
    run: subprocess.Popen, run_dir: Path, condition: Callable[[list[dict[str, Any]]], bool]
) -> None:
    """Until the run's metrics lines meet `condition`; the run must not end first."""
    deadline = time.monotonic() + 600
    metrics = run_dir / "metrics.jsonl"
    while True:
        records = list(read_metrics(metrics)) if metrics.exists() else []
        if records and condition(records):
            return
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended (or stalled) before: {condition.__doc__}")
        time.sleep(0.2)


def scaling_faults(root: Path, reference: Done) -> tuple[list[Outcome], list[str]]:
    """The rows of this module (`reference`: the fault-free Downpour runs), and notes for
    what had to be left out."""
    outcomes, notes = [_scale_one_two_one(root, reference)], []
    try:
        host = _host_joins_and_leaves(root / "elastic_host")
    except (RuntimeError, StopIteration) as error:  # a row that says why it failed
        host = Outcome(HOST_FAULT, False, 0, 0, 0.0, 0.0, "pp", f"failed: {error}"[:400])
    if isinstance(host, str):
        notes.append(host)
    else:
        outcomes.append(host)
    return outcomes, notes
