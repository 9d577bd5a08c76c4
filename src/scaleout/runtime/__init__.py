"""Ray bring-up: an embedded local instance by default, a cluster when given an address.

`connect()` with no address starts a new Ray instance inside this process's session, sized
to the machine, with no dashboard and quiet logs (`ray.init(address="local")`: a plain
`ray.init()` may attach to a stale cluster left by an earlier `ray start`). Its node address
is 127.0.0.1, so the GCS, the raylet, the agents and every worker listen on loopback only
(Ray turns a 127.0.0.1 node address into the host's routable one unless it runs without
clusters, as on macOS: `security.loopback_node`). Ray protects it with a token of its own making
(`~/.ray/auth_token`, generated if missing); nothing is asked of the user.

Its workers run at the niceness of the process that starts it (`WORKER_NICENESS`), not at
Ray's default of 15: at 15 every daemon of Ray's own (the raylet, the GCS, the agents) and
the driver preempt the training processes, which on a busy machine slows every step. A
cluster's nodes keep their own setting: start them with `RAY_worker_niceness=0` in the
environment for the same effect.

An address (`"auto"`, `"host:port"`) joins a running cluster; token authentication stays on
there (`RAY_AUTH_MODE=token` unless the user chose otherwise; see the README). Ray reads its
config when it is imported, so setting the variable is not enough: `security.token_auth` refreshes
Ray's config (as Ray itself does), checks that a token is there, and tries it against the
cluster's GCS once, so a missing or rejected token is one line at once rather than Ray's
retries ending in "failed to connect" (and an address where something other than a GCS
listens, one line after one connection timeout rather than Ray's twenty).

`session()` wraps either in a context manager that shuts down what it started on exit, on
Ctrl-C and on errors, so no process outlives a run.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from scaleout.errors import UserError
from scaleout.runtime.actors import START_TIMEOUT_S, cpu_share, kill, restart_backoff_s, spawn
from scaleout.runtime.device import resolve_device
from scaleout.runtime.security import is_auth_failure, loopback_node, token_auth, token_rejected

__all__ = [
    "START_TIMEOUT_S",
    "Runtime",
    "connect",
    "cpu_share",
    "describe_failure",
    "reraise_user_error",
    "restart_backoff_s",
    "kill",
    "resolve_device",
    "session",
    "shutdown",
    "spawn",
]


WORKER_NICENESS = 0  # the embedded instance's workers: as the driver, see the docstring


@dataclass
class Runtime:
    address: str | None  # None: embedded
    started_here: bool
    num_cpus: float
    num_nodes: int


def connect(address: str | None = None, num_cpus: int | None = None) -> Runtime:
    """Start an embedded Ray instance (address None) or join a cluster."""
    import ray

    if address is not None:
        _check_reachable(address)
    if ray.is_initialized():
        resources = ray.cluster_resources()
        return Runtime(address, False, resources.get("CPU", 0.0), len(ray.nodes()))
    quiet = dict(
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=True,
        configure_logging=True,
    )
    if address is None:
        with loopback_node():
            ray.init(
                address="local",
                num_cpus=num_cpus or os.cpu_count(),
                _system_config={"worker_niceness": WORKER_NICENESS},
                **quiet,
            )
    else:
        from ray.exceptions import AuthenticationError

        token_auth(address)
        try:
            ray.init(address=address, **quiet)
        except AuthenticationError:
            raise UserError(token_rejected(address)) from None
        except (ConnectionError, RuntimeError, ValueError) as err:
            if is_auth_failure(err):
                raise UserError(token_rejected(address)) from None
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"cannot join the Ray cluster at {address!r}: {first}; check the address "
                "(`ray status` on the head node prints it) and that RAY_AUTH_TOKEN or the "
                "token file matches the cluster's, or leave the address unset to run embedded"
            ) from None
    resources = ray.cluster_resources()
    return Runtime(address, True, resources.get("CPU", 0.0), len(ray.nodes()))


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not minutes, when a `host:port` address does not answer (Ray itself
    retries for minutes before it gives up)."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"Ray address {address!r}: expected host:port, 'auto' or ray://host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise UserError(
            f"cannot reach the Ray cluster at {address!r}: {err.strerror or err}; start it with "
            "`ray start --head` there, check host and port, or leave the address unset to run "
            "embedded"
        ) from None


def reraise_user_error(error: BaseException) -> None:
    """Raise the `UserError` an actor raised (a diverging loss, bad data, a full disk) as
    itself, one line, instead of Ray's wrapper with the actor's traceback; otherwise
    return."""
    from ray.exceptions import RayTaskError

    cause = getattr(error, "cause", None)
    if isinstance(error, RayTaskError) and isinstance(cause, UserError):
        raise type(cause)(str(cause)) from None


def describe_failure(error: BaseException) -> str:
    """One line for a failed actor call: the actor's own exception, or Ray's first line.

    A `UserError` raised inside an actor is re-raised here (`reraise_user_error`): no
    restart can fix it, so the run stops with the user's message.
    """
    from ray.exceptions import RayTaskError

    reraise_user_error(error)
    cause = getattr(error, "cause", None)
    if isinstance(error, RayTaskError) and cause is not None:
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()  # Ray colours its banner
    return text.splitlines()[0] if text else type(error).__name__


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextmanager
def session(address: str | None = None, num_cpus: int | None = None) -> Iterator[Runtime]:
    """Connect for the duration of a block; shut down on exit only what this call started."""
    runtime = connect(address, num_cpus)
    try:
        yield runtime
    finally:
        if runtime.started_here:
            shutdown()
