"""What a shard does with a stale push: staleness rules, and the gate that bounds staleness.

A push computed from version `base` of a shard's slice and applied at version `now` has
staleness `now - base`: that many updates landed in between. Rules (`downpour.staleness_rule`)
change the push where it is applied, from its staleness and the parameters it was computed
from:

- `"none"`: applied as it is (DistBelief's Downpour).
- `"inverse"`: the learning rate of the update divided by max(1, staleness) (Zhang et al.
  2016, "staleness-aware" ASGD).
- `"dc"`: delay compensation (Zheng et al. 2017, DC-ASGD): the gradient g computed at w_base
  is moved to the current w by a first-order Taylor term with the diagonal of the outer
  product as the Hessian's approximation: g + lambda * g * g * (w_now - w_base).
- `"gap"`: gap-aware (Barkai et al. 2020): element-wise, the gradient is divided by
  max(1, |w_now - w_base| / C), where C is the running mean of the magnitude of one
  update of that element (an exponential mean over updates, beta 0.999, bias-corrected): a
  gradient is penalised by how far its parameters moved, measured in typical steps.

`dc` and `gap` need w_base: the shard keeps its slice at each of its last `history`
versions. A push staler than that is compensated from the oldest kept (and counted in
`clamped`).

`Windows` bounds staleness (`downpour.max_staleness`, SSP-like): a replica opens a window
before it fetches and closes it once its push is applied; a window opens only when no open
window's push can then land more than `bound` updates after its fetch, and in the order the
replicas first asked. Replicas wait at the open, never with a gradient computed, so no push
is discarded and nothing deadlocks: the windows open always close.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import torch

Rule = Literal["none", "inverse", "dc", "gap"]
RULES: tuple[Rule, ...] = ("none", "inverse", "dc", "gap")
GAP_BETA = 0.999  # the running mean of one update's magnitude (gap-aware's C)
GAP_EPS = 1e-12
WAITER_GONE_S = 1.0  # a refused client asks again within 50 ms; one silent this long left


@dataclass(frozen=True)
class StalenessPolicy:
    """How a server's shards treat stale pushes (module docstring): the rule, and the bound
    on staleness (None: none) with the seconds after which a window left open is closed
    (its replica died or stalled)."""

    rule: Rule = "none"
    dc_lambda: float = 0.04  # DC-ASGD's lambda (the paper's constant variant)
    history: int = 8  # versions of the slice kept for "dc" and "gap"
    max_staleness: int | None = None
    expire_s: float = 300.0

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"staleness_rule = {self.rule!r}: use one of {', '.join(RULES)}")
        if self.history < 1:
            raise ValueError(f"history = {self.history}: keep at least 1 version")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness = {self.max_staleness}: use 0 or more, or None")

    @property
    def needs_history(self) -> bool:
        return self.rule in ("dc", "gap")


class Staleness:
    """One shard's side of a rule: the kept versions of its slice and gap-aware's mean step.

    Call `adjust` before the optimizer steps on a push and `applied` after it."""

    def __init__(self, rule: StalenessPolicy, param: torch.Tensor) -> None:
        self.rule = rule
        self.kept: OrderedDict[int, torch.Tensor] = OrderedDict()  # version -> slice (n,)
        self.mean_step = torch.zeros_like(param) if rule.rule == "gap" else None  # C (n,)
        self.updates = 0  # updates the mean step has seen (bias correction)
        self.clamped = 0

    def adjust(
        self, grad: torch.Tensor, staleness: int, base_version: int, param: torch.Tensor
    ) -> tuple[torch.Tensor, float, float]:
        """The gradient to apply and the factor on the learning rate, for a push of
        `staleness` computed at `base_version` (the shard's slice is `param` now); also the
        mean factor the rule put on the step (1: untouched), for the push's record."""
        rule = self.rule.rule
        if rule == "none" or staleness <= 0:
            return grad, 1.0, 1.0
        if rule == "inverse":
            scale = 1.0 / max(1, staleness)
            return grad, scale, scale
        gap = param.detach() - self._base(base_version, param)  # w_now - w_base (n,)
        if rule == "dc":
            lam = self.rule.dc_lambda
            return grad + lam * grad * grad * gap, 1.0, 1.0
        assert self.mean_step is not None
        mean_step = self.mean_step / max(1.0 - GAP_BETA**self.updates, GAP_EPS)
        penalty = torch.clamp(gap.abs() / (mean_step + GAP_EPS), min=1.0)
        if self.updates == 0:
            penalty = torch.ones_like(penalty)  # no step size known yet
        return grad / penalty, 1.0, float((1.0 / penalty).mean())

    def applied(self, version: int, param: torch.Tensor) -> None:
        """After the update that made `version`: update the mean step (from the slice kept
        at the version before); keep the slice."""
        if self.mean_step is not None and self.kept:
            before = next(reversed(self.kept.values()))
            step = (param.detach() - before).abs_()
            self.mean_step.mul_(GAP_BETA).add_(step, alpha=1.0 - GAP_BETA)
            self.updates += 1
        if self.rule.needs_history:
            self.keep(version, param)

    def keep(self, version: int, param: torch.Tensor) -> None:
        """Keep the slice as it is at `version` (the initial one too: pushes fetched it)."""
        if not self.rule.needs_history:
            return
        reuse = self.kept.popitem(last=False)[1] if len(self.kept) >= self.rule.history else None
        if reuse is not None and reuse.shape == param.shape:
            reuse.copy_(param.detach())
            self.kept[version] = reuse
        else:
            self.kept[version] = param.detach().clone()

    def _base(self, version: int, param: torch.Tensor) -> torch.Tensor:
        if version in self.kept:
            return self.kept[version]
        self.clamped += 1
        if not self.kept:
            return param.detach()
        return next(iter(self.kept.values()))  # the oldest kept

    # --- state: checkpoints and a new backup take it too --------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        tensors = {f"kept.{v}": t for v, t in self.kept.items()}
        if self.mean_step is not None:
            tensors["mean_step"] = self.mean_step
        return tensors, {"kept": list(self.kept), "updates": self.updates}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, object]) -> None:
        versions = meta.get("kept", [])
        assert isinstance(versions, list)
        self.kept = OrderedDict((int(v), tensors[f"kept.{v}"].clone()) for v in versions)
        if self.mean_step is not None and "mean_step" in tensors:
            self.mean_step.copy_(tensors["mean_step"])
        updates = meta.get("updates", 0)
        self.updates = int(updates) if isinstance(updates, int) else 0


@dataclass
class _Window:
    opened: float
    overlap: int  # other windows open at its start or opened since: the most its push waits


class Windows:
    """The open windows of one parameter server (kept by its shard 0): a window from a
    replica's fetch to its push being applied on every shard. `bound`: the most updates of
    other replicas one push may find applied after its fetch (`downpour.max_staleness`)."""

    def __init__(self, bound: int, expire_s: float) -> None:
        self.bound, self.expire_s = bound, expire_s
        self.open: dict[str, _Window] = {}  # client -> its window
        self.owners: dict[str, str] = {}  # client -> the replica it belongs to
        self.waiting: dict[str, tuple[float, float]] = {}  # refused: first refusal, last ask
        self.refused = self.expired = 0

    def try_open(self, client: str, owner: str = "", now: float | None = None) -> bool:
        """Open `client`'s window if every open one's push still lands within the bound
        and no client refused before it still waits (first come, first served: a fast
        replica does not starve a slow one); False: wait and ask again."""
        now = time.monotonic() if now is None else now
        for other in [
            c for c, w in self.open.items() if c != client and now - w.opened > self.expire_s
        ]:
            self.close(other)  # its replica died or stalled: the driver restarts it
            self.expired += 1
        for other in [c for c, (_, last) in self.waiting.items() if now - last > WAITER_GONE_S]:
            del self.waiting[other]  # stopped asking: gone
        self.close(client)
        first = self.waiting.get(client, (now, now))[0]
        ahead = any(since < first for c, (since, _) in self.waiting.items() if c != client)
        others = list(self.open.values())
        if ahead or len(others) > self.bound or any(w.overlap + 1 > self.bound for w in others):
            self.waiting[client] = (first, now)
            self.refused += 1
            return False
        self.waiting.pop(client, None)
        for window in others:
            window.overlap += 1
        self.open[client] = _Window(now, len(others))
        self.owners[client] = owner
        return True

    def close(self, client: str) -> None:
        self.open.pop(client, None)
        self.owners.pop(client, None)

    def drop_owner(self, owner: str) -> None:
        """Close every window of replica `owner` (it failed; a restarted one opens anew)."""
        for client in [c for c, o in self.owners.items() if o == owner]:
            self.close(client)
            self.waiting.pop(client, None)
