"""The `simulate` suite's cases across two testnet hosts: real runs and their calibration.

A case with a link rate runs on two `../shared/tools/testnet` hosts of this machine joined by
a link at that rate (`benchmarks.testnet`): a Ray node in each offering one CPU, the
driver in host 0. Each replica needs a CPU, so each host runs one; the shards take none:
with backups primary i starts on host i mod 2, without them Ray spreads them, mostly one a
host. That is the simulator's placement on two machines (one replica a machine, shard i on
machine i mod 2), with `one_box` (the hosts share this machine's cores). The run's own
placement, kept in its checkpoints, is checked: a run that put both shards on one host
(Ray's spreading does, now and then; a node's custom resources must be whole numbers, so
they cannot hold it to one shard) is run again, up to `ATTEMPTS` times.

Once per rate two hosts give the calibration its network (`testnet.measure_network`): the
link, and what a shard call costs beyond itself when the shard is on the other host
(`pull_across`, `push_across`, at the sizes the cases send); a case is priced with them
(`--link calibrated`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from benchmarks import testnet
from benchmarks.faults_host import last_meta
from scaleout.sim.calibration import Calibration

NUM_HOSTS = 2
ATTEMPTS = 4
TIMEOUT_S = 900  # one run at 100 Mbit: about a minute


def available() -> str | None:
    """None when the testnet cases can run here, else why not."""
    return testnet.available()


def measure_networks(
    rates: list[str], apply_ns: float, sizes: list[int]
) -> dict[str, dict[str, Any]]:
    """Per rate, what two testnet hosts joined at it give a calibration
    (`testnet.measure_network`: the link, shard calls of `sizes` values across it)."""
    return {rate: testnet.measure_network(rate, apply_ns, sizes) for rate in rates}


def with_network(calibration: Path, network: dict[str, Any], out: Path) -> Path:
    """The calibration at `calibration` with a measured `network` (its link, calls across
    it), saved at `out`."""
    return Calibration.load(calibration).model_copy(update=network).save(out)


def examples_per_s(run_dir: Path) -> float:
    """A finished run's examples/s (on testnet hosts or not): its last metrics line's
    examples over its time."""
    from scaleout.metrics import read_metrics

    last = read_metrics(run_dir / "metrics.jsonl")[-1]
    return last["examples"] / last["time_s"]


def measured(config: Path, overrides: list[str], rate: str, run_dir: Path) -> float:
    """examples/s of one real run of `config` on two hosts at `rate` (its last metrics line's
    examples over its time), placed as the simulation places it; raises when the run failed
    or no attempt was placed so."""
    for _ in range(ATTEMPTS):
        placement, hosts = _run(config, overrides, rate, run_dir)
        if all(sorted(placement[role]) == hosts for role in ("replicas", "shards")):
            return examples_per_s(run_dir)
    raise RuntimeError(
        f"{ATTEMPTS} runs on testnet hosts, none with one replica and one shard on each of "
        f"{hosts}: the last put its replicas on {placement['replicas']}, its shards on "
        f"{placement['shards']}"
    )


def _run(
    config: Path, overrides: list[str], rate: str, run_dir: Path
) -> tuple[dict[str, list[str]], list[str]]:
    """One run on fresh hosts: its placement (node addresses per role) and the hosts'."""
    args = ["--overwrite"]
    for override in overrides:
        args += ["--set", override]
    with testnet.testnet_cluster(num_cpus=[1] * NUM_HOSTS, rate=rate) as cluster:
        run = cluster.train(0, config, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _, err = run.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            run.kill()
            _, err = run.communicate()
        hosts = sorted(host.address for host in cluster.hosts)
    if run.returncode != 0:
        tail = err.decode(errors="replace")[-1500:]
        raise RuntimeError(f"the run on testnet hosts at {rate} failed: {tail}")
    return last_meta(run_dir)["placement"], hosts
