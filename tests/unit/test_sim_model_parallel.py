"""The model-parallel simulation against the library's own byte counts and a closed form."""

from __future__ import annotations

import pytest
import torch

from scaleout.api import build_job, load_config
from scaleout.compress.transfer import CodecSpeed
from scaleout.errors import ConfigError
from scaleout.parallel import bytes_per_step, parallelize
from scaleout.sim.calibration import Calibration, LockstepCost, MessageCost
from scaleout.sim.engine import Link
from scaleout.sim.model_parallel import Compute, GreedySchedule, ModelParallelSim, Move
from scaleout.sim.setting import Setting

CONFIG = "configs/autoencoder_model_parallel.toml"
FREE = MessageCost(fixed_s=0.0, bytes_per_s=1e30)
RATE, APPLY_NS = 1e9, 2.0


def config(grid, *more):
    return load_config(CONFIG, [f"model_parallel.grid=[{grid[0]},{grid[1]}]", *more])


def hardware(cores=4):
    """A machine priced from its FLOP rate alone (no measured model), as a hardware file."""
    return Calibration(
        cores=cores,
        flops_per_s=RATE,
        apply_ns={"momentum": APPLY_NS},
        pull=FREE,
        push=FREE,
        allreduce=FREE,
    )


@pytest.mark.parametrize("grid", [(1, 2), (2, 2)])
def test_exchange_bytes_equal_the_library_workers(grid):
    """Every worker's bytes per greedy step, as its partitioned network counts them."""
    cfg = config(grid)
    schedule = GreedySchedule(cfg)
    batch = cfg.train.batch_size
    job = build_job(cfg)
    for stack in range(schedule.num_stacks):
        real = 0
        for rank in range(grid[0] * grid[1]):
            torch.manual_seed(0)
            real += bytes_per_step(parallelize(job.model.build(), grid, rank), stack, batch)
        assert real > 0
        assert schedule.bytes_per_step(stack) == real


def test_worker_flops_add_up_to_the_whole_network():
    whole = GreedySchedule(config((1, 1)))
    split = GreedySchedule(config((2, 2)))
    for stack in range(whole.num_stacks):
        parts = [split.step_flops(stack, rank) for rank in range(4)]
        assert sum(parts) == pytest.approx(whole.step_flops(stack), rel=1e-6)
        assert max(parts) < whole.step_flops(stack)


def expected_step(schedule, stack, bandwidth, latency, machine_of):
    """Closed form on distinct machines: each layer's slowest worker, each exchange's
    largest piece (every pair of machines has its own links here), the sums' ring, the
    slowest update."""
    seconds = 0.0
    for item in schedule.step(stack):
        if isinstance(item, Compute):
            seconds += max(item.flops) / RATE
        else:
            assert isinstance(item, Move)
            for i, j in item.pairs:
                assert machine_of[i] != machine_of[j]
            seconds += latency + max(item.pairs.values()) / bandwidth
    n = len(set(machine_of))
    seconds += 2 * (n - 1) * (latency + 16 / n / bandwidth)
    seconds += max(schedule.own_numel[stack]) * APPLY_NS * 1e-9
    return seconds


def test_two_workers_on_two_machines_equal_the_closed_form():
    bandwidth, latency = 1e8, 1e-4
    cfg = config((1, 2))
    setting = Setting(hardware(), machines=2, link=Link(bandwidth, latency), steps=10)
    sim = ModelParallelSim(cfg, setting)
    result = sim.run()
    schedule = sim.schedule
    expected = [expected_step(schedule, k, bandwidth, latency, [0, 1]) for k in range(3)]
    assert result.extra["stack_step_s"] == pytest.approx(expected, rel=1e-6)
    assert result.step_s == pytest.approx(sum(expected) / 3, rel=1e-6)
    # what crossed the wire: every stack's exchanges once, and the sums' ring; then every
    # stack's evaluation (its forward exchanges on the test set) and its sums' ring
    sums = 3 * 2 * 2 * 8
    evaluations = sum(
        sum(item.pairs.values())
        for k in range(3)
        for item in schedule.forward(k, cfg.data.num_test)
        if isinstance(item, Move)
    )
    assert result.wire_bytes == sum(schedule.bytes_per_step(k) for k in range(3)) + sums + (
        evaluations + sums
    )


def test_a_calibrated_lockstep_delays_every_exchange_after_compute():
    """An exchange after compute costs `lockstep["exchange"]` more: with a constant extra,
    each stack's step grows by it once per exchange that follows a layer's compute (one
    right after another exchange follows no compute; the sums' all-reduce, "allreduce",
    has no extra here)."""
    bandwidth, latency, extra = 1e8, 1e-4, 3e-3
    cfg = config((1, 2))
    constant = LockstepCost(measured_bytes=[1], gaps_s=[1e-9, 1.0], extra_s=[[extra, extra]])
    cal = hardware().model_copy(update={"lockstep": {"exchange": constant}})
    setting = Setting(cal, machines=2, link=Link(bandwidth, latency), steps=10)
    sim = ModelParallelSim(cfg, setting)
    result = sim.run()
    schedule = sim.schedule
    expected = []
    for k in range(3):
        items = [i for i in schedule.step(k) if isinstance(i, Compute) or i.pairs]
        moves = sum(
            1
            for before, item in zip(items, items[1:], strict=False)
            if isinstance(item, Move) and isinstance(before, Compute)
        )
        moves += isinstance(items[0], Move)  # after the step before it
        assert 0 < moves < len(items)
        expected.append(expected_step(schedule, k, bandwidth, latency, [0, 1]) + moves * extra)
    assert result.extra["stack_step_s"] == pytest.approx(expected, rel=1e-6)


def test_one_worker_has_no_exchanges():
    cfg = config((1, 1))
    result = ModelParallelSim(cfg, Setting(hardware(), steps=5)).run()
    schedule = GreedySchedule(cfg)
    expected = [
        schedule.step_flops(k) / RATE + sum(schedule.own_numel[k]) * APPLY_NS * 1e-9
        for k in range(3)
    ]
    assert result.extra["stack_step_s"] == pytest.approx(expected, rel=1e-6)
    assert result.wire_bytes == 0 and result.local_bytes == 0
    assert result.step_s == pytest.approx(sum(expected) / 3)


def test_evaluations_and_checkpoints_between_the_stacks_equal_the_closed_form():
    """5 steps per stack (evaluations and checkpoints every 500): the driver evaluates and
    checkpoints at each stack's end; those of stacks 1 and 2 come before the last metrics
    line's stamp, the last stack's after it. An evaluation is the forward pass over the
    test set (1024 examples, one batch) at the FLOP rate; a checkpoint the filters and
    their momentum at `checkpoint_bytes_per_s`."""
    cfg = config((1, 1))
    cal = hardware()
    result = ModelParallelSim(cfg, Setting(cal, steps=5)).run()
    schedule = GreedySchedule(cfg)
    steps = [
        schedule.step_flops(k) / RATE + sum(schedule.own_numel[k]) * APPLY_NS * 1e-9
        for k in range(3)
    ]
    evaluations = [schedule.forward_flops(k, cfg.data.num_test) / RATE for k in range(3)]
    assert result.extra["stack_eval_s"] == pytest.approx(evaluations, rel=1e-6)
    checkpoint = 4 * sum(map(sum, schedule.own_numel)) * 2 / cal.checkpoint_bytes_per_s
    stamped = 5 * sum(steps) + evaluations[0] + evaluations[1] + 2 * checkpoint
    assert result.examples_per_s == pytest.approx(15 * cfg.train.batch_size / stamped)
    assert result.run_s == pytest.approx(stamped + evaluations[2] + checkpoint)


def test_a_measured_evaluation_prices_each_stacks_evaluation():
    """With this model measured, one worker's evaluation of stack k takes exactly the
    measured seconds per test example of stack k's evaluation, times the test set."""
    from scaleout.sim.calibration import ModelCost
    from scaleout.sim.measuring import model_key

    cfg = config((1, 1))
    cost = ModelCost(
        num_parameters=1000,
        batch_size=64,
        train_s={1: 1e-4},
        phase_s=[1e-4, 2e-4, 3e-4],
        eval_s=1e-5,
        phase_eval_s=[1e-5, 2e-5, 4e-5],
        test_size=1024,
    )
    cal = hardware().model_copy(update={"models": {model_key(cfg): cost}})
    result = ModelParallelSim(cfg, Setting(cal, steps=5)).run()
    assert result.extra["stack_eval_s"] == pytest.approx([0.01024, 0.02048, 0.04096], rel=1e-6)


def test_workers_of_one_machine_share_its_cores():
    """Four 1-thread workers on a machine of 2 cores take twice their compute."""
    cfg = config((2, 2))
    wide = ModelParallelSim(cfg, Setting(hardware(cores=4), steps=1)).run()
    narrow = ModelParallelSim(cfg, Setting(hardware(cores=2), steps=1)).run()
    assert narrow.step_s > 1.8 * wide.step_s


def test_8bit_exchanges_move_about_a_quarter():
    raw = GreedySchedule(config((1, 2)))
    coded = GreedySchedule(config((1, 2), 'compress.codec="dynamic8"'))
    for stack in range(raw.num_stacks):
        ratio = coded.bytes_per_step(stack) / raw.bytes_per_step(stack)
        assert 0.25 <= ratio < 0.3


@pytest.mark.parametrize(
    ("link", "call_s", "coded"), [("100mbit", 0.0, True), ("ib56", 1.0, False)]
)
def test_exchanges_on_a_link_move_what_the_library_sends(link, call_s, coded):
    """With `compress.link` each piece is counted as the exchange sends it: packed codes
    where the codec (its calibrated cost) makes that faster on the link, else raw."""
    speed = CodecSpeed(call_s, 0.0, call_s, 0.0)
    on_link = GreedySchedule(
        config((1, 2), 'compress.codec="dynamic8"', f'compress.link="{link}"'), speed=speed
    )
    same = GreedySchedule(config((1, 2), *(['compress.codec="dynamic8"'] if coded else [])))
    for stack in range(same.num_stacks):
        assert on_link.bytes_per_step(stack) == same.bytes_per_step(stack)


def test_more_machines_than_workers_is_refused():
    with pytest.raises(ConfigError, match="at most"):
        ModelParallelSim(config((1, 2)), Setting(hardware(), machines=3))


# --- one message on the wire; the papers' hardware files ----------------------------------


def test_a_message_is_encode_latency_bytes_decode():
    from scaleout.compress.payload import payload_size
    from scaleout.sim.calibration import CodecCost
    from scaleout.sim.wire import transfer_s

    cal = hardware().model_copy(
        update={
            "codecs": {
                "dynamic8": CodecCost(sizes=[1000], encode_ns=[2.0], decode_ns=[1.0]),
            }
        }
    )
    link, n = Link(1e9, 1e-5), 1_000_000
    raw = transfer_s(cal, link, n)
    assert raw == pytest.approx(1e-5 + payload_size("fp32", (n,), 0) / 1e9)
    coded = transfer_s(cal, link, n, "dynamic8")
    expected = 2e-9 * n + 1e-5 + payload_size("dynamic8", (n,), 0) / 1e9 + 1e-9 * n
    assert coded == pytest.approx(expected)


@pytest.mark.parametrize("name", ["cots_hpc", "distbelief", "dettmers_pcie", "ding_titan"])
def test_the_papers_hardware_files_load(name):
    cal = Calibration.load(f"configs/hardware/{name}.json")
    assert cal.flops_per_s and cal.notes["not pinned by the paper"]


def test_ding_hardware_reproduces_the_columns_it_was_fitted_to():
    """The Titan file's compute and loading come from table 1's 1-GPU columns: simulated,
    they give those columns back; two GPUs are faster, and parallel loading helps both."""
    from benchmarks.papers import DING_TABLE_1
    from benchmarks.sim_papers import ding

    table = ding()
    for gpus_loading in [(1, True), (1, False)]:
        assert table[gpus_loading] == pytest.approx(DING_TABLE_1[gpus_loading], rel=1e-3)
    assert table[(2, True)] < table[(1, True)] and table[(2, False)] < table[(1, False)]
    assert table[(2, True)] < table[(2, False)]


def test_an_evaluation_of_every_stack_is_measured():
    """The calibration times each stack's evaluation as a worker runs it (through the frozen
    stacks below it), on the config's test set in its eval batches."""
    from scaleout.sim.measure_compute import _Stepper

    stepper = _Stepper(config((1, 1), "data.num_test=64", "train.eval_batch_size=32"))
    seconds = [stepper.evaluate_s(phase) for phase in range(stepper.num_phases)]
    assert len(seconds) == 3 and all(0 < s < 1 for s in seconds)
