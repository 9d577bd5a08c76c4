"""A replica's side of the parameter server, for any training loop (Downpour SGD's schedule).

    server = ParameterServer.create(initial, num_shards=2, optimizer=train_section)
    client = ReplicaClient([(model.parameters(), server)], n_fetch=3, n_push=3)
    for x, y in loader:
        client.before_step()             # every n_fetch steps: fetch fresh parameters
        loss_fn(model(x), y).backward()  # gradients add up in the client's flat buffer
        client.after_backward()          # every n_push steps: push them, without waiting
    client.flush()                       # push the rest, wait for the shards, fetch the end

Schedule (DistBelief section 4.1): every `n_fetch` steps the replica pulls fresh parameters
from all shards in parallel; between fetches its parameters do not change (only the shards
apply updates). Autograd adds every step's gradient into a flat buffer (the parameters and
their `.grad` become views of two flat buffers, `FlatParameters`: no copies), and every
`n_push` steps the client sends each shard its slice and goes on without waiting for the
shards to apply it; the results of a push (new versions, staleness) are collected at the
next one. Do not call `optimizer.zero_grad()` or `model.zero_grad()`: the client zeroes the
buffer after each push (on a node it shares with shards, it moves the gradient to another
buffer in shared memory instead: the push names the one it filled where it lies,
`ParameterServer.gradient_buffer`).

`groups` pairs each parameter group with the server whose shards hold it: several servers
when parameter groups step differently (e.g. the sparse autoencoder's alpha on a shard of
its own with a smaller learning rate). `after_pull` runs after each fetch (a model-parallel
grid broadcasts its replicated parameters there); `before_push` before each push (the grid
sums those parameters' gradients; a replica clips the gradient it pushes), and what it
returns goes into the push's record; `after_push` after it. Each push carries the steps it holds, so
the shards know the global step their learning-rate schedule reads.

With `bounded=True` the shards bound staleness (`downpour.max_staleness`): before the fetch
that starts each push window the client opens a window at each server and waits while the
bound holds it back, and after each push it waits until the shards applied it, then closes
the window (`scaleout.ps.staleness.Windows`). The seconds waited go into the push's record
(`wait_s`).

With `mode="diloco"` (Douillard et al. 2023) the replica steps an optimizer of its own
after each backward (`after_step` instead of `after_backward`), and every `n_push` steps
pushes the pseudo-gradient, (fetched parameters - local parameters) * `outer_scale`, on
which the shards step their outer optimizer; it then fetches the result (`n_fetch` must
equal `n_push`).

With `threads=True` fetch, compute and push run in three weakly synchronised threads, as in
the paper's appendix: the compute thread adopts whatever parameters the fetch thread last
brought and hands its accumulated gradients to the push thread through a short queue, so
communication overlaps computation. `threads="auto"` starts in turn, measures the first
`AUTO_PROBE_PUSHES` push windows after the first, and starts the threads only where
`threads_pay`: where a window computes longer than it communicates.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray
import torch
from torch import nn

from scaleout.ps.layout import FlatParameters
from scaleout.ps.pipeline import Pipeline
from scaleout.ps.server import ParameterServer, Push

Params = Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]]
Hook = Callable[[], None]
PushHook = Callable[[], dict[str, Any] | None]  # what it returns goes into the push record

AUTO_PROBE_PUSHES = 4  # push windows measured (after the first) before "auto" decides


def threads_pay(compute_s: float, communication_s: float) -> bool:
    """Whether fetch and push threads pay for a replica whose push windows compute for
    `compute_s` and fetch and push for `communication_s`, in turn.

    Only when the compute hides the communication: the fetch thread then brings parameters
    at most a window old. A replica that computes faster than it communicates runs ahead of
    its own pushes on staler parameters, and its accuracy per step falls below that of
    fetching and pushing in turn.
    """
    return compute_s >= communication_s


def auto_threads(windows: Sequence[tuple[float, float]]) -> bool | None:
    """What "auto" decides from the (compute, communication) seconds of the push windows
    measured so far: None until there are AUTO_PROBE_PUSHES of them, then `threads_pay` of
    their sums. The client and the simulator both decide here."""
    if len(windows) < AUTO_PROBE_PUSHES:
        return None
    compute, communication = (sum(part) for part in zip(*windows, strict=True))
    return threads_pay(compute, communication)


Mode = Literal["gradients", "diloco"]


@dataclass
class ServedGroup:
    """A parameter group (flat) and the server whose shards hold it, with the shard
    versions its values were fetched at."""

    flat: FlatParameters
    server: ParameterServer
    versions: list[int]
    anchor: torch.Tensor | None = None  # DiLoCo: the parameters last fetched (P,)


class ReplicaClient:
    def __init__(
        self,
        groups: Sequence[tuple[Params, ParameterServer]],
        n_fetch: int = 1,
        n_push: int = 1,
        threads: bool | Literal["auto"] = False,
        after_pull: Hook | None = None,
        before_push: PushHook | None = None,
        after_push: Hook | None = None,
        bounded: bool = False,
        owner: str = "",
        mode: Mode = "gradients",
        outer_scale: float = 1.0,
    ) -> None:
        if n_fetch < 1 or n_push < 1:
            raise ValueError(f"n_fetch and n_push must be >= 1, got {n_fetch} and {n_push}")
        if mode == "diloco" and (n_fetch != n_push or threads is True):
            raise ValueError(
                f"mode 'diloco' fetches after each push: n_fetch ({n_fetch}) must equal n_push "
                f"({n_push}), without threads"
            )
        if bounded and (n_fetch > n_push or threads is True):
            raise ValueError(
                f"bounded staleness opens a window at each fetch: n_fetch ({n_fetch}) must be "
                f"at most n_push ({n_push}), without threads"
            )
        self.groups: list[ServedGroup] = []
        for params, server in groups:
            flat = FlatParameters(params)
            if flat.numel != server.numel:
                raise ValueError(
                    f"these parameters hold {flat.numel} values, the server {server.numel}: "
                    "give the parameters the server was created from"
                )
            self.groups.append(ServedGroup(flat, server, [0] * len(server.shards)))
        self.n_fetch, self.n_push = n_fetch, n_push
        self.bounded, self.owner = bounded, owner
        self.mode, self.outer_scale = mode, outer_scale
        if mode == "diloco":
            for group in self.groups:
                group.anchor = group.flat.params.detach().clone()
        if mode == "diloco" or bounded:
            threads = False  # "auto" too: both fetch after their own push is applied
        self._window = False  # bounded: this client's window is open (fetched, not pushed)
        self.after_pull, self.before_push, self.after_push = after_pull, before_push, after_push
        self.steps = 0
        self._steps_pushed = 0  # `steps` at the last push
        self.stats = {"pushes": 0, "pulls": 0, "bytes_sent": 0, "bytes_received": 0}
        self.staleness: list[float] = []
        self._received = 0  # bytes pulled since the last push record
        self._seconds = {"fetch": 0.0, "push": 0.0, "wait": 0.0}
        self._pending: list[tuple[list[tuple[ParameterServer, list[Push]]], dict[str, Any]]] = []
        self._lost_reported = 0
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # the push thread appends records, `take_records` takes
        self._pipeline: Pipeline | None = Pipeline(self) if threads is True else None
        self._probe: list[tuple[float, float]] | None = [] if threads == "auto" else None
        self._window_started: float | None = None  # when the last push started (auto)

    # --- the two calls around a training step ----------------------------------------------

    def before_step(self) -> None:
        """Fetch the shards' parameters when one is due (every `n_fetch` steps)."""
        opening = self.bounded and not self._window
        if opening:
            waiting = time.perf_counter()
            self._open_windows()
            self._window = True
            self._seconds["wait"] += time.perf_counter() - waiting
        started = time.perf_counter()
        if self._pipeline is not None:
            self._pipeline.adopt_fresh_parameters()
        elif opening or self.steps % self.n_fetch == 0:
            self.fetch()
        self._seconds["fetch"] += time.perf_counter() - started

    def after_backward(self, **info: Any) -> None:  # noqa: ANN401
        """Count the step; push the accumulated gradient when one is due (every `n_push`
        steps). `info` (e.g. the loss since the last push) goes into the push's record."""
        self.steps += 1
        if self.steps - self._steps_pushed >= self.n_push:
            self.push(**info)

    @property
    def push_due(self) -> bool:
        """Whether the next step's `after_backward` (or `after_step`) pushes."""
        return self.steps + 1 - self._steps_pushed >= self.n_push

    def release(self, **info: Any) -> None:  # noqa: ANN401
        """With bounded staleness: push what this window holds now, so that a replica about
        to idle (its chunk of steps ended) holds no other replica back at the bound."""
        if self.bounded and self._window and self.steps > self._steps_pushed:
            self.push(**info)

    def after_step(self, **info: Any) -> None:  # noqa: ANN401
        """DiLoCo: after the replica's own optimizer stepped on this step's gradient: zero
        it, count the step, and push the pseudo-gradient when one is due."""
        assert self.mode == "diloco", "after_step is DiLoCo's; use after_backward"
        for group in self.groups:
            group.flat.zero_grads()
        self.after_backward(**info)

    def _open_windows(self) -> None:
        """Wait until every server opens this client's window (one that refuses closes the
        others opened meanwhile, so no client holds a window while it waits)."""
        pause = 0.001
        while True:
            opened = []
            for group in self.groups:
                if not group.server.open_window(self.owner):
                    break
                opened.append(group)
            else:
                return
            for group in opened:
                group.server.close_window()
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    # --- communication -------------------------------------------------------------------

    @torch.no_grad()
    def fetch(self, update_versions: bool = True) -> None:
        """Pull every shard's current values into the parameters now. `update_versions`
        False: a look at the shards (evaluation) that the next push's staleness ignores."""
        for group in self.groups:
            versions, received = group.server.pull_into(group.flat.params)
            if update_versions:
                group.versions = versions
                if group.anchor is not None:
                    group.anchor.copy_(group.flat.params)
                self._received += received
                self.stats["bytes_received"] += received
        if update_versions:
            self.stats["pulls"] += 1
        if self.after_pull is not None:
            self.after_pull()

    def push(self, **info: Any) -> None:  # noqa: ANN401
        """Send the accumulated gradient now (without waiting for it to be applied)."""
        started = time.perf_counter()
        if self.mode == "diloco":  # the pseudo-gradient, where the gradient would be
            for group in self.groups:
                assert group.anchor is not None
                torch.sub(group.anchor, group.flat.params, out=group.flat.grads)
                if self.outer_scale != 1.0:
                    group.flat.grads.mul_(self.outer_scale)
        extra = self.before_push() if self.before_push is not None else None
        steps, self._steps_pushed = self.steps - self._steps_pushed, self.steps
        record = {"t": time.time(), "threads": self.threads, "steps": steps, **info}
        record.update(extra or {})
        record.update({f"{k}_s": round(v, 6) for k, v in self._seconds.items()})
        self._seconds = dict.fromkeys(self._seconds, 0.0)
        if self._pipeline is not None:
            grads = [self._hand_over(group) for group in self.groups]
            versions = [list(group.versions) for group in self.groups]
            self._zero()
            self._pipeline.push(grads, versions, record)
        else:
            self._collect(wait=True)  # the previous push has long been applied
            self._send(
                [group.flat.grads for group in self.groups],
                [group.versions for group in self.groups],
                record,
            )
            self._zero(swap=True)  # the shards may still read the buffer just pushed
            if self.bounded:  # applied on every shard: the window closes
                self._collect(wait=True)
                for group in self.groups:
                    group.server.close_window()
                self._window = False
        self._seconds["push"] += time.perf_counter() - started
        if self._probe is not None:
            self._measure_window(started, record)

    @property
    def threads(self) -> bool | None:
        """Whether fetch and push run in threads now; None while "auto" still measures."""
        if self._pipeline is not None:
            return True
        return None if self._probe is not None else False

    def _measure_window(self, started: float, record: dict[str, Any]) -> None:
        """With threads "auto": the window that ended at this push computed for its wall
        time less what it fetched and pushed (the previous push, recorded now); after the
        probes, decide."""
        assert self._probe is not None
        if self._window_started is not None:  # the first window also holds the start-up
            communication = record["fetch_s"] + record["push_s"]
            compute = started - self._window_started - communication
            self._probe.append((compute, communication))
        self._window_started = started
        decided = auto_threads(self._probe)
        if decided is not None:
            self._probe = None
            if decided:
                self._pipeline = Pipeline(self)

    def _zero(self, swap: bool = False) -> None:
        """Zero the gradient buffers after a push; `swap`: first move each group to a free
        buffer in shared memory (the shards may still read the one just pushed), or to
        its own memory."""
        for group in self.groups:
            if swap:
                buffer = _shared_buffer(group)
                group.flat.use_grads(buffer if buffer is not None else group.flat.own_grads)
            group.flat.zero_grads()
        if self.after_push is not None:
            self.after_push()

    @staticmethod
    def _hand_over(group: ServedGroup) -> torch.Tensor:
        """The group's gradient for the push thread: its shared buffer itself where another
        is free to go on in (the push names it where it lies), else a copy (the group's own
        memory is zeroed and refilled before the push thread sends it)."""
        flat = group.flat
        buffer = _shared_buffer(group)
        if flat.grads is flat.own_grads or buffer is None:
            grads = flat.grads.clone()
        else:
            grads = flat.grads
        if buffer is not None:
            flat.use_grads(buffer)
        return grads

    def _send(
        self, grads: list[torch.Tensor], versions: list[list[int]], record: dict[str, Any]
    ) -> None:
        pushes, sent = [], 0
        for group, grad, version in zip(self.groups, grads, versions, strict=True):
            group_pushes, group_sent = group.server.push(grad, version, record["steps"])
            pushes.append((group.server, group_pushes))
            sent += group_sent
        record.update(bytes_sent=sent, bytes_received=self._received)
        self._received = 0
        self.stats["pushes"] += 1
        self.stats["bytes_sent"] += sent
        self._pending.append((pushes, record))

    def _collect(self, wait: bool) -> None:
        """Turn applied pushes into records: staleness per shard, and the updates this
        client had acknowledged that a shard lost (a shard that died is replaced by its
        backup, or restarted by Ray from its checkpoint, and the push sent again)."""
        still = []
        for pushes, record in self._pending:
            futures = [push.future for _, group_pushes in pushes for push in group_pushes]
            if not wait and not all(_ready(f) for f in futures):
                still.append((pushes, record))
                continue
            applied = [a for server, group_pushes in pushes for a in server.settle(group_pushes)]
            staleness = [stale for _, stale, _ in applied]
            scales = [scale for _, _, scale in applied]
            lost = sum(group.server.updates_lost for group in self.groups)
            record.update(
                staleness=sum(staleness) / len(staleness) if staleness else None,
                staleness_max=max(staleness) if staleness else None,
                rule_scale=sum(scales) / len(scales) if scales else None,
                updates_lost=lost - self._lost_reported,
            )
            self._lost_reported = lost
            self.staleness += staleness
            with self._lock:
                self._records.append(record)
        self._pending = still

    def take_records(self) -> list[dict[str, Any]]:
        """The records of the pushes applied since the last call (`t`: wall time of the push,
        `bytes_sent`, `bytes_received`, `fetch_s`, `push_s` and `wait_s` (at the staleness
        bound) spent since the previous one, `staleness` (mean over shards),
        `staleness_max`, `rule_scale` (the mean factor the shards' staleness rule put on
        the step: 1 untouched), `updates_lost`, `threads` (whether
        the push went through the push thread; None while "auto" measures), and the `info`)."""
        with self._lock:
            records, self._records = self._records, []
        return records

    def flush(self, pull: bool = True, **info: Any) -> list[dict[str, Any]]:  # noqa: ANN401
        """Push what is left, wait until the shards applied every push, and (`pull`) adopt
        their final values; return the last records. Replicas that must end equal flush
        all with `pull=False` first, then `fetch()`: a value is final once every push is in."""
        if self._pipeline is not None:
            self._pipeline.stop()
            self._pipeline = None
        if self.steps > self._steps_pushed:
            self.push(**info)
        self._collect(wait=True)
        if pull:
            self.fetch()
        return self.take_records()

    def close(self) -> None:
        """Stop the pipeline threads (nothing more is pushed)."""
        if self._pipeline is not None:
            self._pipeline.stop()
            self._pipeline = None


def _shared_buffer(group: ServedGroup) -> torch.Tensor | None:
    """A buffer in shared memory for the group's next gradient (`gradient_buffer`), where
    its parameters are float32 on the CPU; None: go on in its own memory."""
    own = group.flat.own_grads
    if own.dtype != torch.float32 or own.device.type != "cpu":
        return None
    return group.server.gradient_buffer()


def _ready(future: Any) -> bool:  # noqa: ANN401
    done, _ = ray.wait([future], timeout=0)
    return bool(done)
