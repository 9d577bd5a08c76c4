"""Shared fixtures: one embedded Ray instance for the tests that need it, and processes a
test stops (SIGSTOP) that must not outlive it. Data sets the repository does not ship
(Fashion-MNIST) are read from the workplace's shared copy when `$SCALEOUT_DATA` is unset."""

import os
import signal
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if SHARED_DATA.is_dir():
    os.environ.setdefault("SCALEOUT_DATA", str(SHARED_DATA))


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray instance, started on first use and shut down after the last test."""
    from scaleout.runtime import session

    with session() as runtime:
        yield runtime


@pytest.fixture
def stopped_pids():
    """A list for the PIDs a test SIGSTOPs; each is SIGKILLed when the test ends (a stopped
    process the run did not end itself would stay behind, holding its memory)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
