"""The interface of a model trained layer-wise (greedily, one phase at a time), such as the
sparse autoencoder: what the training loop needs of it, in any strategy."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["LayerwiseModel"]


@runtime_checkable
class LayerwiseModel(Protocol):
    """A model trained phase by phase (greedy layer-wise training). Phase k's objective is
    a dict of terms (per example; they sum to the loss) on an input batch x; only phase k's
    parameters train; `begin_phase` runs once on the phase's first minibatch;
    `phase_metrics` adds a phase's own values to the metrics (e.g. its stack and alpha)."""

    @property
    def num_phases(self) -> int: ...
    def train_only(self, phase: int) -> None: ...
    def phase_parameter_groups(self, phase: int, lr: float) -> list[dict[str, Any]]: ...
    def begin_phase(self, x: Tensor, phase: int) -> None: ...
    def phase_objective(self, x: Tensor, phase: int) -> dict[str, Tensor]: ...
    def phase_metrics(self, phase: int) -> dict[str, Any]: ...
