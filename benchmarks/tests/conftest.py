"""The library's test fixtures, for the benchmarks' own tests."""

from tests.conftest import ray_session, stopped_pids

__all__ = ["ray_session", "stopped_pids"]
