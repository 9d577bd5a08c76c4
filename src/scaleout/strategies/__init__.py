"""The training strategies, by `train.strategy`: one registry, one lookup.

Each strategy implements `scaleout.train.protocol.Strategy` and owns its config section
(`[sync]`, `[downpour]`, `[sandblaster]`, `[model_parallel]`); the run config is composed
from this registry, so the list of strategy names exists here only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scaleout.config import Section
from scaleout.strategies import downpour, model_parallel, sandblaster, single, sync
from scaleout.strategies.downpour import DownpourSection
from scaleout.strategies.layout import ModelParallelSection
from scaleout.strategies.sandblaster import SandblasterSection
from scaleout.strategies.sync import SyncSection
from scaleout.train.job import Job
from scaleout.train.protocol import Strategy


@dataclass(frozen=True)
class StrategySpec:
    """A strategy: how to create it for a job, its config section (the table named like the
    strategy, None if it has none), and whether it runs Ray actors."""

    name: str
    create: Callable[[Job], Strategy]
    section: type[Section] | None = None
    uses_ray: bool = True


STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec("single", single.create, uses_ray=False),
        StrategySpec("sync", sync.create, SyncSection),
        StrategySpec("downpour", downpour.create, DownpourSection),
        StrategySpec("sandblaster", sandblaster.create, SandblasterSection),
        StrategySpec("model_parallel", model_parallel.create, ModelParallelSection),
    )
}

__all__ = [
    "STRATEGIES",
    "DownpourSection",
    "ModelParallelSection",
    "SandblasterSection",
    "StrategySpec",
    "SyncSection",
]
