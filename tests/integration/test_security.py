"""What listens where, and the token that guards a cluster join.

A run on one machine keeps every socket on loopback: the embedded Ray instance (GCS,
raylet, agents, workers) and a local torch.distributed group (its TCPStore and gloo's
pairs). Joining a cluster turns Ray's token authentication on, and a missing or rejected
token is one line. The sockets are read from /proc (Linux), so no extra package is needed.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from scaleout.comm import free_port, run_locally
from tests.unit.test_security import listening

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc (Linux)"
)

ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, p in parents.items() if p == parent]
        found += children
        frontier += children
    return found


def name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket bound to 127.0.0.1
    return ip.is_loopback


def not_loopback(pids: list[int]) -> list[str]:
    return [
        f"{name(pid)} (pid {pid}) on {address}:{port}"
        for pid in pids
        for address, port in listening(pid)
        if not is_loopback(address)
    ]


# --- embedded Ray ----------------------------------------------------------------------------


def test_embedded_ray_listens_on_loopback_only(ray_session):
    import ray

    @ray.remote(num_cpus=0)
    def where() -> tuple[str, int]:
        return ray.util.get_node_ip_address(), os.getpid()

    node_ip, worker = ray.get(where.remote())
    assert node_ip == "127.0.0.1"
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    pids = [os.getpid(), *descendants(os.getpid())]
    names = {name(pid) for pid in pids if listening(pid)}
    assert {"gcs_server", "raylet"} <= names, names  # the check is not vacuous
    assert listening(worker), "the worker's own gRPC server"
    assert not_loopback(pids) == []


def test_process_group_of_ray_actors_listens_on_loopback_only(ray_session):
    import ray
    from ray import cloudpickle

    from scaleout.comm import GroupMember, ProcessGroup

    class Member(GroupMember):
        def __init__(self, rank: int, world: int) -> None:
            self.rank = rank

        def sockets(self) -> tuple[str, str, str | None, list[tuple[str, int]], float]:
            import torch.distributed as dist

            t = torch.ones(1)
            dist.all_reduce(t)  # gloo's pairs are up
            return (
                os.environ["MASTER_ADDR"],
                os.environ["MASTER_PORT"],
                os.environ.get("GLOO_SOCKET_IFNAME"),
                listening(os.getpid()),
                t.item(),
            )

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = ProcessGroup.create(Member, 2, num_cpus=0.5)
    try:
        answers = ray.get([actor.sockets.remote() for actor in group.actors])
    finally:
        group.close()
    for master, _, interface, sockets, total in answers:
        assert (master, interface, total) == ("127.0.0.1", "lo", 2.0)
        assert sockets and all(is_loopback(address) for address, _ in sockets), sockets
    master, port, _, rank0, _ = answers[0]
    assert (master, int(port)) in rank0  # rank 0 serves the store, on loopback only


# --- a local torch.distributed group ----------------------------------------------------------


def _report_sockets(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    Path(out, f"{rank}.txt").write_text(
        f"{os.environ.get('MASTER_PORT')} {os.environ.get('GLOO_SOCKET_IFNAME')} {t.item()}\n"
        + "".join(f"{address} {port}\n" for address, port in listening(os.getpid()))
    )
    dist.barrier()  # no rank leaves (and closes its sockets) before every rank has looked


def test_local_group_store_and_gloo_listen_on_loopback_only(tmp_path):
    run_locally(_report_sockets, 2, str(tmp_path))
    reports = [(tmp_path / f"{rank}.txt").read_text().splitlines() for rank in range(2)]
    for lines in reports:
        master_port, interface, total = lines[0].split()
        assert interface == "lo" and float(total) == 2.0
        sockets = [(address, int(port)) for address, port in map(str.split, lines[1:])]
        assert sockets and all(is_loopback(address) for address, _ in sockets), sockets
    rank0 = [(address, int(port)) for address, port in map(str.split, reports[0][1:])]
    assert ("127.0.0.1", int(master_port)) in rank0  # the store, on loopback only


# --- joining a cluster: the token -------------------------------------------------------------


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This interpreter's environment without any Ray address or token, HOME elsewhere (no
    ~/.ray/auth_token), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
    }
    return {**env, "HOME": str(home), **extra}


def _python(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


JOIN = """
    import sys, time
    from scaleout.errors import UserError
    from scaleout.runtime import connect, shutdown
    start = time.monotonic()
    try:
        runtime = connect(sys.argv[1])
    except UserError as error:
        print("USERERROR", round(time.monotonic() - start, 1), error)
    else:
        import ray
        print("JOINED", ray.get(ray.remote(lambda: 6 * 7).remote()), runtime.num_nodes)
        shutdown()
"""


def test_join_without_a_token_is_one_line_at_once(tmp_path):
    """No token: one line, before any call to the cluster. RAY_AUTH_MODE, which Ray reads when
    it is imported, is really on afterwards (setting the variable alone changed nothing: the
    token was never sent)."""
    code = """
        import os, sys
        import ray  # first, as any user code may
        from ray._raylet import AuthenticationMode, get_authentication_mode
        from scaleout.errors import UserError
        from scaleout.runtime import connect
        print(get_authentication_mode() == AuthenticationMode.TOKEN)
        for path in (None, sys.argv[2]):
            if path:
                os.environ["RAY_AUTH_TOKEN_PATH"] = path
            try:
                connect(sys.argv[1])
            except UserError as error:
                print(get_authentication_mode() == AuthenticationMode.TOKEN, error)
    """
    with socket.socket() as server:  # something answers there; no Ray is needed to refuse
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        missing = str(tmp_path / "no-such-token")
        done = _python(code, _clean_env(tmp_path), address, missing)
    assert done.returncode == 0, done.stderr[-2000:]
    before, no_token, no_file = done.stdout.strip().splitlines()
    assert before == "False"
    assert no_token.startswith(f"True cannot join the Ray cluster at {address!r}")
    assert "no token was found" in no_token and "RAY_AUTH_TOKEN" in no_token
    assert "ray get-auth-token" in no_token
    assert no_file.startswith("True cannot join") and missing in no_file


@pytest.fixture
def token_head(tmp_path):
    """A Ray head with token authentication on, in its own temp dir and process group; its
    processes are killed at the end (not `ray stop`, which stops every Ray on the machine)."""
    token = os.urandom(32).hex()
    port = free_port()
    home = tmp_path / "head-home"
    home.mkdir()
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = Path("/tmp") / f"so-sec-{os.getpid()}-{port}"  # Ray's socket paths are short
    command = [
        str(ray_bin if ray_bin.exists() else shutil.which("ray")),
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=1",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--block",
    ]
    env = _clean_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    head = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert head.poll() is None, "ray start --head exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the head did not come up"
                time.sleep(0.5)
        yield f"127.0.0.1:{port}", token
    finally:
        # Its own session: `ray start` and all it started (SIGTERM would drain for 30 s).
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow  # a real head node: about 20 s
def test_joining_a_token_cluster(token_head, tmp_path):
    address, token = token_head
    none = _python(JOIN, _clean_env(tmp_path), address)
    wrong = _python(JOIN, _clean_env(tmp_path, RAY_AUTH_TOKEN="f" * 64), address)
    disabled = _python(
        JOIN, _clean_env(tmp_path, RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN=token), address
    )
    # the token only in RAY_AUTH_TOKEN, RAY_AUTH_MODE unset: the README's forgotten export
    right = _python(JOIN, _clean_env(tmp_path, RAY_AUTH_TOKEN=token), address)
    for done in (none, wrong, disabled):
        out = done.stdout.strip()
        assert out.startswith("USERERROR") and "\n" not in out, (out, done.stderr[-2000:])
        assert float(out.split()[1]) < 10, out  # not Ray's twenty seconds of retries
        assert "Unauthenticated" not in done.stderr  # Ray's C++ log lines are not shown
    assert "no token was found" in none.stdout
    assert "rejected this token" in wrong.stdout
    assert "RAY_AUTH_MODE=disabled here" in disabled.stdout
    assert right.stdout.split() == ["JOINED", "42", "1"], right.stderr[-2000:]


@pytest.mark.slow
def test_embedded_ray_needs_no_token_from_the_user(tmp_path):
    """Ray makes and keeps its own token (~/.ray/auth_token) for an embedded instance."""
    code = """
        from scaleout.runtime import session
        import ray
        with session(num_cpus=1):
            print(ray.get(ray.remote(lambda: 6 * 7).remote()), ray.util.get_node_ip_address())
    """
    done = _python(code, _clean_env(tmp_path))
    assert done.stdout.split() == ["42", "127.0.0.1"], done.stderr[-2000:]
    assert (tmp_path / ".ray" / "auth_token").exists()
