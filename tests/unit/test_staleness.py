"""Staleness rules on a shard against hand-computed updates, and the window gate's bound
against a simulation of every interleaving it allows."""

import random

import numpy as np
import pytest
import torch

from scaleout.nn.optim import OptimizerSpec
from scaleout.ps import ParameterShard, Wire
from scaleout.ps.staleness import GAP_BETA, StalenessPolicy, Windows

LR = 0.1
W0 = np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)


def shard(rule: str, **options) -> ParameterShard:
    policy = StalenessPolicy(rule, **options)
    s = ParameterShard(0, 4, OptimizerSpec("sgd", lr=LR, warmup_steps=0), staleness=policy)
    s.initialize(W0)
    return s


def push(s: ParameterShard, grad, base: int) -> tuple[int, int, float]:
    return s.push(Wire().encode(torch.tensor(grad, dtype=torch.float32)), base)


G1 = np.array([0.5, 1.0, -1.5, 2.0], dtype=np.float32)
G2 = np.array([1.0, -0.5, 2.0, 0.25], dtype=np.float32)
G3 = np.array([0.25, 0.75, -1.0, 1.0], dtype=np.float32)


def test_none_applies_stale_pushes_as_they_are():
    s = shard("none")
    push(s, G1, 0)
    assert push(s, G2, 0) == (2, 1, 1.0)
    np.testing.assert_allclose(s.values(), W0 - LR * G1 - LR * G2, rtol=1e-6)


def test_inverse_divides_the_step_by_the_staleness():
    s = shard("inverse")
    push(s, G1, 0)
    push(s, G2, 1)  # fresh: the whole step
    assert push(s, G3, 0) == (3, 2, 0.5)  # two updates old: half of it
    expected = W0 - LR * G1 - LR * G2 - LR / 2 * G3
    np.testing.assert_allclose(s.values(), expected, rtol=1e-6)
    push(s, G1, 3)  # the rate is back for a fresh push
    np.testing.assert_allclose(s.values(), expected - LR * G1, rtol=1e-6)


def test_dc_compensates_the_gradient_by_the_distance_moved():
    lam = 0.5
    s = shard("dc", dc_lambda=lam)
    push(s, G1, 0)
    w1 = W0 - LR * G1
    push(s, G2, 0)  # computed at w0, applied at w1
    w2 = w1 - LR * (G2 + lam * G2 * G2 * (w1 - W0))
    np.testing.assert_allclose(s.values(), w2, rtol=1e-6)
    push(s, G3, 1)  # computed at w1, applied at w2
    w3 = w2 - LR * (G3 + lam * G3 * G3 * (w2 - w1))
    np.testing.assert_allclose(s.values(), w3, rtol=1e-6)


def test_gap_divides_the_gradient_by_the_gap_in_mean_steps():
    s = shard("gap")
    push(s, G1, 0)
    w1 = W0 - LR * G1
    push(s, G2, 1)
    w2 = w1 - LR * G2
    _, staleness, scale = push(s, G3, 0)  # computed at w0, two updates ago
    steps = [np.abs(w1 - W0), np.abs(w2 - w1)]
    mean = ((1 - GAP_BETA) * GAP_BETA * steps[0] + (1 - GAP_BETA) * steps[1]) / (1 - GAP_BETA**2)
    penalty = np.maximum(1.0, np.abs(w2 - W0) / mean)
    np.testing.assert_allclose(s.values(), w2 - LR * G3 / penalty, rtol=1e-5)
    assert staleness == 2 and (penalty > 1).any()
    assert scale == pytest.approx(float(np.mean(1 / penalty)), rel=1e-5)


def test_rules_state_survives_a_checkpoint_and_a_backup(tmp_path):
    """A shard restored from its state compensates the next stale push as the original."""
    spec = OptimizerSpec("sgd", lr=LR, warmup_steps=0)
    policy = StalenessPolicy("dc", dc_lambda=0.5)
    original = ParameterShard(0, 4, spec, checkpoint_dir=str(tmp_path), staleness=policy)
    original.initialize(W0)
    push(original, G1, 0)
    original.checkpoint()
    restored = ParameterShard(0, 4, spec, checkpoint_dir=str(tmp_path), staleness=policy)
    for s in (original, restored):
        push(s, G2, 0)
    np.testing.assert_array_equal(original.values(), restored.values())


def test_a_push_staler_than_the_history_is_compensated_from_the_oldest_kept():
    s = shard("dc", dc_lambda=0.5, history=2)
    for k in range(4):
        push(s, G1, k)
    before = s.values().copy()
    push(s, G2, 0)
    assert s.info()["rule_clamped"] == 1
    assert np.isfinite(s.values()).all() and not np.array_equal(s.values(), before)


def test_a_window_waits_for_the_one_it_would_make_too_stale():
    gate = Windows(bound=1, expire_s=60)
    assert gate.try_open("a") and gate.try_open("b")
    gate.close("a")
    assert not gate.try_open("a")  # b's push would find two updates after its fetch
    gate.close("b")
    assert gate.try_open("a")


def test_windows_open_first_come_first_served():
    """A fast replica that closes and asks again at once does not starve one refused
    before it."""
    gate = Windows(bound=0, expire_s=60)
    assert gate.try_open("fast", now=0.0)
    assert not gate.try_open("slow", now=0.01)
    gate.close("fast")
    assert not gate.try_open("fast", now=0.02)  # the slow one asked first
    assert gate.try_open("slow", now=0.03)


def test_a_failed_replicas_windows_are_dropped():
    gate = Windows(bound=0, expire_s=60)
    assert gate.try_open("a", owner="replica0")
    assert not gate.try_open("b", owner="replica1")
    gate.drop_owner("replica0")
    assert gate.try_open("b", owner="replica1")


@pytest.mark.parametrize("bound", [0, 1, 2, 4])
@pytest.mark.parametrize("replicas", [2, 3, 5])
def test_no_push_lands_beyond_the_bound_in_any_interleaving(bound, replicas):
    """Random interleavings of replicas that open, fetch, push and close: the staleness a
    shard would measure (updates since the fetch) never exceeds the bound, and every
    replica keeps making progress."""
    rng = random.Random(bound * 10 + replicas)
    gate = Windows(bound=bound, expire_s=60)
    version = 0
    fetched: dict[int, int | None] = dict.fromkeys(range(replicas))
    pushes = [0] * replicas
    worst = 0
    for _ in range(4000):
        r = rng.randrange(replicas)
        if fetched[r] is None:
            if gate.try_open(str(r)):
                fetched[r] = version
        else:
            worst = max(worst, version - fetched[r])
            version += 1
            pushes[r] += 1
            fetched[r] = None
            gate.close(str(r))
    assert worst <= bound
    assert min(pushes) > 0
