"""Who may talk to a run's processes: loopback only when embedded, a token on a cluster.

Embedded Ray binds its servers to 127.0.0.1 (`loopback_node`); joining a cluster turns Ray's
token authentication on and tries the token once before `ray.init` (`token_auth`), so a
missing or rejected token is one line at once. See the README's "Security" paragraph for
what still crosses the network unauthenticated (torch.distributed between nodes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from scaleout.errors import UserError


@contextmanager
def loopback_node() -> Iterator[None]:
    """Make the embedded instance's node address 127.0.0.1, so that all its servers bind
    loopback. `ray.init(_node_ip_address="127.0.0.1")` does not: Ray replaces a loopback
    address with the host's routable one, except when clusters are off (its macOS/Windows
    default, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, read once when Ray is imported), where it
    uses loopback. Clusters are switched off for the one `ray.init` that starts the node;
    afterwards Ray reads the node's address from the node itself."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # a Ray without the switch
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


_TOKEN_SOURCES = (
    "set RAY_AUTH_TOKEN, or write the token file ~/.ray/auth_token or the one RAY_AUTH_TOKEN_PATH "
    "names (`ray get-auth-token` on the head node prints the token)"
)


def token_auth(address: str) -> None:
    """Turn token authentication on for joining `address` (unless RAY_AUTH_MODE says
    otherwise) and fail at once, as one line, when the token is missing or rejected.

    Ray reads RAY_AUTH_MODE into its config when it is imported, not at `ray.init`: Ray's own
    way to change it afterwards (`Config.initialize("")`, as `ray.init` does for a new local
    cluster) is used here. Without it, a token set only in RAY_AUTH_TOKEN was never sent."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        from ray._raylet import AuthenticationTokenLoader, Config, GcsClient
    except ImportError:  # a Ray without token authentication: nothing to turn on
        return
    from ray.exceptions import AuthenticationError

    Config.initialize("")  # re-read RAY_AUTH_MODE (and every RAY_* setting) from the env
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # a token set or written since the last look counts
    token_mode = os.environ["RAY_AUTH_MODE"].strip().lower() == "token"
    if token_mode:
        try:
            found = loader.has_token(ignore_auth_mode=True)
        except AuthenticationError as err:  # e.g. RAY_AUTH_TOKEN_PATH names no readable file
            raise UserError(
                f"cannot join the Ray cluster at {address!r}: {err.message}; {_TOKEN_SOURCES}"
            ) from None
        if not found:
            raise UserError(
                f"cannot join the Ray cluster at {address!r}: token authentication is on "
                f"(RAY_AUTH_MODE=token) and no token was found; {_TOKEN_SOURCES}; for a "
                "cluster started without token authentication, set RAY_AUTH_MODE=disabled"
            )
    gcs = _gcs_address(address)
    if gcs is None:
        return
    from ray.exceptions import RpcError

    try:
        with _quiet_stderr():  # Ray's C++ client logs each failure on stderr itself
            GcsClient(address=gcs)
    except AuthenticationError:
        raise UserError(token_rejected(address)) from None
    except RpcError as err:
        if "timed out" in str(err).lower():  # ray.init would wait so 20 times over
            raise UserError(
                f"cannot join the Ray cluster at {address!r}: something listens there but no "
                "Ray GCS answered; check the address and port (`ray status` on the head node "
                "prints it), or leave the address unset to run embedded"
            ) from None
    except Exception:  # noqa: BLE001 - anything else: ray.init retries and reports it
        return


def _gcs_address(address: str) -> str | None:
    """The GCS's host:port for `address`, or None (Ray Client, no cluster found, or Ray
    cannot say): then only `ray.init` tries the token."""
    if "://" in address:
        return None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - the address is ray.init's to judge
        return None


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for the block (C++ logging bypasses sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def token_rejected(address: str) -> str:
    mode = os.environ.get("RAY_AUTH_MODE", "").strip().lower()
    if mode and mode != "token":
        return (
            f"cannot join the Ray cluster at {address!r}: it requires a token and "
            f"RAY_AUTH_MODE={mode} here; unset RAY_AUTH_MODE (or set it to token) and "
            f"{_TOKEN_SOURCES}"
        )
    return (
        f"cannot join the Ray cluster at {address!r}: it rejected this token (RAY_AUTH_TOKEN, "
        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, the first one set); use the cluster's token "
        "(`ray get-auth-token` on the head node prints it)"
    )


def is_auth_failure(error: BaseException) -> bool:
    """Whether `ray.init` failed because the cluster refused the token (Ray gives up with a
    `ConnectionError` whose cause holds the GCS's answer)."""
    seen = 0
    while error is not None and seen < 5:
        text = str(error)
        if "Unauthenticated" in text or "InvalidAuthToken" in text:
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False
