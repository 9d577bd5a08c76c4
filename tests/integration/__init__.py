"""Tests that start processes: real Ray runs, subprocesses, spawned process groups and
loader processes."""
