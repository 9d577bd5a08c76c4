"""Shared fixtures: one embedded Ray instance for the tests that need it."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray instance, started on first use and shut down after the last test."""
    from scaleout.runtime import session

    with session() as runtime:
        yield runtime
