"""Strategy "downpour": Downpour SGD (DistBelief section 4.1) on a sharded parameter server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from scaleout.config import Section, TimeoutSeconds
from scaleout.train.job import Job

if TYPE_CHECKING:
    from scaleout.strategies.downpour.strategy import Downpour


class DownpourSection(Section):
    """Downpour SGD on a sharded parameter server (DistBelief section 4.1)."""

    # model replicas training asynchronously, each on its own part of the training set (every
    # num_replicas-th example); at most the number of training examples
    num_replicas: PositiveInt = 2
    # parameter-server shards (per parameter group and replica worker): each holds a slice
    # of the parameters and steps the optimizer on it; at most the model's parameter count
    num_shards: PositiveInt = 2
    n_fetch: PositiveInt = 1  # steps between parameter fetches
    n_push: PositiveInt = 1  # steps between gradient pushes
    warmstart_steps: NonNegativeInt = 0  # one replica trains alone this long first
    # "gradients": push the gradients summed over n_push steps (DistBelief's Downpour);
    # "diloco": each replica takes n_push steps of train.optimizer on its own copy, then
    # pushes the pseudo-gradient (fetched - local) / num_replicas, on which the shards step
    # the outer optimizer (Douillard et al. 2023); n_fetch must equal n_push
    mode: Literal["gradients", "diloco"] = "gradients"
    # The most updates of other replicas a push may find applied after its fetch: a replica
    # waits before its fetch until its push cannot be staler (SSP-like; None: no bound)
    max_staleness: NonNegativeInt | None = None
    # What the shards do with a stale push: "none" (as it is), "inverse" (the step divided
    # by the staleness), "dc" (DC-ASGD's delay compensation, `dc_lambda`), "gap" (gap-aware)
    staleness_rule: Literal["none", "inverse", "dc", "gap"] = "none"
    # staleness_rule "dc": lambda of g + lambda * g * g * (w_now - w_fetched); others ignore it
    dc_lambda: PositiveFloat = 0.04
    # DiLoCo's outer optimizer on the shards: SGD with Nesterov momentum, or plain SGD
    outer_optimizer: Literal["nesterov", "sgd"] = "nesterov"
    # "diloco": the outer optimizer's learning rate, constant (no schedule, no warm-up);
    # 0.7 with momentum 0.9 are the values of the DiLoCo paper
    outer_lr: PositiveFloat = 0.7
    # "diloco" with outer_optimizer "nesterov": the momentum; "sgd" ignores it
    outer_momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    # Fetch, compute and push in three weakly synchronised threads (the paper's appendix).
    # Off by default: a replica then computes on parameters older than its own last push,
    # which costs convergence. "auto": where a replica is one worker and has a core to
    # spare, each replica measures its first push windows and turns them on when its
    # compute hides its communication (`scaleout.ps.client.threads_pay`).
    threads: bool | Literal["auto"] = False
    max_restarts: NonNegativeInt = 3  # per replica; a shard is always restarted
    # Elastic: the driver starts replicas while the Ray cluster has a replica's CPUs free
    # (a node joined), up to max_replicas, and goes on without a replica that died (its
    # node left) down to min_replicas instead of restarting it. Any run, elastic or not,
    # changes its count on `scaleout scale RUN_DIR --replicas N`.
    elastic: bool = False
    min_replicas: PositiveInt = 1  # elastic: the fewest replicas it goes on with
    max_replicas: PositiveInt | None = None  # elastic: the most (None: as the cluster holds)
    timeout_s: TimeoutSeconds = 300.0  # a replica whose chunk takes longer is stuck: restarted
    # Each shard's backup applies every update too, so a shard that dies loses nothing;
    # None: 1 when the cluster holds the extra processes and has a node or core to spare.
    shard_backups: Annotated[int, Field(ge=0, le=1)] | None = None
    # Replicas pull and push through shared memory with the shards on their node (a copy
    # under the shard's lock; `scaleout.ps.shared`); false: through Ray's object store.
    shared_memory: bool = True
    shard_checkpoint_every: PositiveInt | None = 500  # shard updates between checkpoints
    shard_checkpoint_seconds: PositiveFloat | None = 30.0  # or seconds, whichever first
    # Custom Ray resources that pin shards / replicas to the nodes that offer them (start
    # those nodes with `ray start --resources '{"ps": 100}'`); None: anywhere, spread out.
    shard_resource: str | None = None
    # the custom Ray resource that pins replicas, as shard_resource pins shards; None: anywhere
    replica_resource: str | None = None

    def replica_threads(
        self, workers_per_replica: int, num_threads: int | None, cpus: float, nodes: int
    ) -> bool | Literal["auto"]:
        """`threads` for each replica's client, "auto" resolved as far as the cluster tells:
        off for a model-parallel grid's workers (they fetch and push in step) and where the
        replicas' compute threads (`run.num_threads`; None: every core) take every core of
        one node (the threads would then take cores from the compute and the replicas would
        train on staler parameters). The driver and the simulator both ask here."""
        if self.mode == "diloco" or self.max_staleness is not None:
            return False  # both fetch after their own push is applied
        if self.threads != "auto":
            return self.threads
        compute = num_threads or cpus
        spare_core = nodes > 1 or cpus >= self.num_replicas * (compute + 1)
        return "auto" if workers_per_replica == 1 and spare_core else False

    def backups_per_shard(self, workers_per_replica: int, cpus: float, nodes: int) -> int:
        """`shard_backups`, None resolved: 1 where the cluster has another node or one
        node has a core for every replica, shard and backup (the caller checks that the
        memory holds them too). The driver and the simulator both ask here."""
        if self.shard_backups is not None:
            return self.shard_backups
        replicas = self.num_replicas * workers_per_replica
        shards = self.num_shards * workers_per_replica
        return int(nodes > 1 or cpus >= replicas + 2 * shards)


def create(job: Job) -> Downpour:
    from scaleout.strategies.downpour.strategy import Downpour  # imports Ray when used

    return Downpour(job)


__all__ = ["DownpourSection", "create"]
