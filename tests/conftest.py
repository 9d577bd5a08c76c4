"""Shared fixtures: one embedded Ray instance for the tests that need it, and processes a
test stops (SIGSTOP) that must not outlive it."""

import os
import signal

import pytest


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
