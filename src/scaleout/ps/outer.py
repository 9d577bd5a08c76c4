"""DiLoCo's outer optimizer on the shards, for pushes that arrive one replica at a time.

Synchronous DiLoCo steps SGD with Nesterov momentum once per round, on the mean of the R
replicas' pseudo-gradients: m <- beta * m + g_mean; w <- w - lr * (g_mean + beta * m).
Asynchronously each replica's pseudo-gradient arrives alone (already divided by R, so a
round's pushes sum to the mean). Stepping Nesterov on each would apply the momentum R times a
round, each time on a partial and stale direction, which diverges. `DelayedNesterov` (the
"delayed Nesterov" of Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling") applies each push's own part at once, w <- w - lr * g, and the momentum once every
`delay` pushes, on their sum: m <- beta * m + sum; w <- w - lr * beta * m. A round of R equal
pushes then moves w exactly as one synchronous step; with delay 1 it is torch's Nesterov
SGD. Element-wise, so S shards stepping their slices equal one optimizer over the whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch


class DelayedNesterov(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.7,
        momentum: float = 0.9,
        delay: int = 1,
    ) -> None:
        if lr <= 0 or not 0 <= momentum < 1 or delay < 1:
            raise ValueError(
                f"DelayedNesterov: lr > 0, 0 <= momentum < 1, delay >= 1; got {lr}, "
                f"{momentum}, {delay}"
            )
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        assert closure is None, "DelayedNesterov takes no closure"
        for group in self.param_groups:
            lr, beta, delay = group["lr"], group["momentum"], group["delay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["pending"] = torch.zeros_like(p)  # the pushes since the last
                state["step"] += 1
                p.add_(p.grad, alpha=-lr)
                state["pending"].add_(p.grad)
                if int(state["step"]) % delay == 0:
                    buf = state["momentum_buffer"]
                    buf.mul_(beta).add_(state["pending"])
                    p.add_(buf, alpha=-lr * beta)
                    state["pending"].zero_()
        return None

    @torch.no_grad()
    def set_delay(self, delay: int) -> None:
        """Apply the momentum once every `delay` pushes from now on (the replica count
        changed): the round in progress closes now, its momentum applied on what it holds,
        and the next round starts with the next push."""
        if delay < 1:
            raise ValueError(f"DelayedNesterov: delay >= 1; got {delay}")
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    continue
                if int(state["step"]) % group["delay"]:
                    buf = state["momentum_buffer"]
                    buf.mul_(beta).add_(state["pending"])
                    p.add_(buf, alpha=-lr * beta)
                    state["pending"].zero_()
                state["step"].zero_()
            group["delay"] = delay


def outer_optimizer(
    kind: str, lr: float, momentum: float, delay: int
) -> Callable[[Iterable[Any]], torch.optim.Optimizer]:
    """The factory of DiLoCo's outer optimizer (picklable: shards are Ray actors):
    "nesterov" (delayed by `delay` pushes, the replicas' count) or "sgd" (plain)."""
    if kind == "sgd":
        return functools.partial(torch.optim.SGD, lr=lr)
    if kind == "nesterov":
        return functools.partial(DelayedNesterov, lr=lr, momentum=momentum, delay=delay)
    raise ValueError(f"outer optimizer {kind!r}: use 'nesterov' or 'sgd'")
