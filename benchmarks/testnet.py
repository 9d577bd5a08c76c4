"""A Ray cluster over emulated machines: `../shared/tools/testnet` hosts on one box.

Each host is a network namespace joined to a switch by a rate-limited link; a Ray node runs
in each (the head in host 0), token authentication on, and the driver joins from host 0
with `--address`. Traffic between the nodes really crosses the limited links, and a host
can be lost whole: `kill_host` SIGKILLs every process in its namespace (its raylet, object
store and workers), as a machine that loses power would. The two-host tests and the fault
benchmark use it. Needs root, iproute2 and the testnet tool (`available()` says what
is missing).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaleout.runtime import WORKER_NICENESS

REPO = Path(__file__).resolve().parents[1]
TESTNET = Path(os.environ.get("SCALEOUT_TESTNET", REPO.parent / "shared" / "tools" / "testnet"))
BIN = Path(sys.executable).parent


def available() -> str | None:
    """None when testnet clusters can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not TESTNET.exists():
        return f"needs the testnet tool at {TESTNET}"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def run_tool(prefix: str, *args: str, timeout: float = 120) -> str:
    """`testnet ARGS...` for the test networks named `prefix`; its output."""
    env = {**os.environ, "TESTNET_PREFIX": prefix}
    done = subprocess.run(
        [str(TESTNET), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"testnet {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@dataclass
class Host:
    """One emulated machine: its namespace's index and address, and its Ray node's offer."""

    index: int
    address: str
    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)


@dataclass
class TestnetCluster:
    """Hosts with a Ray node each; `run` starts a command in a host, joined to the cluster."""

    prefix: str
    hosts: list[Host]
    port: int
    token: str
    temp_dir: str

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "TESTNET_PREFIX": self.prefix}

    @property
    def address(self) -> str:
        return f"{self.hosts[0].address}:{self.port}"

    def ray_env(self) -> list[str]:
        return ["env", "RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN={self.token}"]

    def tool(self, *args: str, timeout: float = 120) -> str:
        return run_tool(self.prefix, *args, timeout=timeout)

    def popen(self, host: int, args: Sequence[str], **kwargs: Any) -> subprocess.Popen:  # noqa: ANN401
        """Start `args` inside `host` with the cluster's token (a driver joins with
        `--address cluster.address`)."""
        command = [str(TESTNET), "exec", str(host), *self.ray_env(), *args]
        return subprocess.Popen(command, env=self.env, **kwargs)

    def train(self, host: int, config: Path, *flags: str, **kwargs: Any) -> subprocess.Popen:  # noqa: ANN401
        """`scaleout train CONFIG --address ...` inside `host`."""
        args = [sys.executable, "-m", "scaleout", "train", str(config), *flags]
        return self.popen(host, [*args, "--address", self.address], **kwargs)

    def host_of(self, address: str) -> int:
        return next(h.index for h in self.hosts if h.address == address)

    def link_bytes(self, host: int, direction: str) -> int:
        """Bytes that crossed `host`'s link so far, `direction` "rx" or "tx"."""
        path = f"/sys/class/net/eth0/statistics/{direction}_bytes"
        return int(self.tool("exec", str(host), "cat", path))

    def join(self, host: int) -> None:
        """Start host `host`'s Ray node (host 0's is the head), offering its CPUs and
        resources to the cluster."""
        entry = self.hosts[host]
        args = [str(BIN / "ray"), "start", f"--node-ip-address={entry.address}"]
        args += [f"--num-cpus={entry.num_cpus}", "--disable-usage-stats"]
        if entry.resources:
            args.append(f"--resources={json.dumps(entry.resources)}")
        if host == 0:
            args += ["--head", f"--port={self.port}", "--include-dashboard=false"]
            args.append(f"--temp-dir={self.temp_dir}")  # short: Ray's socket paths
        else:
            args.append(f"--address={self.address}")
        # workers at the driver's niceness, as an embedded session's (`scaleout.runtime`):
        # at Ray's default of 15 the raylets and the shards preempt the replicas
        niceness = f"RAY_worker_niceness={WORKER_NICENESS}"
        self.tool("exec", str(host), *self.ray_env(), niceness, *args)

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process in `host` (its Ray node and everything on it); the PIDs."""
        listed = subprocess.run(
            ["ip", "netns", "pids", f"{self.prefix}-h{host}"],
            capture_output=True,
            text=True,
            check=True,
        )
        pids = [int(p) for p in listed.stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


def measure_link(rate: str, port: int = 5599) -> tuple[float, float]:
    """(bytes/s, one-way latency in s) of the link between two testnet hosts at `rate`:
    `scaleout.sim.measure_link` serves in host 1 and probes from host 0."""
    reason = available()
    if reason is not None:
        raise RuntimeError(f"cannot measure a testnet link: {reason}")
    prefix = f"sl{os.getpid() % 10000}"
    env = {**os.environ, "TESTNET_PREFIX": prefix}
    module = [sys.executable, "-m", "scaleout.sim.measure_link"]
    run_tool(prefix, "up", "2", rate)
    try:
        server = subprocess.Popen([str(TESTNET), "exec", "1", *module, "serve", str(port)], env=env)
        try:
            probe = [*module, "probe", run_tool(prefix, "addr", "1"), str(port)]
            answer = run_tool(prefix, "exec", "0", *probe, timeout=300)
        finally:
            try:
                server.wait(timeout=30)  # it ends when the probe closes its connection
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        measured = json.loads(answer.splitlines()[-1])
        return measured["bytes_per_s"], measured["latency_s"]
    finally:
        run_tool(prefix, "down")


def measure_network(rate: str, apply_ns: float, sizes: Sequence[int]) -> dict[str, Any]:
    """The `Calibration` fields two testnet hosts at `rate` give: the link (`link`), and
    what a shard call of each of `sizes` values costs beyond itself across it
    (`pull_across`, `push_across`; `apply_ns`: the shard's SGD update per value)."""
    from scaleout.sim.calibration import LinkCost, MessageCost

    bytes_per_s, latency_s = measure_link(rate)
    across = measure_crossing(rate, apply_ns, bytes_per_s, sizes)
    return {
        "link": LinkCost(bytes_per_s=bytes_per_s, latency_s=latency_s),
        "pull_across": MessageCost.model_validate(across["pull"]),
        "push_across": MessageCost.model_validate(across["push"]),
    }


def measure_crossing(
    rate: str, apply_ns: float, bytes_per_s: float, sizes: Sequence[int]
) -> dict[str, Any]:
    """What a shard call costs beyond itself with the shard on the other of two testnet
    hosts at `rate` (`scaleout.sim.measure_crossing`, the caller in host 0; `bytes_per_s`:
    the link as measured): {"pull": ..., "push": ...}, `MessageCost` fields each."""
    from scaleout.sim.measure_crossing import FAR, NEAR

    with testnet_cluster(num_cpus=[1, 1], resources=[{NEAR: 100}, {FAR: 100}], rate=rate) as c:
        args = [sys.executable, "-m", "scaleout.sim.measure_crossing", c.address, str(apply_ns)]
        args += [str(bytes_per_s), *(str(size) for size in sizes)]
        probe = c.popen(0, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = probe.communicate(timeout=900)
    if probe.returncode != 0:
        raise RuntimeError(f"measuring calls across testnet hosts failed: {err[-1500:]}")
    return json.loads(out.strip().splitlines()[-1])


@contextmanager
def testnet_cluster(
    num_cpus: Sequence[int],
    resources: Sequence[dict[str, float]] | None = None,
    rate: str = "1gbit",
    started: int | None = None,
) -> Iterator[TestnetCluster]:
    """`len(num_cpus)` hosts at `rate`, host i with a Ray node offering `num_cpus[i]` CPUs
    and `resources[i]`; everything in them ends (and the namespaces go) on exit. `started`:
    only the first so many hosts start their node (`TestnetCluster.join` starts the others:
    a host joining the cluster)."""
    reason = available()
    if reason is not None:
        raise RuntimeError(f"no testnet cluster: {reason}")
    resources = list(resources or [{} for _ in num_cpus])
    prefix = f"so{os.getpid() % 10000}"
    pid = os.getpid()
    port, token = 6300 + pid % 500, secrets.token_hex(16)
    cluster = TestnetCluster(prefix, [], port, token, f"/tmp/so_ray_{pid}")
    cluster.tool("up", str(len(num_cpus)), rate)
    try:
        for i, (cpus, offer) in enumerate(zip(num_cpus, resources, strict=True)):
            cluster.hosts.append(Host(i, cluster.tool("addr", str(i)), cpus, dict(offer)))
        for host in cluster.hosts[:started]:
            cluster.join(host.index)
        yield cluster
    finally:
        cluster.tool("down")
