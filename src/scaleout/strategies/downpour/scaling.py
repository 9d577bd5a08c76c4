"""A running Downpour run changes its replica count: `scaleout scale RUN_DIR --replicas N`,
and `downpour.elastic`.

A request is the file `RUN_DIR/scale.json` (`ScaleRequest`), replaced atomically by
`request_scale`; the strategy looks at it between chunks. A parameter server needs no
quorum, so the count changes without a restart. The strategy lets the chunks in flight
finish (at most `CHUNK_STEPS` steps each), then:

- replicas that leave (the highest ids) push what they hold and wait until the shards have
  applied it, then end: their last push is kept, and they do not count as failures;
- every replica that stays reads its part of the new split from the run's place in the data
  (`positions.rescaled`), so every example is still read once an epoch;
- new replicas start in the background at their part and take chunks once attached to the
  shards, as a restarted replica does; their first push is timed from the request;
- DiLoCo: a push is 1/N of a round, and the shards' outer momentum applies once per N.

Elastic runs also follow the Ray cluster: every `ELASTIC_POLL_S` the driver adds replicas
while the cluster has a replica's CPUs free (a node joined), up to `max_replicas`; a replica
that dies (its node left, say) is not restarted while more than `min_replicas` remain: the
run goes on with one fewer, and grows back once the cluster has room again (after
`ELASTIC_SETTLE_S`, the time Ray takes to notice a lost node's CPUs are gone). Replicas keep
the ids 0..N-1: the ones above a gap move down, each pushing what it holds first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from scaleout.checkpoint import atomic_write
from scaleout.errors import UserError
from scaleout.progress import console
from scaleout.rundir import in_training
from scaleout.runtime import cpu_share
from scaleout.strategies.downpour.failures import ReplicaFailures
from scaleout.strategies.downpour.positions import rescaled
from scaleout.strategies.worker import Worker

if TYPE_CHECKING:
    from scaleout.rundir import RunDir
    from scaleout.train.config import TrainSection
    from scaleout.train.job import Job
    from scaleout.train.protocol import Chunk

SCALE_FILE = "scale.json"
ELASTIC_POLL_S = 2.0  # an elastic run looks at the cluster's free CPUs this often
ELASTIC_SETTLE_S = 30.0  # after a replica left, the cluster's free CPUs are trusted again


class ScaleRequest(BaseModel):
    """What `scaleout scale` asks of a running run: go on with `replicas` replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: PositiveInt
    requested_at: float  # wall time (`time.time()`) of the command


def request_scale(run_dir: Path, replicas: int) -> ScaleRequest:
    """Ask the Downpour run training in `run_dir` to go on with `replicas` replicas."""
    if replicas < 1:
        raise UserError(f"--replicas {replicas}: a run needs at least 1 replica")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a run directory: name one `scaleout train` writes")
    if not in_training(run_dir):
        raise UserError(
            f"no run is training in {run_dir}: scale a running Downpour run, or resume this "
            f"one with `scaleout train CONFIG --resume --set downpour.num_replicas={replicas}`"
        )
    request = ScaleRequest(replicas=replicas, requested_at=time.time())
    text = request.model_dump_json()  # replaced whole: the run never reads half a request
    atomic_write(run_dir / SCALE_FILE, lambda tmp: tmp.write_text(text))
    return request


class ScaleRequests:
    """The run's side of `request_scale`: each request once, in the order written."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / SCALE_FILE
        self.path.unlink(missing_ok=True)  # one left by an earlier run of this directory
        self.seen: int | None = None

    def take(self) -> ScaleRequest | None:
        """A request written since the last call, or None."""
        try:
            stamp = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if stamp == self.seen:
            return None
        self.seen = stamp
        try:
            return ScaleRequest.model_validate(json.loads(self.path.read_text()))
        except (ValueError, ValidationError) as error:
            console.print(f"{self.path} is not a scale request ({error}); ignored")
            return None


class ReplicaScaling(ReplicaFailures):
    """A mixin of the Downpour strategy: its replica count changing while it runs."""

    job: Job
    cfg: TrainSection
    run: RunDir
    positions: list[dict[str, int] | None]
    replica_cpus: float
    phase: int
    grid: object | None

    if TYPE_CHECKING:  # defined by the strategy

        @property
        def count(self) -> int: ...
        @property
        def outer_scale(self) -> float: ...
        def _wait_one(self, chunk: Chunk) -> None: ...
        def _log_pushes(self, records: list[dict[str, Any]]) -> None: ...

    def _init_scaling(self) -> None:
        self.requests = ScaleRequests(self.run.path)
        self.joining: dict[int, float] = {}  # replica -> when it was asked for (wall time)
        self.events: list[dict[str, Any]] = []  # joins and leaves, for checkpoints
        self.window_events: list[str] = []  # since the last metrics line: "+2", "-1"
        self.vacated = False  # elastic: a replica left; compact at the next look
        self._polled = self._left_at = 0.0

    def _look_at_scaling(self, chunk: Chunk) -> None:
        """Between chunks: apply a `scaleout scale` request, or follow the cluster."""
        request = self.requests.take()
        if request is not None and self.grid is not None:
            console.print(
                f"scaleout scale {request.replicas} ignored: a model-parallel replica's "
                "workers form a process group that cannot grow or shrink while it runs; "
                "resume the run with --set downpour.num_replicas=N instead"
            )
        elif request is not None:
            self._scale_to(request.replicas, "scaleout scale", request.requested_at, chunk)
            return
        if not self.opts.elastic:
            return
        now = time.monotonic()
        if self.vacated:
            self.vacated = False
            self._scale_to(sum(self.alive), "a replica left", time.time(), chunk)
        elif now - self._polled >= ELASTIC_POLL_S and now - self._left_at >= ELASTIC_SETTLE_S:
            self._polled = now
            target = self._room()
            if target > self.count:
                self._scale_to(target, "the cluster has room", time.time(), chunk)

    def _room(self) -> int:
        """Replicas the cluster holds now: those running and one per replica's CPUs free."""
        free = ray.available_resources().get("CPU", 0.0)
        count = self.count + int((free + 1e-6) // max(self.replica_cpus, 1e-3))
        most = self.opts.max_replicas or count
        return min(count, most, self._train_size())

    def _train_size(self) -> int:
        probe = self.job.probe
        assert probe is not None
        return probe.train_size

    def _may_leave(self) -> bool:
        """Elastic: whether a replica that failed leaves instead of being restarted (more
        than `min_replicas` would remain)."""
        return self.opts.elastic and sum(self.alive) - 1 >= self.opts.min_replicas

    def _vacate(self, replica_id: int) -> None:
        """Failed replica `replica_id` leaves; the others close the gap at the next look."""
        self.alive[replica_id] = False
        self.vacated, self._left_at = True, time.monotonic()
        self._note("left", replica_id, "it failed, and elastic runs go on without it")

    def _scale_to(self, count: int, why: str, requested_at: float, chunk: Chunk) -> None:
        """Go on with `count` replicas (see the module's docstring)."""
        if self.opts.max_replicas is not None and self.opts.elastic:
            count = min(count, self.opts.max_replicas)
        count = min(count, self._train_size())
        survivors = [r for r in range(len(self.replicas)) if self.alive[r]]
        if count == len(survivors) == self.count:
            return
        console.print(f"going on with {count} replicas ({why})")
        while self.in_flight:  # every replica at a chunk's end, its position known
            self._wait_one(chunk)
        survivors = [r for r in range(len(self.replicas)) if self.alive[r]]
        keep, leaving = survivors[:count], survivors[count:]
        for r in leaving:
            self._leave(r)
        self._settle_starting(wait=True)  # those that stay, restarted or joining: attached
        for r in range(len(self.replicas)):
            if r not in keep and r not in leaving:
                self.replicas[r].kill()  # failed for good, or vacated: its slot goes
                self.shards.drop_windows(r)
        size, batch = self._train_size(), self.cfg.batch_size
        positions = rescaled(self.positions, count, size, batch, self.step, self.phase)
        moved = [(new, old) for new, old in enumerate(keep) if new != old]
        inners = {}
        for new, old in moved:  # its client was another replica's: push, and attach anew
            replica = self.replicas[old]
            self._log_pushes(replica.call(Worker.flush_pushes, doing="moving")[0])
            inners[new] = replica.call(Worker.inner_state, doing="moving")[0]
            replica.call(Worker.adopt_final, doing="moving")
            self.shards.drop_windows(old)
        self.joining = {keep.index(r): t for r, t in self.joining.items() if r in keep}
        self.replicas = [self.replicas[r] for r in keep]
        self.restarts = [self.restarts[r] for r in keep]
        self.alive = [True] * len(keep)
        self.positions = positions
        self.shards.rescale(count)
        for new, replica in enumerate(self.replicas):
            replica.id = new
            part = (new, count, positions[new], self.outer_scale)
            replica.call(Worker.take_part, *part, doing="taking its part")
        for new, _ in moved:
            replica = self.replicas[new]
            args = self._attach_args(replica, False, inners[new])
            replica.get(replica.submit_each(Worker.attach, args), "attaching to the shards")
        self._grow(count, requested_at, why)

    def _grow(self, count: int, requested_at: float, why: str) -> None:
        """Start replicas len(replicas)..count-1; they join once attached (`_settle_starting`)."""
        new = range(len(self.replicas), count)
        if not new:
            return
        free = ray.available_resources().get("CPU", 0.0)  # a scale past the cluster shares
        self.replica_cpus = min(cpu_share(count), max(free, 0.0) / len(new))
        for r in new:
            self.restarts.append(0)
            self.alive.append(True)
            self.replicas.append(self._spawn(r))
            self.starting[r] = [self.replicas[r].started]
            self.joining[r] = requested_at
            self._note("asked to join", r, why, requested_at=round(requested_at, 3))

    def _leave(self, replica_id: int) -> None:
        """Replica `replica_id` pushes what it holds, waits until the shards applied it, and
        ends (not a failure)."""
        replica = self.replicas[replica_id]
        kept = "its last push applied"
        if self.starting.pop(replica_id, None) is not None:
            kept = "before it joined: it had not pushed"
        else:
            try:
                self._log_pushes(replica.call(Worker.flush_pushes, doing="leaving")[0])
            except ray.exceptions.RayError:
                kept = "its last push lost with it"
        self.joining.pop(replica_id, None)
        replica.kill()
        self.shards.drop_windows(replica_id)
        self._note("left", replica_id, kept)

    def _note(self, event: str, replica_id: int, detail: str, **fields: Any) -> None:  # noqa: ANN401
        self.events.append(
            {
                "time_s": round(time.time() - self._wall_start, 3),
                "step": self.step,
                "replica": replica_id,
                "event": event,
                "detail": detail,
                **fields,
            }
        )
        if event in ("joined", "left"):
            self.window_events.append(f"{'+' if event == 'joined' else '-'}{replica_id}")
        console.print(f"replica {replica_id} {event} at step {self.step}: {detail}")

    def _first_pushes(self, records: list[dict[str, Any]]) -> None:
        """A joining replica's first push: it has joined; how long after the request."""
        for record in records:
            replica_id = record.get("replica")
            if replica_id in self.joining and "t" in record:
                waited = record["t"] - self.joining.pop(replica_id)
                detail = f"first push {waited:.1f} s after it was asked for"
                pushed = round(record["t"], 3)  # wall time, as `requested_at`
                self._note("joined", replica_id, detail, first_push_s=round(waited, 3), at=pushed)

    def scaling_summary(self) -> dict[str, Any]:
        joins = [e["first_push_s"] for e in self.events if e["event"] == "joined"]
        return {
            "replicas": self.count,
            "replicas_joined": len(joins),
            "replicas_left": sum(1 for e in self.events if e["event"] == "left"),
            **({"join_first_push_s_max": max(joins)} if joins else {}),
        }
