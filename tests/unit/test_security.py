"""What listens where, and the token that guards a cluster join.

A run on one machine keeps every socket on loopback: the embedded Ray instance (GCS,
raylet, agents, workers) and a local torch.distributed group (its TCPStore and gloo's
pairs). Joining a cluster turns Ray's token authentication on, and a missing or rejected
token is one line. The sockets are read from /proc (Linux), so no extra package is needed.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from scaleout.comm import free_port

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc (Linux)"
)

# --- listening sockets, from /proc ---------------------------------------------------------


def _address(hex_address: str) -> str:
    """A /proc/net/tcp{,6} address ("0100007F" / 32 hex digits, host byte order per word)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # the process is gone
        return []
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host, port = fields[1].split(":")
                found.append((_address(host), int(port, 16)))
    return found


def test_loopback_store_keeps_torchrun_and_remote_hosts_as_they_were(monkeypatch):
    from scaleout.comm.group import _is_loopback, _loopback_store

    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert _is_loopback("127.0.1.1")  # Debian's host-name address is loopback too
    assert not _is_loopback("10.0.0.2") and not _is_loopback("node-1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert _loopback_store(0, 2, "127.0.0.1", free_port(), None) is None  # torchrun's store


def test_local_group_leaves_a_chosen_gloo_interface_and_unsets_its_own(monkeypatch):
    from scaleout.comm import destroy_distributed, init_distributed

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        init_distributed(backend="gloo")
        assert os.environ.get("GLOO_SOCKET_IFNAME") == "lo"
        assert ("127.0.0.1", int(os.environ["MASTER_PORT"])) in listening(os.getpid())
    finally:
        destroy_distributed()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the user's: still set after leaving
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    try:
        init_distributed(backend="gloo")
    finally:
        destroy_distributed()
    assert os.environ.get("GLOO_SOCKET_IFNAME") == "lo"


def test_an_auth_failure_is_recognised_in_rays_error_chain():
    from scaleout.runtime.security import is_auth_failure

    cause = RuntimeError("Failed to connect to GCS. ... Unauthenticated: RPC error")
    try:
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from cause
    except ConnectionError as error:
        assert is_auth_failure(error)
    assert not is_auth_failure(ConnectionError("Failed to connect to Ray cluster"))
