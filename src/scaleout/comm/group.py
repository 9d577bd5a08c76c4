"""torch.distributed process groups: from environment variables, or out of Ray actors.

`init_distributed()` reads the standard RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
variables (LOCAL_RANK too), so code written against it runs unchanged under `torchrun` and
inside our Ray actors. The backend follows the device: NCCL when the process trains on a
CUDA device, gloo otherwise.

A group whose MASTER_ADDR is a loopback address (127.0.0.1, ::1, localhost: all ranks on
this machine, as in `run_locally` and under embedded Ray, whose node address is 127.0.0.1)
listens on loopback only: rank 0's TCPStore is handed a socket bound to MASTER_ADDR (torch
binds its own to every interface whatever the host), and gloo gets the loopback interface
(GLOO_SOCKET_IFNAME, unless set; otherwise gloo binds the address the host name resolves
to). Under torchrun the agent's store is torchrun's, and NCCL's own bootstrap sockets follow
NCCL_SOCKET_IFNAME: both are left as they are. Across hosts nothing of this is authenticated
or encrypted (see the README).

`ProcessGroup.create(actor_class, num_workers, ...)` brings up a group of Ray actors:

1. a placement group reserves one bundle per rank (PACK: on as few nodes as possible, so
   collectives stay on fast local links), and rank r's actor is placed in bundle r;
2. rank 0 binds port 0 on its own node to get a free port and reports its address;
3. every actor's `join_group(rank, world, address, port)` sets the variables above and
   calls `init_distributed` (all at once: the rendezvous waits for the whole world).

Afterwards the actors can run any torch.distributed collective. `close()` destroys the
process groups, kills the actors and removes the placement group; call it in `finally`.
Actor classes mix in `GroupMember` for the methods the bring-up calls.
"""

from __future__ import annotations

import datetime
import gc
import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from scaleout.errors import UserError
from scaleout.runtime import describe_failure, reraise_user_error
from scaleout.runtime.actors import spawn

__all__ = [
    "GroupMember",
    "ProcessGroup",
    "WorkerDied",
    "default_backend",
    "destroy_distributed",
    "free_port",
    "init_distributed",
    "join_group",
    "run_locally",
]


def default_backend(device: torch.device | str | None = None) -> str:
    """NCCL for CUDA devices (when built with it), gloo for everything else."""
    kind = torch.device(device).type if device is not None else "cpu"
    return "nccl" if kind == "cuda" and dist.is_nccl_available() else "gloo"


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (bind port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def init_distributed(
    backend: str = "auto",
    device: torch.device | str | None = None,
    timeout_s: float = 300.0,
) -> tuple[int, int]:
    """Join the default process group described by RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT; return (rank, world size). `backend` "auto": see `default_backend`."""
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise ValueError(
            f"init_distributed: environment variable(s) {', '.join(missing)} not set; run "
            "under torchrun or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    if backend == "auto":
        backend = default_backend(device)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        options: dict[str, Any] = {}
        if backend == "nccl" and device is not None:
            chosen = torch.device(device)
            if chosen.index is None:  # Ray / torchrun made the worker's GPU the current one
                chosen = torch.device("cuda", torch.cuda.current_device())
            options["device_id"] = chosen
        host = os.environ["MASTER_ADDR"]
        store = None
        if _is_loopback(host):
            _gloo_on_loopback()
            store = _loopback_store(rank, world, host, int(os.environ["MASTER_PORT"]), timeout)
        if store is None:
            options["init_method"] = "env://"
        else:
            options["store"] = store
        try:
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=timeout, **options
            )
        except BaseException:
            _restore_env()
            raise
    return rank, world


def _is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback (a literal address, or "localhost"); a host
    name that merely resolves to one here may name another machine elsewhere."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


_env_set_here: list[str] = []  # variables init_distributed set, unset by destroy_distributed


def _gloo_on_loopback() -> None:
    """gloo's default device binds the address the host name resolves to (the LAN address on
    most machines): name the loopback interface instead, unless the user chose one."""
    interface = _loopback_interface()
    if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        _env_set_here.append("GLOO_SOCKET_IFNAME")


def _restore_env() -> None:
    while _env_set_here:
        os.environ.pop(_env_set_here.pop(), None)


def _loopback_store(
    rank: int, world: int, host: str, port: int, timeout: datetime.timedelta
) -> dist.TCPStore | None:
    """The group's TCPStore at `host`:`port`, rank 0 serving it on a socket bound to `host`
    only (`master_listen_fd`). None under torchrun, whose agent already serves the store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    host = "127.0.0.1" if host.strip().lower() == "localhost" else host.strip("[]")
    use_libuv = os.environ.get("USE_LIBUV", "1") == "1"  # as torch's env:// rendezvous
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout, use_libuv=use_libuv)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise dist.DistNetworkError(
            f"cannot serve the process group's store on {host}:{port}: {err.strerror or err}"
        ) from None
    return dist.TCPStore(
        host,
        port,
        world,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns and closes it
        use_libuv=use_libuv,
    )


def destroy_distributed() -> None:
    """Leave the default process group, if this process is in one."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _restore_env()


def join_group(rank: int, world: int, address: str, port: int, **options: Any) -> int:
    """Set the torchrun variables for rank `rank` of `world` and join the default process
    group there (`init_distributed`); returns this process's id. The one way every process of
    the project joins a group: Ray actors (`GroupMember`), local processes (`run_locally`)
    and benchmark processes on other hosts."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )
    init_distributed(**options)
    return os.getpid()


def _local_member(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    join_group(rank, world, "127.0.0.1", port)
    try:
        fn(rank, world, *args)
        # Everyone done before anyone tears down: a peer that leaves while another still
        # talks to it is an error in the other's gloo threads.
        dist.barrier()
    finally:
        gc.collect()  # modules that hold a group let go of it before it is destroyed
        destroy_distributed()
    # Leave without the interpreter's finalisation: a gloo group still referenced from a
    # Python object is destroyed there, at which point its threads may abort the process
    # ("terminate called without an active exception"), which would fail a run that
    # succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_locally(fn: Callable[..., Any], world: int, *args: Any) -> None:  # noqa: ANN401
    """Run `fn(rank, world, *args)` in `world` new processes on this machine, joined in one
    gloo process group (torch.multiprocessing; `fn` must be importable)."""
    import torch.multiprocessing as mp

    mp.spawn(_local_member, args=(world, free_port(), fn, args), nprocs=world, join=True)


class GroupMember:
    """Mixin for Ray actor classes that form a process group with `ProcessGroup.create`."""

    def group_address(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0 only)."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, free_port()

    def join_group(
        self,
        rank: int,
        world: int,
        address: str,
        port: int,
        backend: str = "auto",
        device: str | None = None,
        timeout_s: float = 300.0,
    ) -> int:
        """Join the group as rank `rank` (`join_group`); returns this process's id."""
        return join_group(
            rank, world, address, port, backend=backend, device=device, timeout_s=timeout_s
        )

    def leave_group(self) -> None:
        destroy_distributed()


class WorkerDied(UserError):
    """A worker of a process group died; the run stopped (at its last checkpoint).

    `cause` says what died or hung, without where the run stopped; a process group sets
    it, and the driver may then start the group again from the last checkpoint
    (`train.max_restarts`). Without it (a Downpour replica that could not start) the run
    stops."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class ProcessGroup:
    """A world of Ray actors joined in one torch.distributed group (rank r = actors[r])."""

    actors: list[Any]
    placement: Any
    pids: list[int] = field(default_factory=list)
    timeout_s: float = 300.0  # the others' answers are due this long after the first one

    @classmethod
    def create(
        cls,
        actor_class: type,
        num_workers: int,
        args: Sequence[Any] | None = None,
        rank_args: bool = True,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        backend: str = "auto",
        device: str | None = None,
        timeout_s: float = 300.0,
        strategy: str = "PACK",
    ) -> ProcessGroup:
        """Start `num_workers` actors of `actor_class` (a `GroupMember`) in one placement
        group and join them into a process group. Each actor is constructed with
        `(rank, num_workers, *args)` when `rank_args`, else `(*args)`."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        from ray.util.placement_group import placement_group, remove_placement_group

        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        bundle: dict[str, float] = {"CPU": num_cpus}
        if num_gpus:
            bundle["GPU"] = num_gpus
        placement = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
        actors: list[Any] = []
        try:
            ready, _ = ray.wait([placement.ready()], timeout=120)
            if not ready:
                raise RuntimeError(
                    f"cannot place {num_workers} workers of {bundle} each: the Ray cluster has "
                    f"{ray.cluster_resources()}; use fewer workers"
                )
            for rank in range(num_workers):
                actor_args = (rank, num_workers, *(args or ())) if rank_args else tuple(args or ())
                actors.append(
                    spawn(
                        actor_class,
                        *actor_args,
                        num_cpus=num_cpus,
                        num_gpus=num_gpus,
                        placement=(placement, rank),
                    )
                )
            try:
                address, port = ray.get(actors[0].group_address.remote())
            except RayActorError as error:  # killed while starting: as any lost worker
                cause = f"worker 0 died while starting: {describe_failure(error)[:200]}"
                raise WorkerDied(cause, cause=cause) from None
            joins = [
                actor.join_group.remote(
                    rank, num_workers, address, port, backend, device, timeout_s
                )
                for rank, actor in enumerate(actors)
            ]
            try:
                pids = ray.get(joins)
            except (RayTaskError, RayActorError) as error:
                # A worker that cannot reach its peers (a timeout too short for this
                # machine's start-up, a port taken, a firewall), or one killed while it
                # starts, is the run's to report, as any other lost worker: the driver may
                # start the group again.
                cause = f"{num_workers} workers could not join one process group at "
                cause += f"{address}:{port} within {timeout_s:g} s: {describe_failure(error)[:200]}"
                raise WorkerDied(cause, cause=cause) from None
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(placement)
            raise
        return cls(actors, placement, pids, timeout_s)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def get(self, futures: list[Any], doing: str, role: str, where: Callable[[], str]) -> list[Any]:
        """The results of one call per worker (`futures[r]` on rank r). A worker that dies
        stops the run with `WorkerDied` naming it (`role` rank (pid)) and `where()` (the step
        and last checkpoint); a `UserError` raised in a worker reaches the caller as itself."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        pending = list(futures)
        while pending:
            # Workers in lock step answer together: once one has, a worker that does not
            # answer within timeout_s is stuck (its peers' collectives would time out too).
            timeout = None if len(pending) == len(futures) else self.timeout_s
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                rank = next(r for r, f in enumerate(futures) if f in pending)
                pid = self.pids[rank] if rank < len(self.pids) else "?"
                cause = (
                    f"{role} {rank} (pid {pid}) is stuck while {doing}: no answer "
                    f"{self.timeout_s:g} s after the first worker's"
                )
                raise WorkerDied(f"{cause}; the run stopped {where()}", cause=cause)
            try:
                ray.get(ready[0])
            except (RayTaskError, RayActorError):
                # The survivors of a dead worker fail too (their collective loses a peer):
                # give every call a moment to end, then blame a dead process first.
                ray.wait(pending, num_returns=len(pending), timeout=3.0)
                errors: list[tuple[int, BaseException]] = []
                for rank, future in enumerate(futures):
                    try:
                        ray.get(future, timeout=0)
                    except Exception as error:  # noqa: BLE001 - sorted below
                        errors.append((rank, error))
                for _, error in errors:
                    reraise_user_error(error)
                dead = [(r, e) for r, e in errors if isinstance(e, RayActorError)]
                rank, error = (dead or errors)[0]
                what = "died" if dead else "failed"
                pid = self.pids[rank] if rank < len(self.pids) else "?"
                cause = f"{role} {rank} (pid {pid}) {what} while {doing}: "
                cause += describe_failure(error)[:200]
                raise WorkerDied(
                    f"{cause}; the others cannot continue without it, so the run stopped {where()}",
                    cause=cause,
                ) from None
        return ray.get(futures)

    def close(self, timeout_s: float = 10.0) -> None:
        """Destroy the process groups (best effort, waiting up to `timeout_s`; 0 when a
        member died and the others may hang in a collective), kill the actors, release the
        placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            if timeout_s > 0:
                ray.wait(
                    [actor.leave_group.remote() for actor in self.actors],
                    num_returns=len(self.actors),
                    timeout=timeout_s,
                )
        finally:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(self.placement)
