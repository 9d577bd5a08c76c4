"""A model factory for the start-time fault tests: an MLP whose construction, inside a Ray
actor, dies or raises as the test asks (through a file, since actors run in their own
processes); in the driver it is a plain MLP."""

import os
import signal
from pathlib import Path

import ray
from torch import nn


def in_an_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def mlp(sizes: list[int], dies_once: str = "", always_raises: bool = False) -> nn.Module:
    """`dies_once`: a path; the first actor to build the model creates it and is SIGKILLed
    (a process lost while it starts). `always_raises`: every actor's construction raises
    the same error (a deterministic failure)."""
    if in_an_actor():
        if always_raises:
            raise RuntimeError("this model cannot be built here")
        if dies_once and not Path(dies_once).exists():
            Path(dies_once).touch()
            os.kill(os.getpid(), signal.SIGKILL)
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)
