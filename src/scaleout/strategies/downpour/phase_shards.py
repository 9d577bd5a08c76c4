"""The shards of the phase in training: one `ParameterServer` per (grid worker, parameter
group), each stepping its group with the group's learning rate.

A model of one worker and one parameter group (the common case) has one set of shards,
checkpointing into `shards/shard_<i>/` of the run; otherwise each set has a directory of its
own, `shards/phase<k>.worker<w>.group<g>/`. A shard that finds a checkpoint of its own in its
directory resumes from it instead of the values it is started from.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from scaleout.nn.optim import OptimizerSpec
from scaleout.nn.schedule import Schedule
from scaleout.progress import console
from scaleout.ps import ParameterServer
from scaleout.ps.outer import outer_optimizer
from scaleout.ps.staleness import StalenessPolicy
from scaleout.rundir import RunDir
from scaleout.runtime.actors import check_capacity, fits
from scaleout.strategies.downpour import DownpourSection
from scaleout.train.job import Job

Initial = list[list[tuple[torch.Tensor, float] | None]]  # [worker][group]: values, lr


class PhaseShards:
    """The parameter servers of the phase in training, per (grid worker, parameter group):
    started, restarted after a failure, checkpointed and retired together."""

    def __init__(self, job: Job, opts: DownpourSection, run: RunDir) -> None:
        self.job, self.opts, self.run = job, opts, run
        self.servers: list[list[ParameterServer | None]] = []  # [grid worker][group]
        self.pids: dict[tuple[int, int, int], int] = {}
        self.backups = 0  # backups per shard (downpour.shard_backups, resolved at start)
        self.replica_count = opts.num_replicas  # DiLoCo's outer momentum: once per round
        history = (
            opts.max_staleness + 1
            if opts.max_staleness is not None
            else max(8, 4 * opts.num_replicas)
        )
        self.staleness = StalenessPolicy(
            opts.staleness_rule, opts.dc_lambda, history, opts.max_staleness, opts.timeout_s
        )

    def size(self, workers: int) -> None:
        """Check that R replicas of `workers` workers and S shards per worker fit the
        cluster, and decide whether every shard keeps a backup (`shard_backups`): by
        default when the cluster's memory holds the extra processes and it has another
        node, or one machine has a core for every replica, shard and backup. On another
        node a backup survives the loss of its primary's node; on one machine whose cores
        the replicas and shards already use, it only slows every push (the backup's copy
        competes with them for those cores)."""
        opts = self.opts
        replicas, shards = opts.num_replicas * workers, opts.num_shards * workers
        cpus = ray.cluster_resources().get("CPU", 0.0)
        self.backups = opts.backups_per_shard(workers, cpus, len(ray.nodes()))
        if opts.shard_backups is None and self.backups:
            self.backups = int(fits(replicas + 2 * shards))
        check_capacity(
            replicas + (1 + self.backups) * shards,
            f"downpour.num_replicas = {opts.num_replicas}, downpour.num_shards = "
            f"{opts.num_shards}"
            + (", each with a backup" if self.backups else "")
            + (f", {workers} grid workers each" if workers > 1 else ""),
        )

    def start(self, phase: int, initial: Initial, schedule: Schedule, start_step: int = 0) -> None:
        """Start the shards of `phase` from `initial` (replica 0's values), all at once,
        stepping at `schedule`'s learning rate from global step `start_step` (where a shard
        has no checkpoint of its own to resume)."""
        self.retire()
        opts = self.opts
        single = len(initial) == 1 and len(initial[0]) == 1
        for w, groups in enumerate(initial):
            row: list[ParameterServer | None] = []
            for g, entry in enumerate(groups):
                if entry is None:  # rank 0 of the grid keeps this group
                    row.append(None)
                    continue
                values, lr = entry
                root = (
                    self.run.shards
                    if single
                    else self.run.shards / f"phase{phase}.worker{w}.group{g}"
                )
                row.append(
                    ParameterServer.create(
                        values,
                        min(opts.num_shards, values.numel()),
                        self._shard_optimizer(lr, schedule),
                        self.job.compress,
                        root,
                        opts.shard_checkpoint_every,
                        opts.shard_checkpoint_seconds,
                        resource=opts.shard_resource,
                        wait=False,  # start every row's processes at once
                        backups=self.backups,
                        shared_memory=opts.shared_memory,
                        start_step=start_step,
                        staleness=self.staleness,
                    )
                )
            self.servers.append(row)
        for _, server in self.all():
            server.wait()
        for (w, g), server in self.all():
            for info in server.info():
                self.pids[(w, g, info["shard"])] = info["pid"]

    def _shard_optimizer(self, lr: float, schedule: Schedule) -> OptimizerSpec:
        """What the shards step: `train.optimizer` at the group's rate and the run's
        schedule, or (DiLoCo) the outer optimizer at a constant `outer_lr`."""
        opts = self.opts
        if opts.mode != "diloco":
            return self.job.optimizer_options(lr=lr, schedule=schedule)
        outer = outer_optimizer(
            opts.outer_optimizer, opts.outer_lr, opts.outer_momentum, self.replica_count
        )
        return OptimizerSpec(optimizer=outer, lr=opts.outer_lr, warmup_steps=0, schedule=Schedule())

    def rescale(self, replica_count: int) -> None:
        """The run goes on with `replica_count` replicas: DiLoCo's outer momentum applies
        once per round of that many pushes (gradient pushes need nothing)."""
        self.replica_count = replica_count
        if self.opts.mode == "diloco":
            for _, server in self.all():
                server.set_outer_delay(replica_count)

    def drop_windows(self, replica: int) -> None:
        """Replica `replica` failed: its open windows hold no one back (max_staleness)."""
        if self.opts.max_staleness is None:
            return
        for _, server in self.all():
            server.drop_windows(f"replica{replica}")

    def for_worker(self, worker: int) -> list[ParameterServer | None]:
        return self.servers[worker]

    def all(self) -> list[tuple[tuple[int, int], ParameterServer]]:
        return [
            ((w, g), server)
            for w, row in enumerate(self.servers)
            for g, server in enumerate(row)
            if server is not None
        ]

    def nodes(self) -> list[tuple[str, str | None]]:
        """Per shard: the node of its primary, and of its backup (None without one)."""
        infos = [info for _, server in self.all() for info in server.info()]
        return [(info["node"], info["backup_node"]) for info in infos]

    def checkpoint(self) -> None:
        for _, server in self.all():
            server.checkpoint()

    def restarts(self, step: int, wall_start: float) -> list[dict[str, Any]]:
        """Shards replaced since the last look: by their backup, or by Ray from their last
        checkpoint (the updates lost are counted by the clients, see `ParameterServer`)."""
        failures = []
        for (w, g), server in self.all():
            for info in server.info():
                key = (w, g, info["shard"])
                if info["pid"] != self.pids.get(key, info["pid"]):
                    how = (
                        "shard failed over to its backup"
                        if info["promoted"]
                        else "shard restarted from its checkpoint"
                    )
                    failures.append(
                        {
                            "time_s": round(time.time() - wall_start, 3),
                            "step": step,
                            "shard": info["shard"],
                            "kind": how,
                            "restored_version": info["restored_version"],
                        }
                    )
                    console.print(f"{how} (shard {info['shard']}, version {info['version']})")
                self.pids[key] = info["pid"]
        return failures

    def retire(self) -> None:
        for _, server in self.all():
            server.kill()
        self.servers = []
