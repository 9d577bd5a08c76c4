"""The simulator's Downpour modes: DiLoCo's bytes and steps against a real run's counters and
closed forms, and the staleness bound's gate against the bound."""

import math

import pytest

from scaleout.api import config_from_dict
from scaleout.compress.payload import payload_size
from scaleout.ps.layout import shard_ranges
from scaleout.sim.downpour import DownpourSim
from scaleout.sim.engine import Link
from scaleout.sim.setting import Setting
from tests.unit.test_sim_downpour import NUM_PARAMETERS, calibration, config


def with_downpour(cfg, **keys):
    """`cfg` with these `[downpour]` keys (mode, max_staleness, timeout_s, ...)."""
    raw = cfg.model_dump(mode="json")
    raw["downpour"].update(keys)
    return config_from_dict(raw)


def simulate(cfg, machines=1, **kwargs):
    cal = calibration(cfg, **kwargs)
    cal.apply_ns["momentum"] = 3.0  # the outer step, dearer than adagrad's 2.0 here
    return DownpourSim(cfg, Setting(cal, machines=machines, link=Link(125e6, 50e-6))).run()


def per_example(result, kind):
    return result.bytes_by_kind[kind] / (result.steps * 64)


def test_diloco_sends_one_push_and_one_fetch_per_h_steps():
    """DiLoCo with H = 4 inner steps: a push and a fetch of a gradient's size every 4 steps,
    so 1/4 of the bytes per example of gradients mode at n_fetch = n_push = 1."""
    h, steps = 4, 40
    gradients = simulate(config(num_shards=2, steps=steps, codec="dynamic8"))
    cfg = config(num_shards=2, steps=steps, codec="dynamic8", n_fetch=h, n_push=h)
    diloco = simulate(with_downpour(cfg, mode="diloco"))
    assert diloco.extra["mode"] == "diloco" and gradients.extra["mode"] == "gradients"
    assert diloco.extra["pushes"] == diloco.extra["pulls"] == steps // h
    for kind in ("push", "pull"):
        assert per_example(diloco, kind) == pytest.approx(per_example(gradients, kind) / h)
    ranges = shard_ranges(NUM_PARAMETERS, 2)
    push = sum(payload_size("dynamic8", (b - a,), 0) for a, b in ranges)
    assert diloco.bytes_by_kind["push"] == steps // h * push
    assert diloco.bytes_by_kind["pull"] == steps // h * 4 * NUM_PARAMETERS


def test_diloco_prices_the_inner_steps_and_the_outer_one():
    """One replica, one shard, H = 1 against gradients mode: each step also runs adagrad on
    the whole model on the replica's machine, copies the fetched parameters aside and
    computes the pseudo-gradient (a copy each); each update on the shard steps momentum SGD
    (3 ns a value) instead of adagrad (2 ns), on the path of every fetch but the first (the
    last update hides behind the chunk's answer, as in the closed form of gradients mode)."""
    cfg = config(steps=20)
    cal = calibration(cfg)
    gradients = simulate(cfg)
    diloco = simulate(with_downpour(cfg, mode="diloco"))
    inner = cal.apply_s("adagrad", NUM_PARAMETERS)
    copy = 4 * NUM_PARAMETERS / cal.flatten_bytes_per_s
    outer = (3.0 - 2.0) * 1e-9 * NUM_PARAMETERS
    expected = 20 * (inner + 2 * copy) + 19 * outer
    assert diloco.run_s - gradients.run_s == pytest.approx(expected, rel=1e-9)
    assert diloco.extra["replica_step_s"]["compute"] == pytest.approx(0.010 + inner)


def _staleness_run(bound, replicas=4, steps=160, machines=1, **keys):
    cfg = config(num_replicas=replicas, steps=steps)
    cfg = with_downpour(cfg, max_staleness=bound, **keys)
    return simulate(cfg, machines=machines)


def test_the_bound_holds_every_simulated_push_within_it():
    """Four replicas pushing every step on one machine: their pushes land up to 3 updates
    after their fetch; with max_staleness 1 none lands more than 1 after, the replicas wait
    at shard 0's gate for it (reported per push window and per step) and the run is slower;
    with 0 every push is fresh."""
    free, bounded, strict = _staleness_run(None), _staleness_run(1), _staleness_run(0)
    assert free.extra["staleness_max"] == 3
    assert "windows_refused" not in free.extra
    assert bounded.extra["staleness_max"] <= 1 and strict.extra["staleness_max"] == 0
    for result in (bounded, strict):
        assert result.extra["max_staleness"] in (0, 1)
        assert result.extra["windows_refused"] > 0 and result.extra["windows_expired"] == 0
        assert result.extra["wait_s_mean"] > 0 and result.extra["replica_step_s"]["wait"] > 0
        assert result.extra["pushes"] == free.extra["pushes"] == 160
        assert result.run_s > free.run_s
    assert strict.extra["wait_s_mean"] > bounded.extra["wait_s_mean"]
    # DiLoCo under the bound: windows of H inner steps, no push beyond it either
    cfg = with_downpour(config(num_replicas=4, steps=160, n_fetch=4, n_push=4), mode="diloco")
    assert simulate(cfg).extra["staleness_max"] > 1
    diloco = simulate(with_downpour(cfg, max_staleness=1))
    assert diloco.extra["staleness_max"] <= 1 and diloco.extra["windows_refused"] > 0


def test_the_bound_holds_with_represented_replicas(monkeypatch):
    """128 machines through 16 representatives of 8: a simulated update counts 8 of the
    run's, so the gate bounds simulated windows by floor(16 / 8) and the pushes' staleness
    in the run's updates stays within 16, where without the bound it does not."""
    import scaleout.sim.downpour as downpour

    monkeypatch.setattr(downpour, "REPRESENTED", 16)
    free = _staleness_run(None, replicas=1, steps=128 * 20, machines=128)
    bounded = _staleness_run(16, replicas=1, steps=128 * 20, machines=128)
    assert free.extra["simulated_replicas"] == bounded.extra["simulated_replicas"] == 16
    assert free.extra["staleness_max"] > 16
    assert bounded.extra["staleness_max"] <= 16 and bounded.extra["windows_refused"] > 0


def test_a_window_open_at_a_chunks_end_is_pushed_and_holds_no_other_replica(monkeypatch):
    """n_push 3 across chunks that 3 does not divide: at each chunk's end a replica pushes
    the window it holds (`ReplicaClient.release`, a whole push's bytes), so no replica idles
    holding one: no window expires, no replica waits its timeout at the gate, the bound
    holds, and each chunk of c steps makes ceil(c / 3) pushes, as the library's client does."""
    chunks: list[int] = []
    chunk = DownpourSim._chunk

    def recorded(self, replica, steps):
        chunks.append(steps)
        return chunk(self, replica, steps)

    monkeypatch.setattr(DownpourSim, "_chunk", recorded)
    run = _staleness_run(0, replicas=2, steps=100, n_fetch=3, n_push=3, timeout_s=5.0)
    assert sum(chunks) == 100 and any(steps % 3 for steps in chunks)
    assert run.extra["windows_expired"] == 0
    assert run.extra["wait_s_max"] < 5.0 and run.run_s < 5.0
    assert run.extra["staleness_max"] == 0
    assert run.extra["pushes"] == sum(math.ceil(steps / 3) for steps in chunks) > 100 // 3
    assert run.bytes_by_kind["push"] == run.extra["pushes"] * 4 * NUM_PARAMETERS
