"""L-BFGS written as commands on vectors that live elsewhere (DistBelief's Sandblaster).

The coordinator that runs this keeps only scalars: the history's rho_k = 1 / (s_k . y_k),
the ring's bookkeeping and the objective. Every vector — x, g, the direction d, q, the
pairs s_k / y_k — lives in a `VectorSpace`: the parameter-server shards (`ShardedVectors`),
or one local `VectorShard` (`LocalVectors`, the single-process reference). A command
travels to every shard and each answers with a partial scalar; dot products are summed.

Two-loop recursion (Nocedal & Wright, alg. 7.4) with the initial scaling
gamma = s'y / y'y of the newest pair, and a line search that satisfies the weak Wolfe
conditions by bisection (Lewis & Overton): Armijo with c1 = 1e-4 keeps the objective
decreasing at every iterate, the curvature condition with c2 = 0.9 keeps s'y > 0 so the
history stays positive definite. Each trial point is one objective-and-gradient evaluation
over the whole batch, the expensive step that replicas share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import ray

from scaleout.ps.vectors import Command, VectorShard

C1, C2 = 1e-4, 0.9


class VectorSpace(Protocol):
    def run(self, commands: list[Command]) -> list[float | None]: ...


def _reduce(op: str, partials: list[float | None]) -> float | None:
    if partials[0] is None:
        return None
    return max(partials) if op == "max_abs" else sum(partials)  # type: ignore[arg-type]


class ShardedVectors:
    """Commands sent to every shard at once; partial scalars summed (max for max_abs)."""

    def __init__(self, shards: list[Any]) -> None:
        self.shards = shards

    def run(self, commands: list[Command]) -> list[float | None]:
        per_shard = ray.get([shard.execute.remote(commands) for shard in self.shards])
        return [_reduce(c[0], [p[i] for p in per_shard]) for i, c in enumerate(commands)]


class LocalVectors:
    """The same commands on one in-process shard holding whole vectors."""

    def __init__(self, shard: VectorShard) -> None:
        self.shard = shard

    def run(self, commands: list[Command]) -> list[float | None]:
        return self.shard.execute(commands)


@dataclass
class LbfgsState:
    """Everything the coordinator knows: scalars only (checkpointed on the shards)."""

    history: int
    iteration: int = 0
    num_pairs: int = 0
    newest: int = -1  # ring slot of the newest (s, y) pair
    rho: list[float] = field(default_factory=list)
    gamma: float = 1.0  # s'y / y'y of the newest pair
    f: float | None = None
    evaluations: int = 0
    done: str | None = None  # why it stopped

    def __post_init__(self) -> None:
        self.rho = self.rho or [0.0] * self.history

    def slots_newest_first(self) -> list[int]:
        return [(self.newest - i) % self.history for i in range(self.num_pairs)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def two_loop(space: VectorSpace, state: LbfgsState) -> float:
    """d = -H g from the history on the shards; return g . d."""
    alphas: dict[int, float] = {}
    pending: list[Command] = [("copy", "g", "q")]
    for slot in state.slots_newest_first():
        (dot,) = space.run([*pending, ("dot", f"s{slot}", "q")])[-1:]
        alphas[slot] = state.rho[slot] * dot
        pending = [("axpy", -alphas[slot], f"y{slot}", "q")]
    pending.append(("scale", state.gamma if state.num_pairs else 1.0, "q"))
    for slot in reversed(state.slots_newest_first()):
        (dot,) = space.run([*pending, ("dot", f"y{slot}", "q")])[-1:]
        beta = state.rho[slot] * dot
        pending = [("axpy", alphas[slot] - beta, f"s{slot}", "q")]
    results = space.run([*pending, ("copy", "q", "d"), ("scale", -1.0, "d"), ("dot", "g", "d")])
    return results[-1]  # type: ignore[return-value]


def lbfgs(
    space: VectorSpace,
    evaluate: Callable[[], float],
    state: LbfgsState,
    max_iterations: int,
    tolerance_grad: float,
    tolerance_change: float,
    max_line_search: int,
    after_iteration: Callable[[LbfgsState, float], None] | None = None,
) -> LbfgsState:
    """Minimise: `evaluate()` computes f at the shards' x and leaves the gradient in g."""
    if state.f is None:
        state.f = evaluate()
        state.evaluations += 1
    while state.iteration < max_iterations:
        (max_grad,) = space.run([("max_abs", "g")])
        if max_grad <= tolerance_grad:
            state.done = f"max |g| = {max_grad:.3g} <= tolerance_grad"
            return state
        slope = two_loop(space, state)
        if slope >= 0:  # not a descent direction: forget the history, go down the gradient
            state.num_pairs = 0
            slope = two_loop(space, state)
        if state.iteration == 0 and state.num_pairs == 0:
            (norm2,) = space.run([("norm2", "g")])
            step = min(1.0, 1.0 / max(norm2**0.5, 1e-12))
        else:
            step = 1.0
        space.run([("copy", "x", "x_prev"), ("copy", "g", "g_prev")])
        f_prev = state.f
        f_new, step = _line_search(space, evaluate, state, f_prev, slope, step, max_line_search)
        if f_new is None:
            space.run([("copy", "x_prev", "x"), ("copy", "g_prev", "g")])
            state.done = "the line search found no decrease"
            return state
        state.f = f_new
        sy, yy = space.run(
            [
                ("copy", "x", "s_new"),
                ("axpy", -1.0, "x_prev", "s_new"),
                ("copy", "g", "y_new"),
                ("axpy", -1.0, "g_prev", "y_new"),
                ("dot", "s_new", "y_new"),
                ("norm2", "y_new"),
            ]
        )[-2:]
        if sy > 1e-12 * max(yy, 1e-300):  # keep H positive definite
            state.newest = (state.newest + 1) % state.history
            space.run([("push_history", "s_new", "y_new", state.newest)])
            state.rho[state.newest] = 1.0 / sy
            state.gamma = sy / yy
            state.num_pairs = min(state.num_pairs + 1, state.history)
        state.iteration += 1
        if after_iteration is not None:
            after_iteration(state, step)
        if abs(f_prev - f_new) <= tolerance_change * max(abs(f_prev), abs(f_new), 1.0):
            state.done = "the objective changed less than tolerance_change"
            return state
    state.done = "max_iterations reached"
    return state


def _line_search(
    space: VectorSpace,
    evaluate: Callable[[], float],
    state: LbfgsState,
    f0: float,
    slope: float,
    step: float,
    max_evaluations: int,
) -> tuple[float | None, float]:
    """Weak Wolfe step by bisection; x and g are left at the accepted point."""
    low, high = 0.0, float("inf")
    best: tuple[float, float] | None = None
    for _ in range(max_evaluations):
        space.run([("copy", "x_prev", "x"), ("axpy", step, "d", "x")])
        f = evaluate()
        state.evaluations += 1
        if f > f0 + C1 * step * slope or f != f:
            high = step
        else:
            (new_slope,) = space.run([("dot", "g", "d")])
            best = (f, step)
            if new_slope >= C2 * slope:
                return f, step
            low = step
        step = (low + high) / 2 if high < float("inf") else 2 * low
    if best is not None:  # Armijo holds but curvature does not: take the decrease
        f, step = best
        space.run([("copy", "x_prev", "x"), ("axpy", step, "d", "x")])
        return evaluate(), step
    return None, step
