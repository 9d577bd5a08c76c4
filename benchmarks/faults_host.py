"""A whole machine lost under Downpour: a testnet host holding a shard primary killed.

Three emulated hosts (`benchmarks.testnet`): host 0 runs the driver (and the keeper
that starts the shards' backups) and offers 2 CPUs for replicas; hosts 1 and 2 offer the
shards' resource and a CPU each, so every primary has its backup on the other of the two.
A run with `shard_backups = 1` is made on the same cluster without a fault (once or more:
two asynchronous runs differ a little) and once with the host holding shard 0's primary
killed whole (its raylet, object store, shard processes and any replica on it SIGKILLed)
after `kill_after` steps. The primary's backup
takes over; the replica that was there, if any, is restarted elsewhere.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.testnet import testnet_cluster

CONFIG = """
[run]
name = "{name}"
device = "cpu"
num_threads = 1
out_dir = "{out}"
[data]
dataset = "mnist"
num_train = {num_train}
num_test = 10000
[model]
kind = "mlp"
sizes = [784, 128, 10]
[train]
strategy = "downpour"
steps = {steps}
batch_size = 64
optimizer = "adagrad"
lr = 0.05
eval_every = 200
log_every = 50
checkpoint_every = 200
[downpour]
num_replicas = {num_replicas}
num_shards = 2
warmstart_steps = 0
shard_resource = "ps"
shard_backups = 1
{pin}"""

SHARDS_LINE = re.compile(r"shards on \[([^\]]*)\]")
BACKUPS_LINE = re.compile(r"backups on \[([^\]]*)\]")


@dataclass
class HostLoss:
    """The runs' last checkpoint metadata, their seconds, and what was killed."""

    references: list[dict[str, Any]]  # the fault-free runs
    lost: dict[str, Any]
    reference_s: float  # the median fault-free run's seconds
    lost_s: float
    victim: int  # the host killed
    killed: int  # processes SIGKILLed in it
    shard_hosts: list[str]  # the address of each shard's primary
    backup_hosts: list[str]  # and of its backup

    @property
    def reference_accuracy(self) -> float:
        """The fault-free runs' mean final test accuracy (asynchronous runs differ a little
        from one another; the spread is `max - min` of `references`)."""
        return statistics.mean(r["final_test_accuracy"] for r in self.references)


def last_meta(run_dir: Path) -> dict[str, Any]:
    """The last checkpoint's metadata, with the final test accuracy beside it."""
    sidecar = sorted((run_dir / "checkpoints").glob("step_*.json"))[-1]
    meta = json.loads(sidecar.read_text())["meta"]
    meta["final_test_accuracy"] = meta["metrics"].get("test_accuracy")
    return meta


def _last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = metrics.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def lose_a_shard_host(
    root: Path,
    steps: int = 800,
    kill_after: int = 300,
    num_train: int = 16384,
    num_references: int = 1,
    num_replicas: int = 2,
    pin_replicas: bool = False,
) -> HostLoss:
    """Run `num_references` fault-free runs and the faulted run on one testnet cluster (see
    the module). `pin_replicas`: the replicas run in host 0 only (which is never killed), so
    that the host's loss takes shards and nothing else: with one replica, a run is then
    deterministic, and a failover that loses nothing logs the fault-free run's metrics."""
    root.mkdir(parents=True, exist_ok=True)
    names = [f"reference_{i}" for i in range(num_references)] + ["lost"]
    configs = {}
    for name in names:
        configs[name] = root / f"{name}.toml"
        text = CONFIG.format(
            name=name,
            out=root / "runs",
            steps=steps,
            num_train=num_train,
            num_replicas=num_replicas,
            pin='replica_resource = "driver_host"\n' if pin_replicas else "",
        )
        configs[name].write_text(text)
    resources = [{"driver_host": 100}, {"ps": 100}, {"ps": 100}]
    with testnet_cluster(num_cpus=[2, 1, 1], resources=resources) as cluster:
        seconds = []
        for name in names[:-1]:
            started = time.perf_counter()
            reference = cluster.train(
                0, configs[name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            _, err = reference.communicate(timeout=600)
            seconds.append(time.perf_counter() - started)
            if reference.returncode != 0:
                raise RuntimeError(f"the fault-free run failed: {err[-800:]}")
        started = time.perf_counter()
        # The placement line, like every message of the run, is on stderr (the summary on
        # stdout is not needed: the checkpoints hold it).
        run = cluster.train(
            0, configs["lost"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        assert run.stderr is not None
        shard_hosts: list[str] = []
        backup_hosts: list[str] = []
        for line in run.stderr:
            found = SHARDS_LINE.search(line)
            if found:
                shard_hosts = _addresses(found.group(1))
                backups = BACKUPS_LINE.search(line)
                backup_hosts = _addresses(backups.group(1)) if backups else []
                break
        if not shard_hosts:
            raise RuntimeError("the run never said where its shards are")
        rest: list[str] = []  # the rest of its output, read on so that it never blocks
        threading.Thread(target=lambda: rest.extend(run.stderr), daemon=True).start()
        victim = cluster.host_of(shard_hosts[0])
        metrics = root / "runs" / "lost" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while _last_step(metrics) < kill_after:
            if run.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the run ended (or stalled) before the host was killed")
            time.sleep(0.2)
        killed = cluster.kill_host(victim)
        if run.wait(timeout=600) != 0:
            output = "".join(rest)
            # From the run's last traceback on: its first frame names the call that failed.
            failure = output[max(output.rfind("Traceback (most recent call last)"), 0) :]
            raise RuntimeError(f"the run did not survive the host's loss: {failure}")
        lost_s = time.perf_counter() - started
    return HostLoss(
        [last_meta(root / "runs" / name) for name in names[:-1]],
        last_meta(root / "runs" / "lost"),
        statistics.median(seconds),
        lost_s,
        victim,
        len(killed),
        shard_hosts,
        backup_hosts,
    )


def _addresses(listed: str) -> list[str]:
    return [a.strip(" '\"") for a in listed.split(",")]
