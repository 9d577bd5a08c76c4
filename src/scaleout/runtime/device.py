"""The device a worker trains on: `run.device` resolved on the machine that runs it."""

from __future__ import annotations

import torch

from scaleout.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; an explicit device that is absent is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device = {name!r}: no CUDA device here; use 'cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"run.device = {name!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"run.device = {name!r}: MPS is not available here; use 'cpu' or 'auto'")
    return device
