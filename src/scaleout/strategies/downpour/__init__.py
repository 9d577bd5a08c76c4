"""Strategy "downpour": Downpour SGD (DistBelief section 4.1) on a sharded parameter server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from scaleout.config import Section, TimeoutSeconds
from scaleout.train.job import Job

if TYPE_CHECKING:
    from scaleout.strategies.downpour.strategy import Downpour


class DownpourSection(Section):
    """Downpour SGD on a sharded parameter server (DistBelief section 4.1)."""

    num_replicas: PositiveInt = 2
    num_shards: PositiveInt = 2
    n_fetch: PositiveInt = 1  # steps between parameter fetches
    n_push: PositiveInt = 1  # steps between gradient pushes
    warmstart_steps: NonNegativeInt = 0  # one replica trains alone this long first
    threads: bool = False  # fetch, compute and push in three weakly synchronised threads
    max_restarts: NonNegativeInt = 3  # per replica; a shard is always restarted
    timeout_s: TimeoutSeconds = 300.0  # a replica whose chunk takes longer is stuck: restarted
    # Each shard's backup applies every update too, so a shard that dies loses nothing;
    # None: 1 when the cluster holds the extra processes and has a node or core to spare.
    shard_backups: Annotated[int, Field(ge=0, le=1)] | None = None
    shard_checkpoint_every: PositiveInt | None = 500  # shard updates between checkpoints
    shard_checkpoint_seconds: PositiveFloat | None = 30.0  # or seconds, whichever first
    # Custom Ray resources that pin shards / replicas to the nodes that offer them (start
    # those nodes with `ray start --resources '{"ps": 100}'`); None: anywhere, spread out.
    shard_resource: str | None = None
    replica_resource: str | None = None


def create(job: Job) -> Downpour:
    from scaleout.strategies.downpour.strategy import Downpour  # imports Ray when used

    return Downpour(job)


__all__ = ["DownpourSection", "create"]
