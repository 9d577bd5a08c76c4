"""Downpour SGD across two hosts: network namespaces joined by a rate-limited link.

`../shared/tools/testnet up 2 1gbit` makes two hosts; a Ray head (with the shards' custom
resource) runs in host 0, a worker node in host 1, token authentication on. The driver runs
in host 0 and joins with `--address`; shards must land on host 0 and the two replicas on
both hosts, and the bytes that cross host 1's link are measured. Needs root (CI has it).
"""

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTNET = REPO.parent / "shared" / "tools" / "testnet"
BIN = Path(sys.executable).parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not TESTNET.exists() or shutil.which("ip") is None,
        reason="needs root, iproute2 and ../shared/tools/testnet",
    ),
]

CONFIG = """
[run]
name = "twohost"
device = "cpu"
num_threads = 1
out_dir = "{out}"
[data]
dataset = "mnist"
num_train = 8192
num_test = 2000
[model]
kind = "mlp"
sizes = [784, 128, 10]
[train]
strategy = "downpour"
steps = 300
batch_size = 64
optimizer = "adagrad"
lr = 0.05
eval_every = 150
log_every = 50
[downpour]
num_replicas = 2
num_shards = 2
warmstart_steps = 0
shard_resource = "ps"
"""


def test_downpour_on_two_hosts(tmp_path):
    env = {**os.environ, "TESTNET_PREFIX": f"so{os.getpid() % 10000}"}
    token = secrets.token_hex(16)
    ray_env = ["env", "RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN={token}"]

    def testnet(*args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [str(TESTNET), *args], env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def link_bytes(direction: str) -> int:
        return int(testnet("exec", "1", "cat", f"/sys/class/net/eth0/statistics/{direction}_bytes"))

    testnet("up", "2", "1gbit")
    try:
        head, worker = testnet("addr", "0"), testnet("addr", "1")
        port = 6300 + os.getpid() % 500
        testnet(
            "exec",
            "0",
            *ray_env,
            str(BIN / "ray"),
            "start",
            "--head",
            f"--node-ip-address={head}",
            f"--port={port}",
            "--num-cpus=1",
            '--resources={"ps": 100}',
            f"--temp-dir=/tmp/so_ray_{os.getpid()}",  # short: Ray's socket paths
            "--include-dashboard=false",
            "--disable-usage-stats",
        )
        testnet(
            "exec",
            "1",
            *ray_env,
            str(BIN / "ray"),
            "start",
            f"--address={head}:{port}",
            f"--node-ip-address={worker}",
            "--num-cpus=2",
            "--disable-usage-stats",
        )
        config = tmp_path / "twohost.toml"
        config.write_text(CONFIG.format(out=tmp_path / "runs"))
        received, sent, started = link_bytes("rx"), link_bytes("tx"), time.monotonic()
        run = subprocess.run(
            [
                str(TESTNET),
                "exec",
                "0",
                *ray_env,
                sys.executable,
                "-m",
                "scaleout",
                "train",
                str(config),
                "--address",
                f"{head}:{port}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        seconds = time.monotonic() - started
        received, sent = link_bytes("rx") - received, link_bytes("tx") - sent
        assert run.returncode == 0, run.stderr
        sidecar = sorted((tmp_path / "runs" / "twohost" / "checkpoints").glob("step_*.json"))[-1]
        meta = json.loads(sidecar.read_text())["meta"]
        assert meta["step"] == 300
        assert set(meta["placement"]["shards"]) == {head}
        assert set(meta["placement"]["replicas"]) == {head, worker}
        # The replica on host 1 pulls and pushes the whole model (101,770 floats) every step;
        # it does a share of the 300 steps (the replica beside the shards is faster).
        assert received > 100 * 4 * 101_770 and sent > 100 * 4 * 101_770
        print(
            f"\ntwo hosts, 1 Gbit/s: {seconds:.1f} s; host 1 link: {received / 1e6:.1f} MB in, "
            f"{sent / 1e6:.1f} MB out"
        )
    finally:
        testnet("down")
