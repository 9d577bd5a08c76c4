"""What the Downpour strategy does when a replica fails: log it, and restart a one-worker
replica where it stopped in its data (up to `downpour.max_restarts`) while the others go on.
A restarted replica starts in the background and joins once it is attached to the shards;
a grid replica cannot be restarted alone (its workers wait for one another), so its failure
stops the run, as does the last replica's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from scaleout.comm import WorkerDied
from scaleout.errors import UserError
from scaleout.progress import console
from scaleout.runtime import START_TIMEOUT_S, describe_failure, restart_backoff_s
from scaleout.strategies.worker import Worker

if TYPE_CHECKING:
    from scaleout.checkpoint import OptimizerState
    from scaleout.strategies.downpour import DownpourSection
    from scaleout.strategies.downpour.phase_shards import PhaseShards
    from scaleout.strategies.downpour.replicas import Replica
    from scaleout.strategies.group import Method, T
    from scaleout.train.protocol import Plan, Tensors


class ReplicaFailures:
    """A mixin of the Downpour strategy: failures, restarts, and restarted replicas joining."""

    opts: DownpourSection
    shards: PhaseShards
    replicas: list[Replica]
    alive: list[bool]
    restarts: list[int]
    failures: list[dict[str, Any]]
    starting: dict[int, list[Any]]
    in_flight: dict[int, tuple[list[Any], int]]
    submitted_at: dict[int, float]
    assigned: int
    steps_lost: int
    step: int
    weights: Tensors | None
    inner: OptimizerState | None
    _plan: Plan | None
    _wall_start: float

    if TYPE_CHECKING:  # defined by the strategy

        def _spawn(self, replica_id: int, most_cpus: float | None = None) -> Replica: ...
        def _attach_args(
            self, replica: Replica, fresh: bool, inner: OptimizerState | None = None
        ) -> list[tuple[Any, ...]]: ...
        def _may_leave(self) -> bool: ...
        def _vacate(self, replica_id: int) -> None: ...

    def _watch(self) -> None:
        """The watchdog: a replica whose chunk (at most `CHUNK_STEPS` steps) has made no
        progress for `downpour.timeout_s` is stuck (a hung process, a lost node): it is
        killed and treated as failed, so it is restarted like a replica that died."""
        now, limit = time.monotonic(), self.opts.timeout_s
        for replica_id in list(self.in_flight):
            if now - self.submitted_at[replica_id] <= limit:
                continue
            _, steps = self.in_flight.pop(replica_id)
            self._replica_failed(
                replica_id, steps, TimeoutError(f"no progress for {limit:g} s (downpour.timeout_s)")
            )

    def _wait_started(self, replica_id: int) -> None:
        """Wait until replica `replica_id` has built its model and data. One that fails while
        starting (its process killed, its node lost, a constructor that raised) is started
        again after a backoff, as a replica that fails mid-run, up to `downpour.max_restarts`;
        the same exception twice in a row is deterministic and stops the run with it."""
        previous: str | None = None  # the exception the last attempt raised, if it raised
        limit = max(self.opts.timeout_s, START_TIMEOUT_S)  # start-up is not progress
        while True:
            replica = self.replicas[replica_id]
            try:
                replica.wait_started(limit)
                return
            except (RayActorError, RayTaskError, GetTimeoutError) as error:
                unplaced = isinstance(error, GetTimeoutError)
                message = (
                    f"not started in {limit:g} s (no node took it, or it hung while starting)"
                    if unplaced
                    else describe_failure(error)  # a user's error stops the run here
                )
                raised = isinstance(error, RayTaskError)  # not a lost process
                if not self._may_restart(replica_id) or (raised and message == previous):
                    raise WorkerDied(
                        f"replica {replica_id} failed while starting: {message[:300]}"
                    ) from None
                previous = message if raised else None
                self._log_failure(replica_id, "died while starting", True, message)
                replica.kill()
                self.restarts[replica_id] += 1
                time.sleep(restart_backoff_s(self.restarts[replica_id]))
                # One that no node took asks next for the CPUs free (its share may be held
                # by a process Ray has not let go of, or by a node that is gone).
                free = ray.available_resources().get("CPU", 0.0) if unplaced else None
                self.replicas[replica_id] = self._spawn(replica_id, free)

    def _may_restart(self, replica_id: int) -> bool:
        replica = self.replicas[replica_id]
        return replica.restartable and self.restarts[replica_id] < self.opts.max_restarts

    def _log_failure(
        self, replica_id: int, kind: str, restart: bool, message: str, leaves: bool = False
    ) -> None:
        """One failure in the summary's list and on the console (`leaves`: an elastic run
        goes on without the replica)."""
        self.failures.append(
            {
                "time_s": round(time.time() - self._wall_start, 3),
                "step": self.step,
                "replica": replica_id,
                "kind": kind,
                "restarted": restart,
                "message": message[:300],
            }
        )
        outcome = (
            "; the run goes on without it (downpour.elastic)"
            if leaves
            else "; restarting it"
            if restart
            else "; not restarting it (downpour.max_restarts)"
        )
        console.print(f"replica {replica_id} {kind} at step {self.step}: {message[:200]}{outcome}")

    def _replica_failed(self, replica_id: int, steps: int, error: BaseException) -> None:
        """Replica `replica_id` failed with a chunk of `steps` steps in flight (0: none):
        they are lost and handed out again; log it, and restart or retire the replica."""
        self.assigned -= steps
        kind = (
            "died"
            if isinstance(error, RayActorError)
            else "stuck"
            if isinstance(error, TimeoutError)
            else "raised"
        )
        message = describe_failure(error)  # a user error in a replica stops the run
        self.steps_lost += steps
        replica = self.replicas[replica_id]
        leaves = self._may_leave()
        restart = not leaves and self._may_restart(replica_id)
        self._log_failure(replica_id, kind, restart, message, leaves)
        replica.kill()
        self.shards.drop_windows(replica_id)  # with max_staleness, no one waits for it
        if leaves:
            self._vacate(replica_id)  # the replicas close the gap at the next look
        elif restart:  # it starts while the others train; it joins when attached
            self.restarts[replica_id] += 1
            self.replicas[replica_id] = self._spawn(replica_id)
            self.starting[replica_id] = [self.replicas[replica_id].started]
        else:
            self.alive[replica_id] = False
            if not any(self.alive):
                raise UserError("every Downpour replica failed; see the messages above")

    def _peer_inner(self, replica_id: int) -> OptimizerState | None:
        """DiLoCo: the optimizer state a restarted replica starts from: a live replica's (as
        torchft's recovering replicas take a peer's), else the last checkpoint's."""
        if self.opts.mode != "diloco":
            return None
        for peer, replica in enumerate(self.replicas):
            if peer == replica_id or not self.alive[peer] or peer in self.starting:
                continue
            try:
                state = replica.call(Worker.inner_state, doing="sharing its optimizer state")[0]
            except (RayActorError, RayTaskError):
                continue  # its failure is handled where its chunk is waited on
            if state is not None:
                return state
        return self.inner

    def _first_alive(self) -> Replica:
        """The first live replica attached to the shards; when every live one is starting
        (restarted, or joining), the first once it is attached."""
        ready = [r for r, ok in enumerate(self.alive) if ok and r not in self.starting]
        if not ready:
            self._settle_starting(wait=True)
            ready = [r for r, ok in enumerate(self.alive) if ok]
        return self.replicas[ready[0]]

    def _ask_first_alive(self, method: Method[T], *args: Any, doing: str) -> list[T]:  # noqa: ANN401
        """The first live replica's answers to `method`, one per worker: an evaluation, the
        state for a checkpoint or a phase. A replica that died since it last answered (with
        its node, say, just before an evaluation) fails here first: it is handled as a
        failed replica (its chunk in flight lost, restarted up to `downpour.max_restarts`),
        and the next live one, or the restarted one once attached, is asked."""
        while True:
            replica = self._first_alive()
            try:
                return replica.call(method, *args, doing=doing)
            except RayActorError as error:
                replica_id = self.replicas.index(replica)
                _, steps = self.in_flight.pop(replica_id, (None, 0))
                self._replica_failed(replica_id, steps, error)

    def _settle_starting(self, wait: bool) -> None:
        """Move restarted replicas on: once started, give them the layers trained so far
        (layer-wise) and attach them to the shards; once attached, they take chunks."""
        for replica_id, futures in list(self.starting.items()):
            # Start-up (imports, model, data) is not progress: it gets at least START_TIMEOUT_S.
            limit = max(self.opts.timeout_s, START_TIMEOUT_S) if wait else 0
            done, _ = ray.wait(futures, num_returns=len(futures), timeout=limit)
            if len(done) < len(futures):
                if wait:  # it cannot start (a node that never comes, a hung constructor)
                    del self.starting[replica_id]
                    late = TimeoutError(f"not started in {limit:g} s")
                    self._replica_failed(replica_id, 0, late)
                continue
            replica = self.replicas[replica_id]
            try:
                replica.get(futures, "starting")
                if replica.started is None:  # attached: it takes chunks from now on
                    del self.starting[replica_id]
                    continue
                replica.started = None  # started: give it what it needs and attach it
                pending = []
                if self.weights is not None and self._plan is not None and self._plan.phase_steps:
                    pending += replica.submit(
                        Worker.load_weights, self.weights, "the layers so far"
                    )
                inner = self._peer_inner(replica_id)
                pending += replica.submit_each(
                    Worker.attach, self._attach_args(replica, False, inner)
                )
                self.starting[replica_id] = pending
                if wait:
                    replica.get(pending, "attaching to the shards")
                    del self.starting[replica_id]
            except (RayActorError, RayTaskError) as error:
                del self.starting[replica_id]
                self._replica_failed(replica_id, 0, error)
