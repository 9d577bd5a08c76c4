"""One parameter-server shard: a slice of the flat parameter vector and its optimizer.

The shard applies every pushed gradient itself, with the same torch.optim optimizer the
single-worker strategy uses (SGD, momentum, Adagrad, RMSProp, Adam, AdamW, and a user's
factory that passes `check_elementwise`, are element-wise, so S shards stepping their slices
equal one optimizer stepping the whole vector). Versions count applied updates; the
staleness of a push is the shard's version when it arrives minus the version the replica
had fetched. The learning rate of an update is the schedule's at the global step the shard
knows: the steps every push it applied carried (a replica's push of n_push steps counts
n_push), from the step it started at, up to the push's last step.

With a backup (`backup`, see `scaleout.ps.backup`) every update is applied by a second
actor too before the push is acknowledged, and a primary that dies is replaced by its
backup: nothing acknowledged is lost. Every push carries its client's id and sequence
number, so one sent again after a failure is applied once.

A shard checkpoints its slice, optimizer state and the last sequence number of each client
every `checkpoint_every` updates or `checkpoint_seconds` seconds (safetensors + verified
JSON sidecar, atomic). Without a backup, Ray restarts a shard whose process died: the
constructor runs again and resumes from the latest checkpoint; the updates applied since
are lost (each client counts its own), and `info()` says which version it went back to. A
shard restarted with nothing to restore refuses every call with one line (`ShardLost`),
never serving zeros.

Runs as a Ray actor (`ray.remote(ParameterShard)`), one call at a time, so pulls and pushes
see a consistent slice. Its slice lives in shared memory (`scaleout.ps.shared`), so clients
on its node pull by copying it under its lock, and their pushes name a gradient in their own
shared inbox instead of carrying it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from torch import nn

from scaleout.checkpoint import (
    CheckpointDir,
    load_checkpoint,
    load_optimizer_state,
    optimizer_state,
)
from scaleout.compress import CompressSection
from scaleout.errors import CheckpointError, DiskError, UserError
from scaleout.nn.optim import OptimizerOptions, build_optimizer, schedule_of
from scaleout.nn.schedule import apply_lr
from scaleout.ps import shared
from scaleout.ps.backup import BackupLink, BackupPolicy
from scaleout.ps.outer import DelayedNesterov
from scaleout.ps.staleness import Staleness, StalenessPolicy, Windows
from scaleout.ps.wire import Payload, Wire


class ShardLost(UserError):
    """A shard came back from a restart without its state: the run cannot go on."""


class ParameterShard:
    def __init__(
        self,
        shard_id: int,
        numel: int,
        optimizer: OptimizerOptions,
        compress: CompressSection | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        checkpoint_seconds: float | None = None,
        backup: BackupPolicy | None = None,
        staleness: StalenessPolicy | None = None,
        is_backup: bool = False,
    ) -> None:
        torch.set_num_threads(1)
        self.args = (  # a backup is built from the same
            shard_id,
            numel,
            optimizer,
            compress,
            checkpoint_dir,
            checkpoint_every,
            checkpoint_seconds,
            backup,
            staleness,
        )
        self.shard_id = shard_id
        self.wire = Wire(compress)  # gradients arrive compressed as configured
        self.pull_wire = Wire()  # parameters leave in fp32: 8 bits would drop small updates
        # (n,) set by initialize() or a checkpoint; in shared memory where this node allows
        self.region = _region(numel, shard_id)
        self.param = nn.Parameter(self.region.values if self.region else torch.zeros(numel))
        self.inboxes = shared.Views()  # the clients' inboxes their pushes name
        self.optimizer = build_optimizer([self.param], optimizer)
        self.schedule = schedule_of(optimizer)
        policy = staleness or StalenessPolicy()
        self.rules = Staleness(policy, self.param)  # what a stale push becomes
        # the bound on staleness: kept by shard 0 of a server, for all its shards
        self.windows = (
            Windows(policy.max_staleness, policy.expire_s)
            if policy.max_staleness is not None and shard_id == 0
            else None
        )
        self.version = 0
        self.steps = 0  # the global steps the updates applied so far hold
        self.checkpoints = CheckpointDir(Path(checkpoint_dir)) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.checkpoint_seconds = checkpoint_seconds
        self.restored_version: int | None = None
        self.stats = {"pushes": 0, "pulls": 0, "bytes_in": 0, "bytes_out": 0, "staleness_sum": 0}
        self.stats["staleness_max"] = 0
        self.applied: dict[str, int] = {}  # client -> sequence number of its last push applied
        self.is_backup, self.promoted = is_backup, False
        self.primary_node: str | None = None  # a backup's primary's node (`adopt`)
        self.link = BackupLink(backup) if backup is not None else None
        self.empty = False  # restarted by Ray with nothing to restore: refuses every call
        if self.checkpoints is not None and self.checkpoints.latest() is not None and not is_backup:
            self._restore(self.checkpoints.latest())
        else:
            self.empty = _restarted_by_ray()
        self._saved_version = self.version
        self._saved_at = time.monotonic()
        self._tried_version, self._tried_at = self._saved_version, self._saved_at
        self.checkpoint_failures, self.checkpoint_error = 0, None  # periodic ones, see info()

    def initialize(self, values: np.ndarray, step: int = 0) -> tuple[int, Any]:
        """Set the initial slice and global step unless a checkpoint was restored, start
        the backup (with `backup`); return the version and the backup's handle (None
        without one).

        The initial state is checkpointed at once, so a shard Ray restarts before its first
        periodic checkpoint still comes back with its values (Ray keeps no constructor
        arguments for it: they are small).
        """
        if self.restored_version is None:
            self.steps = step
            with torch.no_grad(), self._writing():
                self.param.copy_(torch.from_numpy(np.array(values, dtype=np.float32)))
            self.rules.keep(self.version, self.param)
            if self.checkpoints is not None:
                self.checkpoint()
        self.empty = False
        if self.link is not None and self.link.handle is None:
            self._start_backup()
        return self.version, self.link.handle if self.link is not None else None

    # --- the two calls of Downpour SGD ---------------------------------------------------

    def pull(self) -> tuple[Payload, int]:
        """The current slice and its version."""
        self._check_state()
        payload = self.pull_wire.encode(self.param.detach())
        self.stats["pulls"] += 1
        self.stats["bytes_out"] += Wire.nbytes(payload)
        return payload, self.version

    def region_ref(self) -> shared.RegionRef | None:
        """Where clients on this node map the slice (None: pull through calls)."""
        self._check_state()
        return self.region.ref if self.region is not None else None

    def push(
        self,
        payload: Payload | shared.SharedSlice,
        base_version: int,
        client: str = "",
        seq: int = 0,
        steps: int = 1,
    ) -> tuple[int, int, float]:
        """Apply one gradient, the sum over `steps` training steps (and have the backup
        apply it); return (new version, staleness of this push, the factor the staleness
        rule put on its step: 1 untouched). A push this shard applied already (`client`'s
        `seq`, sent again after a failover) is not applied twice."""
        self._check_state()
        if self._applied_already(client, seq):
            return self.version, 0, 1.0
        if isinstance(payload, shared.SharedSlice) and self.link is not None:
            payload = self.inboxes.values(payload).numpy().copy()  # the backup may be remote
        forward = (
            self.link.forward("replicate", payload, base_version, client, seq, steps)
            if (self.link is not None)
            else None
        )
        result = self._apply(payload, base_version, client, seq, steps)
        if self.link is not None and not self.link.confirm(forward, self.shard_id):
            if self.link.due():  # it holds this update too: the state is copied after it
                self._start_backup()
        self._maybe_checkpoint()
        return result

    def _apply(
        self,
        payload: Payload | shared.SharedSlice,
        base_version: int,
        client: str,
        seq: int,
        steps: int,
    ) -> tuple[int, int, float]:
        if isinstance(payload, shared.SharedSlice):
            grad, nbytes = self.inboxes.values(payload), payload.nbytes
        else:
            grad, nbytes = self.wire.decode(payload), Wire.nbytes(payload)
        if grad.shape != self.param.shape:
            raise ValueError(
                f"shard {self.shard_id} holds {self.param.numel()} values, got a gradient of "
                f"{grad.numel()}"
            )
        staleness = self.version - base_version
        # the staleness rule: a new gradient, or a factor on the rate (1: as it is)
        grad, lr_scale, scale = self.rules.adjust(grad, staleness, base_version, self.param)
        with self._writing():
            # stepped where the gradient lies (a client's inbox, Ray's store, a decoded
            # tensor): the optimizers only read it
            self.param.grad = grad
            # the rate of the push's last step (n_push steps: steps .. steps + n_push - 1)
            apply_lr(self.optimizer, self.schedule, self.steps + max(steps, 1) - 1)
            if lr_scale != 1.0:
                for group in self.optimizer.param_groups:
                    group["lr"] *= lr_scale
            self.optimizer.step()
            self.param.grad = None
            self.version += 1
            self.steps += steps
            self.rules.applied(self.version, self.param)
            self._publish()
        if client:
            self.applied[client] = seq
        self.stats["pushes"] += 1
        self.stats["bytes_in"] += nbytes
        self.stats["staleness_sum"] += staleness
        self.stats["staleness_max"] = max(self.stats["staleness_max"], staleness)
        return self.version, staleness, scale

    # --- bounded staleness (`downpour.max_staleness`; shard 0 keeps the windows) -------

    def open_window(self, client: str, owner: str = "") -> bool:
        """Open `client`'s window from its fetch to its push, if the bound allows
        (`scaleout.ps.staleness.Windows`); False: ask again later."""
        return self.windows is None or self.windows.try_open(client, owner)

    def close_window(self, client: str) -> None:
        if self.windows is not None:
            self.windows.close(client)

    def drop_windows(self, owner: str) -> None:
        """Replica `owner` failed: its windows hold no one back any more."""
        if self.windows is not None:
            self.windows.drop_owner(owner)

    def set_outer_delay(self, delay: int) -> None:
        """DiLoCo, scaled to `delay` replicas: the outer momentum applies once every `delay`
        pushes from now on (`DelayedNesterov.set_delay`; other optimizers have no delay);
        the backup too, in its order of updates."""
        self._check_state()
        if isinstance(self.optimizer, DelayedNesterov):
            self.optimizer.set_delay(delay)
        if self.link is not None:
            forward = self.link.forward("set_outer_delay", delay)
            if not self.link.confirm(forward, self.shard_id) and self.link.due():
                self._start_backup()  # a new one takes the state with the new delay

    # --- the backup ------------------------------------------------------------------------

    def replicate(
        self, payload: Payload, base_version: int, client: str, seq: int, steps: int = 1
    ) -> int:
        """The backup's side of a push: apply what the primary applies, in its order."""
        if not self._applied_already(client, seq):
            self._apply(payload, base_version, client, seq, steps)
        return self.version

    def _applied_already(self, client: str, seq: int) -> bool:
        """Whether `client`'s push `seq` is in this shard (one client's pushes arrive in
        order, so every push up to its last one is)."""
        return bool(client) and seq <= self.applied.get(client, 0)

    def promote(self) -> Any:  # noqa: ANN401 - the new backup's handle
        """The primary died: this backup becomes the primary, starts a backup of its own
        (not on the node the primary was lost with), and returns it (None when none could
        start: the next push tries again). Every client that finds the primary dead calls
        this; the first promotes, the others get the same answer."""
        if self.is_backup:
            self.is_backup, self.promoted = False, True
            self.restored_version = self.version
            if self.link is not None:
                self.link.shun(self.primary_node)
            self._start_backup()
        return self.link.handle if self.link is not None else None

    def applied_for(self, client: str) -> int:
        """The sequence number of `client`'s last push this shard holds: a client that
        was acknowledged more counts the difference as lost (after a restart from a
        checkpoint; never after a failover to the backup)."""
        return self.applied.get(client, 0)

    def adopt(
        self, state: tuple[dict[str, torch.Tensor], dict[str, Any]], primary_node: str
    ) -> str:
        """A new backup takes its primary's whole state (`_state()`) and notes where the
        primary runs; returns its own node."""
        self._load(*state)
        self.primary_node = primary_node
        return ray.get_runtime_context().get_node_id()

    def _start_backup(self) -> None:
        assert self.link is not None
        tensors, meta = self._state()
        state = ({k: v.clone() for k, v in tensors.items()}, meta)
        node = ray.get_runtime_context().get_node_id()
        self.link.start(ParameterShard, (*self.args, True), state, node)

    def _check_state(self) -> None:
        if self.empty:
            raise ShardLost(
                f"parameter-server shard {self.shard_id} was restarted with nothing to restore "
                "(no checkpoint where it runs, no backup): its values are gone; continue the "
                "run with --resume from the last checkpoint, and set downpour.shard_backups = 1"
            )

    # --- state ---------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {
            "shard": self.shard_id,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "version": self.version,
            "numel": self.param.numel(),
            "restored_version": self.restored_version,
            "checkpoint_version": self._saved_version,
            "backup": self.link is not None and self.link.handle is not None,
            "backup_node": self.link.node if self.link is not None else None,
            "backups_started": self.link.started if self.link is not None else 0,
            "promoted": self.promoted,
            "checkpoint_failures": self.checkpoint_failures,
            "checkpoint_error": self.checkpoint_error,
            "rule_clamped": self.rules.clamped,
            "windows_refused": self.windows.refused if self.windows is not None else 0,
            **self.stats,
        }

    def values(self) -> np.ndarray:
        """The slice, uncompressed (evaluation, checkpoints of the whole model, tests)."""
        return self.param.detach().numpy()

    def checkpoint(self) -> str | None:
        """Checkpoint now (at start, and at each of the driver's checkpoints). A shard that
        cannot write raises a one-line `DiskError` naming itself and the file."""
        try:
            return self._write_checkpoint()
        except DiskError as err:
            raise DiskError(f"parameter-server shard {self.shard_id}: {err}") from None

    def _write_checkpoint(self) -> str | None:
        if self.checkpoints is None or self.is_backup:  # a backup writes once promoted
            return None
        self._tried_version, self._tried_at = self.version, time.monotonic()
        tensors, meta = self._state()
        path = self.checkpoints.save(self.version, tensors, {"shard": self.shard_id, **meta})
        self._saved_version, self._saved_at = self.version, time.monotonic()
        return str(path)

    def _maybe_checkpoint(self) -> None:
        """The periodic checkpoint, inside a push. A write that fails (a full disk) must not
        fail the push: the replicas would be blamed for it and the run stopped. The shard
        goes on applying updates, counts the failure (`info()`), and tries again at the
        next due point; the driver's next checkpoint, which asks every shard, fails loudly."""
        if self.checkpoints is None:
            return
        by_count = (
            self.checkpoint_every and self.version - self._tried_version >= self.checkpoint_every
        )
        by_time = (
            self.checkpoint_seconds and time.monotonic() - self._tried_at >= self.checkpoint_seconds
        )
        if by_count or by_time:
            try:
                self._write_checkpoint()
            except DiskError as err:
                self.checkpoint_failures += 1
                self.checkpoint_error = f"parameter-server shard {self.shard_id}: {err}"
                if self.checkpoint_failures == 1:  # once: Ray shows it on the driver's console
                    print(f"{self.checkpoint_error}; training goes on", file=sys.stderr)

    def _restore(self, path: Path) -> None:
        tensors, meta = load_checkpoint(path)
        if tensors["param"].shape != self.param.shape:
            raise CheckpointError(
                f"shard checkpoint {path} holds {tensors['param'].numel()} values, this shard "
                f"{self.param.numel()}: the model or downpour.num_shards changed"
            )
        self._load(tensors, meta)
        self.restored_version = self.version

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything a shard holds, as tensors and JSON: what a checkpoint writes and a new
        backup adopts."""
        tensors, optim_meta = optimizer_state(self.optimizer)
        tensors["param"] = self.param.detach()
        rule_tensors, rule_meta = self.rules.state()
        tensors.update({f"rule.{k}": v for k, v in rule_tensors.items()})
        meta = {
            "version": self.version,
            "steps": self.steps,
            "optimizer": optim_meta,
            "applied": dict(self.applied),
            "rule": rule_meta,
        }
        return tensors, meta

    def _load(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The inverse of `_state`."""
        with torch.no_grad(), self._writing():
            self.param.copy_(tensors["param"])
            load_optimizer_state(self.optimizer, tensors, meta["optimizer"])
            self.version = int(meta["version"])
            self.steps = int(meta.get("steps", self.version))
            rule = {k.removeprefix("rule."): v for k, v in tensors.items() if k.startswith("rule.")}
            self.rules.load(rule, meta.get("rule", {}))
            self._publish()
        self.applied = {str(k): int(v) for k, v in meta.get("applied", {}).items()}

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """No client on this node copies the slice meanwhile."""
        return self.region.writing() if self.region is not None else contextlib.nullcontext()

    def _publish(self) -> None:
        if self.region is not None:
            self.region.publish(self.version)


def _region(numel: int, shard_id: int) -> shared.Region | None:
    """The slice's shared memory, where this node allows it."""
    if not shared.available():
        return None
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    try:
        return shared.Region(numel, node, f"scaleout-shard-{shard_id}")
    except OSError as err:  # e.g. memfd refused: every client goes through Ray
        warnings.warn(
            f"parameter-server shard {shard_id}: no shared memory ({err}); its pulls and "
            "pushes go through Ray's object store",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _restarted_by_ray() -> bool:
    """Whether this is a Ray actor that Ray started again after its process died."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return False
    with warnings.catch_warnings():  # Ray's property reads its own deprecated `actor_id`
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(context.was_current_actor_reconstructed)
