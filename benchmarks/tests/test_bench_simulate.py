"""The `simulate` suite's held-out cases stay valid configs the simulator can run."""

import os
from pathlib import Path

import pytest

from benchmarks import available_suites
from benchmarks.simulate import CASES, _configs_dir, _overrides
from scaleout.api import load_config
from scaleout.sim.simulate import simulation_for

# A calibration to price the cases with: a copy of one `scaleout calibrate` wrote, kept here
# as a fixture so that no test reads the published results/ (which a new calibration replaces).
CALIBRATION = Path(__file__).resolve().parent / "fixtures" / "calibration.json"


def test_cases_are_valid_configs_with_a_simulation(tmp_path):
    assert "simulate" in available_suites()
    assert len(CASES) >= 12 and len({case.name for case in CASES}) == len(CASES)
    for case in CASES:
        config = load_config(_configs_dir() / case.config, _overrides(case, tmp_path))
        # short runs, the small MLP's 5x longer (its steps are 8x shorter), each with two
        # evaluations and a checkpoint as a user's run has them
        small = getattr(config.model, "sizes", None) == [784, 256, 10]
        assert config.train.steps == (2000 if small else 400), case.name
        assert config.train.eval_every * 2 == config.train.steps, case.name
        assert config.train.checkpoint_every == config.train.steps, case.name
        assert simulation_for(config.train.strategy) is not None


def test_testnet_cases_are_priced_on_two_machines_over_the_measured_network(tmp_path):
    """A case with a link rate is simulated on two machines of this box (one replica and one
    shard each) over the link set into its calibration, never over a named one, and its
    calls across the link cost what was measured beyond the same calls on one host."""

    from benchmarks.simulate import simulate_case
    from scaleout.sim.calibration import LinkCost, MessageCost

    calibration = CALIBRATION
    case = next(c for c in CASES if c.link == "100mbit" and "8-bit" not in c.name)

    def simulated(rate, across_s=None):
        network = {"link": LinkCost(bytes_per_s=rate)}
        if across_s is not None:
            cost = MessageCost(fixed_s=across_s, bytes_per_s=1e12)
            network.update(pull_across=cost, push_across=cost)
        return simulate_case(case, tmp_path, calibration, {"100mbit": network})

    rows = {rate: simulated(rate) for rate in (12.5e6, 2e6)}
    for row in rows.values():
        assert row["machines"] == 2 and row["link"] == "calibrated"
        assert row["wire_bytes"] > 0 and row["local_bytes"] > 0  # a replica beside a shard
    # the same bytes cross the link; at 2 MB/s they take 6x as long
    assert rows[2e6]["wire_bytes"] == rows[12.5e6]["wire_bytes"]
    assert rows[2e6]["examples_per_s"] < 0.5 * rows[12.5e6]["examples_per_s"]
    # 200 ms more per call across the link: fewer examples/s, the same bytes
    slower = simulated(12.5e6, across_s=0.2)
    assert slower["examples_per_s"] < 0.8 * rows[12.5e6]["examples_per_s"]
    assert slower["wire_bytes"] == rows[12.5e6]["wire_bytes"]


def test_a_testnet_run_placed_unlike_the_simulation_is_run_again(monkeypatch, tmp_path):
    """Ray's spreading now and then puts both shards on one host: such a run does not count;
    after `ATTEMPTS` of them the case fails, naming the placement."""
    import json

    import pytest

    from benchmarks import simulate_testnet

    hosts = ["10.0.0.1", "10.0.0.2"]
    apart = {"replicas": hosts[::-1], "shards": hosts}
    together = {"replicas": hosts, "shards": [hosts[1], hosts[1]]}
    placements = [together, apart]
    monkeypatch.setattr(simulate_testnet, "_run", lambda *args: (placements.pop(0), hosts))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"examples": 6400, "time_s": 3.2}) + "\n")
    assert simulate_testnet.measured(tmp_path, [], "1gbit", tmp_path) == 2000
    assert placements == []  # the first run was placed unlike the simulation: run again
    monkeypatch.setattr(simulate_testnet, "_run", lambda *args: (together, hosts))
    with pytest.raises(RuntimeError, match="none with one replica and one shard"):
        simulate_testnet.measured(tmp_path, [], "1gbit", tmp_path)


def test_each_case_is_priced_by_what_its_strategy_uses_measured_again(monkeypatch, tmp_path):
    """Around a case's runs the suite measures again its model's compute and the calls and
    codecs its strategy uses, and keeps the rest of the calibration."""
    import contextlib

    import torch

    import scaleout.runtime
    from scaleout.sim import calibrate as cal_module
    from scaleout.sim.calibration import Calibration, CodecCost, LockstepCost, MessageCost
    from scaleout.sim.measure_beside import BesideCalls
    from scaleout.sim.measuring import model_key

    start = Calibration.load(CALIBRATION)
    fresh: dict = {
        name: MessageCost(fixed_s=i + 1.0, bytes_per_s=1e6) for i, name in enumerate("abcde")
    }
    fresh["f"] = LockstepCost(measured_bytes=[1], gaps_s=[1e-3, 1e-2], extra_s=[[1e-3, 2e-3]])
    measured: list[str] = []

    def measure(name, value):
        def fake(*args, **kwargs):
            measured.append(name)
            return value(*args, **kwargs)

        return fake

    def model(config, cores):
        known = start.models.get(model_key(config), next(iter(start.models.values())))
        return known.model_copy(update={"eval_s": 1.0})

    codec = CodecCost(sizes=[1, 2], encode_ns=[7.0, 7.0], decode_ns=[7.0, 7.0])
    fakes = {
        "measure_model": model,
        "measure_codecs": lambda names: {name: codec for name in names},
        "measure_apply": lambda: {"sgd": 9.0, "adagrad": 12.0},
        "measure_allreduce": lambda sizes: fresh["a"],
        "measure_average": lambda sizes: fresh["b"],
        "measure_exchange": lambda: fresh["c"],
        "measure_shard_messages": lambda apply_ns, sizes: (fresh["d"], fresh["e"], 0.5),
        "measure_collect": lambda: (2e-4, 5e-5),
        "measure_zero": lambda: 3e10,
        # the step 2.5x as long beside the calls with a core idle, 3x with every core busy
        "measure_beside_calls": lambda config, numel, other_cores=0: BesideCalls(
            1.0 + numel * 1e-8, 3.0 if other_cores else 2.5, 1.0
        ),
        "measure_shard_calls_after_compute": lambda sizes: fresh["f"],
    }
    threads_seen = {}

    def at_threads(name, fake):
        def call(*args):
            threads_seen[name] = torch.get_num_threads()
            return fake(*args)

        return call

    for name in ("measure_shard_messages", "measure_collect"):
        fakes[name] = at_threads(name, fakes[name])
    for name, fake in fakes.items():
        monkeypatch.setattr(cal_module, name, measure(name, fake))
    monkeypatch.setattr(scaleout.runtime, "session", lambda **_: contextlib.nullcontext())

    def case(name):
        found = next(c for c in CASES if c.name == name)
        return load_config(_configs_dir() / found.config, _overrides(found, tmp_path))

    downpour = cal_module.recalibrate(start, [case("downpour 2x2, 8-bit pushes")])
    assert sorted(measured) == sorted(
        [
            "measure_model",
            "measure_codecs",
            "measure_apply",
            "measure_shard_messages",
            "measure_collect",
            "measure_zero",
            *["measure_beside_calls"] * (2 if (os.cpu_count() or 1) >= 2 else 1),
            "measure_shard_calls_after_compute",
        ]
    )
    assert (downpour.pull, downpour.push) == (fresh["d"], fresh["e"])
    # the calls as a replica of one thread makes them, as `calibrate` measures them
    assert threads_seen == {"measure_shard_messages": 1, "measure_collect": 1}
    assert (downpour.collect_s, downpour.collect_shard_s) == (2e-4, 5e-5)
    assert downpour.zero_bytes_per_s == 3e10
    assert downpour.apply_ns == {"sgd": 9.0, "adagrad": 12.0} and downpour.idle_cores == 0.5
    assert downpour.codecs["dynamic8"] == codec
    assert downpour.allreduce == start.allreduce and downpour.exchange == start.exchange
    assert all(m.eval_s == 1.0 for k, m in downpour.models.items() if k.startswith("mnist"))
    # a replica's step beside calls of the config's largest shard slice (2 of 1,863,690)
    (beside,) = {m.beside_calls for k, m in downpour.models.items() if k.startswith("mnist")}
    assert beside == pytest.approx(1.0 + 931_845e-8)
    # a step 2.5x as long beside the calls as alone needs a wait per call beyond sharing
    (wait,) = {m.call_wait_s for k, m in downpour.models.items() if k.startswith("mnist")}
    assert wait > 0
    # measured again with the other cores computing (on a box of 2 or more), its own wait
    (busy,) = {m.call_wait_busy_s for k, m in downpour.models.items() if k.startswith("mnist")}
    if (os.cpu_count() or 1) >= 2:
        assert measured.count("measure_beside_calls") == 2 and busy is not None and busy > 0
    else:
        assert measured.count("measure_beside_calls") == 1 and busy is None
    assert downpour.lockstep["shard_calls"] == fresh["f"]
    assert downpour.lockstep["allreduce"] == start.lockstep["allreduce"]  # kept

    measured.clear()
    sync = cal_module.recalibrate(start, [case("sync 2 workers, average mode")])
    assert sorted(measured) == ["measure_allreduce", "measure_average", "measure_model"]
    assert (sync.allreduce, sync.average) == (fresh["a"], fresh["b"])
    assert (sync.pull, sync.codecs, sync.apply_ns) == (start.pull, start.codecs, start.apply_ns)

    measured.clear()
    grid = cal_module.recalibrate(start, [case("model parallel, 1 x 2 grid")])
    assert sorted(measured) == ["measure_exchange", "measure_model"]
    assert grid.exchange == fresh["c"] and grid.pull == start.pull
    assert start.pull != fresh["d"] and start.allreduce != fresh["a"]  # the start's, untouched


def test_cases_of_one_model_and_strategy_share_their_measurements(tmp_path):
    from benchmarks.simulate import _measuring_key

    keys = {
        case.name: _measuring_key(
            load_config(_configs_dir() / case.config, _overrides(case, tmp_path))
        )
        for case in CASES
    }
    assert keys["downpour 2 replicas, 2 shards"] == keys["downpour 2x2, n_fetch = n_push = 1"]
    assert keys["downpour 2x2, 784-256-10 MLP"] != keys["downpour 2 replicas, 2 shards"]
    assert keys["downpour 2x2, 784-256-10 MLP"] != keys["sync 2 workers, 784-256-10 MLP"]
    assert keys["sync 1 worker"] == keys["sync 2 workers, average mode"]


def test_a_case_row_is_the_mean_prediction_against_the_measured_median():
    from benchmarks.simulate import Outcome, summary_rows

    case = CASES[0]
    hit = Outcome(case, measured=[90.0, 100.0, 120.0], around=[105.0, 115.0], at_start=95.0)
    assert hit.simulated == 110.0 and abs(hit.error() - 10.0) < 1e-9
    assert abs(hit.error(hit.at_start) + 5.0) < 1e-9
    assert hit.row().value == hit.error() and "(spread 30%)" in hit.row().name
    miss = Outcome(case, measured=[200.0] * 3, around=[150.0, 150.0], at_start=200.0)
    mean, worst, at_start = summary_rows([hit, miss])
    assert [mean.value, worst.value, at_start.value] == pytest.approx([17.5, 25.0, 2.5])
    assert (mean.meets, worst.meets) == (False, False)


def test_a_case_note_names_the_costs_its_prediction_leans_on(tmp_path):
    """The step, two processes' slow-down and the strategy's call at the case's own message
    size (a quarter of the 1,863,690-value MLP per shard with 4 shards; the whole model for
    sync's all-reduce), as the calibration prices them."""
    from benchmarks.simulate import Outcome, _costs
    from scaleout.sim.calibration import Calibration, LockstepCost
    from scaleout.sim.measuring import model_key

    path = CALIBRATION
    cal = Calibration.load(path)
    by_name = {case.name: case for case in CASES}
    case = by_name["downpour 2 replicas, 4 shards"]
    note = _costs(path, load_config(_configs_dir() / case.config, _overrides(case, tmp_path)))
    slice_bytes = 4 * -(-1_863_690 // 4)
    assert f"pull {cal.pull.seconds(slice_bytes) * 1e3:.2f} ms" in note
    assert f"push {cal.push.seconds(slice_bytes) * 1e3:.2f} ms" in note
    assert note.startswith("step ") and note.endswith(f"at {slice_bytes / 1e6:.2f} MB")
    # with a replica's calls after compute measured: what a pull and a push cost more
    shard_calls = LockstepCost(
        measured_bytes=[1, 10**9], gaps_s=[1e-3, 1e-2], extra_s=[[1e-3] * 2] * 2
    )
    shard_calls.extra_core_s = [[2e-3] * 2] * 2
    shard_calls.hop_wait_s = [1.5e-3, 1.5e-3]
    shard_calls = LockstepCost.model_validate(shard_calls.model_dump())
    woken = cal.model_copy(update={"lockstep": {**cal.lockstep, "shard_calls": shard_calls}})
    config = load_config(_configs_dir() / case.config, _overrides(case, tmp_path))
    note = _costs(woken.save(tmp_path / "woken.json"), config)
    assert "beside calls 1.000x and 0.00 ms a call," in note
    key = model_key(config)  # its step's loss to a call measured with every core computing
    busy = woken.models[key].model_copy(update={"call_wait_s": 2e-4, "call_wait_busy_s": 1e-3})
    busy_cal = woken.model_copy(update={"models": {**woken.models, key: busy}})
    busy_note = _costs(busy_cal.save(tmp_path / "busy.json"), config)
    assert "and 0.20 ms a call (1.00 ms with every core computing), +1.00 ms" in busy_note
    assert note.endswith(
        ", +1.00 ms / 2.00 core-ms a pair after 5 ms of compute, 1.50 ms a call on busy cores"
    )
    case = by_name["sync 2 workers"]
    note = _costs(path, load_config(_configs_dir() / case.config, _overrides(case, tmp_path)))
    assert cal.allreduce is not None
    assert f"all-reduce {cal.allreduce.seconds(4 * 1_863_690) * 1e3:.2f} ms" in note
    extra = cal.lockstep["allreduce"].extra(0.005, 4 * 1_863_690)
    assert note.endswith(f", +{extra * 1e3:.2f} ms after 5 ms of compute")
    case = by_name["model parallel, 1 x 2 grid"]
    config = load_config(_configs_dir() / case.config, _overrides(case, tmp_path))
    models = {model_key(config): next(iter(cal.models.values())), **cal.models}  # any model
    note = _costs(cal.model_copy(update={"models": models}).save(tmp_path / "c.json"), config)
    assert cal.exchange is not None
    assert f"exchange {cal.exchange.seconds(1 << 20) * 1e3:.2f} ms" in note
    extra = cal.lockstep["exchange"].extra(0.005, 1 << 20)
    assert note.endswith(f"at 1.05 MB, +{extra * 1e3:.2f} ms after 5 ms of compute")
    outcome = Outcome(case, [1.0] * 3, [1.0, 1.0], 1.0, ["s", "b", "a"])
    assert outcome.note().endswith("; start: s; before: b; after: a")


def test_a_case_that_cannot_run_is_left_out_and_the_others_count(monkeypatch, tmp_path):
    """An hour's suite does not end at one case's failure (a testnet run that Ray would not
    place as simulated, say): the case is named in the notes and the others are scored."""

    from benchmarks import simulate as suite
    from scaleout.sim import calibrate as cal_module
    from scaleout.sim.calibration import Calibration

    start = Calibration.load(CALIBRATION)
    saved = start.save(tmp_path / "calibration.json")
    failing = "downpour 2x2, 8-bit pushes"

    def measured(case, root):
        if case.name == failing:
            raise RuntimeError("4 runs on testnet hosts, none with one replica and one shard")
        return 100.0

    monkeypatch.setattr(cal_module, "calibrate", lambda configs, say: start)
    monkeypatch.setattr(suite.simulate_testnet, "available", lambda: "no testnet here")
    monkeypatch.setattr(suite, "_remeasured", lambda calibration, configs, path: saved)
    monkeypatch.setattr(suite, "_measured", measured)
    monkeypatch.setattr(suite, "simulate_case", lambda *args: {"examples_per_s": 110.0})
    monkeypatch.setattr(suite, "_costs", lambda path, config: "costs")
    monkeypatch.setattr(suite, "KEPT_INPUTS", tmp_path / "kept")
    result = suite.run()
    local = [case for case in CASES if case.link is None]
    scored = [row for row in result.rows if row.name.startswith(("downpour", "sync", "model"))]
    assert len(scored) == len(local) - 1 and not any(failing in row.name for row in scored)
    assert all(row.value == pytest.approx(10.0) for row in scored)  # 110 against 100
    assert any(note.startswith(f"{failing}: left out, 4 runs") for note in result.notes)


@pytest.mark.slow
def test_collecting_a_push_is_measured_through_a_real_client(ray_session):
    """`measure_collect` drives a real `ReplicaClient`: a few hundred microseconds a push
    on this machine, none of it waiting for the shards (they applied the push first)."""
    from scaleout.sim.measure_calls import measure_collect

    fixed, per_shard = measure_collect(numel=4096, pushes=20, warmup=3)
    assert fixed >= 0 and per_shard >= 0
    assert 0 < fixed + 4 * per_shard < 0.02


@pytest.mark.slow
def test_a_step_beside_a_shards_calls_is_measured_against_the_step_alone(ray_session):
    """`measure_beside_calls` steps a real model in another process while this one pulls
    from and pushes to a real shard: at least 1, and not a multiple."""
    from scaleout.sim.measure_beside import measure_beside_calls

    config = load_config(
        _configs_dir() / "mnist_downpour.toml",
        ["model.sizes=[784,64,10]", "model.dropout=[0.0,0.0]", "data.num_train=512"],
    )
    beside = measure_beside_calls(config, 25_000)
    assert 1.0 <= beside.cpu_ratio < 1.5
    assert 0.8 < beside.wall_ratio < 3.0 and beside.pairs_per_step > 0
    # with another process computing throughout: against the step beside it alone
    busy = measure_beside_calls(config, 25_000, other_cores=1)
    assert 1.0 <= busy.cpu_ratio < 1.5
    assert 0.8 < busy.wall_ratio < 4.0 and busy.pairs_per_step > 0


def test_a_calls_measurement_leaves_out_the_compute_before_each_call():
    """`measure_calls` with a `before`: 2 ms of this thread's compute ahead of each call are
    neither in the call's wall time nor in its core-seconds."""
    import time

    from scaleout.sim.measure_calls import Timed, measure_calls

    def compute() -> None:
        end = time.perf_counter() + 2e-3
        while time.perf_counter() < end:
            pass

    (cost,) = measure_calls([Timed(lambda: None, compute)], idle=0.0, min_s=0.2, warmup=0)
    assert cost.wall_s < 1e-3
    assert cost.caller_cpu_s < 1e-3  # a call's 2 ms of compute would show here


def test_other_cores_compute_only_while_asked():
    """`OtherCores(2)`: processes that keep a core busy each inside `computing()` (the
    first `count` of them with a count) and leave them idle outside; what the loaded
    shard-call measurement puts beside the pair."""
    import time

    from scaleout.sim.measure_calls import busy_cores_s
    from scaleout.sim.measuring import OtherCores

    def busy_cores(seconds: float) -> float:
        before, started = busy_cores_s(), time.perf_counter()
        time.sleep(seconds)
        after = busy_cores_s()
        if before is None or after is None:
            pytest.skip("no /proc/stat here")
        return (after - before) / (time.perf_counter() - started)

    with OtherCores(2) as others:
        quiet = busy_cores(0.5)
        with others.computing(1):
            one = busy_cores(0.5)
        with others.computing():
            both = busy_cores(0.5)
    assert 0.7 < one - quiet < 1.3  # one more core at work (the box's own load aside)
    assert both - quiet > 1.6


def test_a_calls_share_of_the_cores_beside_computing_processes():
    """`shared_wall`: a call of 10 ms keeping 1.2 cores busy beside 1 computing process on
    2 cores: demand 2.2, so 11 ms; beside none, or on cores enough, its own 10 ms."""
    from scaleout.sim.measure_calls import CallCost
    from scaleout.sim.measure_lockstep import shared_wall

    call = CallCost(wall_s=0.010, cpu_s=0.012, caller_cpu_s=0.004)
    assert shared_wall(call, 1, 2) == pytest.approx(0.011)
    assert shared_wall(call, 0, 2) == pytest.approx(0.010)
    assert shared_wall(call, 1, 8) == pytest.approx(0.010)
    no_cpu = CallCost(wall_s=0.010, cpu_s=None, caller_cpu_s=0.0)  # one core: demand 2 on 2
    assert shared_wall(no_cpu, 1, 2) == pytest.approx(0.010)


def test_a_calls_wait_for_cores_fits_the_loaded_pairs():
    """`hop_wait`: pairs that took 4 and 8 ms beyond their share beside 1 and 2 computing
    processes on 2 cores give 2 ms a call; charged by the engine to the pair's 4 calls
    beside those processes, that gives back both waits. Points off a line give the least
    squares; a pair faster than its share gives no wait, not a negative one."""
    import simpy

    from scaleout.sim.engine import Link, Machine
    from scaleout.sim.measure_lockstep import CALLS_PER_PAIR, hop_wait

    wait = hop_wait([4e-3, 8e-3], [1, 2], 2)
    assert wait == pytest.approx(2e-3)
    for computing, waited in ((1, 4e-3), (2, 8e-3)):
        env = simpy.Environment()
        machine = Machine(env, 0, 2, Link(1e9))
        for _ in range(computing):
            machine.cores.start(10.0, contended=True)

        def pair(machine=machine, hop=wait):
            for _ in range(CALLS_PER_PAIR):
                yield from machine.call(1e-3, 1e-3, hop)

        env.run(until=env.process(pair()))
        shared = CALLS_PER_PAIR * 1e-3 / min(1.0, 2 / (computing + 1))
        assert env.now - shared == pytest.approx(waited)
    # 2 * 4 + 4 * 10 over 2^2 + 4^2
    assert hop_wait([4e-3, 10e-3], [1, 2], 2) == pytest.approx(48e-3 / 20)
    assert hop_wait([-1e-3, -2e-3], [1, 2], 2) == 0.0


def test_a_disturbed_round_does_not_set_a_calls_price():
    """`measure_calls`: the calls take turns over rounds, and each price is the median of
    the rounds' means, so one disturbed round (a call 20x slower throughout) leaves the
    price at the undisturbed call's, while every call still runs in every round."""
    import contextlib
    import time

    from scaleout.sim.measure_calls import Timed, measure_calls

    rounds = {"fast": 0, "slow": 0}

    def sleeper(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def counting(name: str):  # noqa: ANN202
        @contextlib.contextmanager
        def around():  # noqa: ANN202
            rounds[name] += 1
            yield

        return around

    def fast() -> None:
        sleeper(1e-3)

    def slow() -> None:  # 2 ms, but 40 ms in its second round (the first is its warm-up)
        sleeper(40e-3 if rounds["slow"] == 3 else 2e-3)

    fast_cost, slow_cost = measure_calls(
        [Timed(fast, around=counting("fast")), Timed(slow, around=counting("slow"))],
        idle=0.0,
        min_s=0.25,
        warmup=1,
        rounds=5,
    )
    assert rounds == {"fast": 6, "slow": 6}  # the warm-up, then 5 rounds
    assert 0.9e-3 < fast_cost.wall_s < 3e-3  # preemption may lengthen a round here
    assert 1.9e-3 < slow_cost.wall_s < 5e-3  # the rounds' means average 9.6 ms
