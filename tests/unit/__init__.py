"""Tests that start no process: no Ray, no subprocess, no spawned process group, no loader
processes (a one-rank or fake process group in this process is fine)."""
