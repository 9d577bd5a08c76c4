"""The simulator's engine and Downpour schedule against closed forms, and its byte counts
against a real run's counters."""

import json
import math
import time

import pytest
import simpy

from scaleout.api import config_from_dict
from scaleout.compress.payload import payload_size
from scaleout.ps.client import AUTO_PROBE_PUSHES
from scaleout.ps.layout import shard_ranges
from scaleout.sim.calibrate import model_key
from scaleout.sim.calibration import (
    Calibration,
    CodecCost,
    LockstepCost,
    MessageCost,
    ModelCost,
)
from scaleout.sim.downpour import DownpourSim
from scaleout.sim.engine import Cluster, Link, Shared
from scaleout.sim.setting import Setting, parse_link


def test_processor_sharing_closed_form():
    """Jobs of 1 s and 2 s on one unit: both at half speed until the first ends at 2 s,
    the second alone for its last 1 s."""
    env = simpy.Environment()
    cpu = Shared(env, 1.0, "cpu")
    ends = {}

    def job(name, work):
        yield from cpu.run(work)
        ends[name] = env.now

    env.process(job("a", 1.0))
    env.process(job("b", 2.0))
    env.run()
    assert ends == {"a": pytest.approx(2.0), "b": pytest.approx(3.0)}
    assert cpu.utilisation() == pytest.approx(1.0)


def test_a_job_standing_for_copies_takes_their_shares():
    """A 1 s job standing for 3 beside a plain 1 s job on one unit: four shares until
    both end at 4 s, as four 1 s jobs would."""
    env = simpy.Environment()
    link = Shared(env, 1.0, "link")
    ends = [link.start(1.0, copies=3.0), link.start(1.0)]
    env.run()
    assert all(end.processed for end in ends) and env.now == pytest.approx(4.0)
    assert link.utilisation() == pytest.approx(1.0)


def test_compute_beside_plain_work_is_slowed_by_the_calibrated_factor():
    """A compute job of 1 s beside a 0.5 s copy on two cores, `beside_plain` 1.5: the
    compute moves at 1/1.5 while the copy runs (0.5 s, 1/3 of its work), then alone at
    full speed for its last 2/3: it ends at 0.5 + 2/3 s. The copy is not slowed."""
    env = simpy.Environment()
    cores = Shared(env, 2.0, "cores")
    cores.beside_plain = 1.5
    compute, copy = cores.start(1.0, contended=True), cores.start(0.5)
    env.run(until=copy)
    assert env.now == pytest.approx(0.5)
    env.run(until=compute)
    assert env.now == pytest.approx(0.5 + 2 / 3)


def _ends_beside_a_call(
    jobs: int, call_wait: float, busy: float | None = None, threads: float = 1.0
) -> list[float]:
    """When each of `jobs` compute jobs of 2 s (with `threads`) on two cores ends, with a
    call starting at 1 s and the cores' `call_wait` / `call_wait_busy` set."""
    cluster = Cluster(1, cores=2, link=Link(1e9))
    env, machine = cluster.env, cluster.machines[0]
    machine.cores.call_wait, machine.cores.call_wait_busy = call_wait, busy
    ends = []

    def compute():
        yield from machine.compute(2.0, threads)  # 2 s with its threads
        ends.append(env.now)

    def later_call():
        yield env.timeout(1.0)
        yield from machine.call(0.0, 0.0)

    for _ in range(jobs):
        env.process(compute())
    env.process(later_call())
    env.run()
    return ends


def test_a_call_preempts_the_computing_jobs_by_the_calibrated_wait():
    """`call_wait` 0.3 s: a call starting at 1 s delays one compute job of 2 s on two cores
    to 2.3 s; two compute jobs share the wait (each ends 0.15 s later); a call with no
    compute running takes its own time only."""
    for computing, expected in ((1, 2.3), (2, 2.15)):
        ends = _ends_beside_a_call(computing, 0.3)
        assert ends == pytest.approx([expected] * computing)

    cluster = Cluster(1, cores=2, link=Link(1e9))
    machine = cluster.machines[0]
    machine.cores.call_wait = 0.3
    cluster.env.process(machine.call(0.5, 0.5))
    cluster.run()
    assert cluster.env.now == pytest.approx(0.5)


def test_a_calls_loss_to_the_computing_jobs_follows_how_many_compute():
    """`call_wait` 0.2 s with one job computing on two cores, `call_wait_busy` 1.0 s with
    both computing: a call at 1 s delays a lone 2 s job to 2.2 s, and each of two such jobs
    by half of 1.0 s (2.5 s); 1.5 threads' demand takes the wait halfway between (0.6 s);
    without `call_wait_busy` the one wait holds whatever computes."""
    for jobs, threads, busy, expected in (
        (1, 1.0, 1.0, 2.2),
        (2, 1.0, 1.0, 2.5),
        (1, 1.5, 1.0, 2.6),
        (2, 1.0, None, 2.1),
    ):
        ends = _ends_beside_a_call(jobs, 0.2, busy, threads)
        assert ends == pytest.approx([expected] * jobs), (jobs, threads, busy)


def test_the_wait_per_call_on_busy_cores_is_what_the_measured_step_needs():
    """`call_wait_busy_s` inverts the engine with another job computing throughout: with
    the wait it finds, the step beside the pairs is the measured multiple of the step
    beside that job alone (as the engine prices both); a wait that sharing the cores
    explains is 0; on one core there is no other core to measure: the idle-core wait."""
    from scaleout.sim.measure_beside import (
        BesideCalls,
        _simulated_step,
        call_wait_busy_s,
        paced_pairs,
    )

    pull = MessageCost(fixed_s=1e-3, bytes_per_s=2e9, cpu_fixed_s=1.5e-3, cpu_bytes_per_s=1e9)
    push = MessageCost(fixed_s=1e-3, bytes_per_s=3e9)
    nbytes, apply_s, step_s, wait = 4_000_000, 1.5e-3, 0.013, 2e-4
    slowdown = lambda k: 1.0 + 0.05 * (k - 1)  # noqa: E731
    args = (pull, push, apply_s, nbytes, 2, 0.0)
    without = _simulated_step(step_s, None, 0.0, None, 2, 0.0, 1, slowdown=slowdown)
    assert without == pytest.approx(step_s * 1.05)  # the two jobs' slow-down, no calls

    def step(beside, busy_wait):
        pair = paced_pairs(pull, push, apply_s, nbytes, without * beside.wall_ratio)
        return _simulated_step(
            step_s, beside, wait, pair, 2, 0.0, 1, busy_wait=busy_wait, slowdown=slowdown
        )

    measured = BesideCalls(cpu_ratio=1.05, wall_ratio=1.6, pairs_per_step=1.0)
    found = call_wait_busy_s(step_s, measured, wait, *args, slowdown=slowdown)
    assert wait < found < step_s
    assert step(measured, found) == pytest.approx(1.6 * without, rel=1e-3)
    assert step(measured, 1.1 * found) > 1.6 * without
    shared = BesideCalls(cpu_ratio=1.0, wall_ratio=1.0, pairs_per_step=1.0)
    assert call_wait_busy_s(step_s, shared, wait, *args, slowdown=slowdown) == 0.0
    one_core = (pull, push, apply_s, nbytes, 1, 0.0)
    assert call_wait_busy_s(step_s, measured, wait, *one_core) == wait


def test_the_wait_per_call_is_what_the_measured_step_needs():
    """`call_wait_s` inverts the engine: with the wait it finds, the engine's step beside
    the measurement's pairs (paced to the measured rate) is the measured one; a step no
    longer than sharing the cores gives needs no wait."""
    from scaleout.sim.measure_beside import (
        BesideCalls,
        _simulated_step,
        call_wait_s,
        paced_pairs,
    )

    pull = MessageCost(fixed_s=1e-3, bytes_per_s=2e9, cpu_fixed_s=1.5e-3, cpu_bytes_per_s=1e9)
    push = MessageCost(fixed_s=1e-3, bytes_per_s=3e9)
    nbytes, apply_s, step_s = 4_000_000, 1.5e-3, 0.013
    args = (pull, push, apply_s, nbytes, 2, 0.0)

    def step(beside, wait):
        period = step_s * beside.wall_ratio / beside.pairs_per_step
        pair = paced_pairs(pull, push, apply_s, nbytes, period)
        return _simulated_step(step_s, beside, wait, pair, 2, 0.0)

    measured = BesideCalls(cpu_ratio=1.05, wall_ratio=1.3, pairs_per_step=1.0)
    found = call_wait_s(step_s, measured, *args)
    assert 0 < found < step_s
    assert step(measured, found) == pytest.approx(1.3 * step_s, rel=1e-3)
    assert step(measured, 1.1 * found) > 1.3 * step_s  # the step grows with the wait
    shared = BesideCalls(cpu_ratio=1.05, wall_ratio=1.0, pairs_per_step=1.0)
    assert call_wait_s(step_s, shared, *args) == 0.0
    none = BesideCalls(cpu_ratio=1.05, wall_ratio=1.3, pairs_per_step=0.0)
    assert call_wait_s(step_s, none, *args) == 0.0


def test_a_wait_too_long_for_frequent_calls_stalls_the_step_and_the_search_ends():
    """Cheap calls, many a step (as through shared memory): a wait per call of 1 ms, 4
    calls a pair and 8 pairs a step leave the step no time; the engine says so (inf) at
    once, and `call_wait_s` still finds the wait below that."""
    from scaleout.sim.measure_beside import BesideCalls, _simulated_step, call_wait_s, paced_pairs

    cheap = MessageCost(fixed_s=2e-5, bytes_per_s=2e10)
    nbytes, apply_s, step_s = 400_000, 1e-4, 0.015
    measured = BesideCalls(cpu_ratio=1.0, wall_ratio=1.15, pairs_per_step=8.0)
    pair = paced_pairs(cheap, cheap, apply_s, nbytes, step_s * 1.15 / 8)
    started = time.perf_counter()
    assert _simulated_step(step_s, measured, 1e-3, pair, 2, 0.0) == math.inf
    found = call_wait_s(step_s, measured, cheap, cheap, apply_s, nbytes, 2, 0.0)
    assert time.perf_counter() - started < 30
    assert 0 < found < 1e-3
    assert _simulated_step(step_s, measured, found, pair, 2, 0.0) == pytest.approx(
        1.15 * step_s, rel=1e-3
    )


def test_threads_share_cores_and_a_transfer_pays_both_ends():
    cluster = Cluster(2, cores=2, link=Link(bandwidth=1e6, latency=0.01))
    env = cluster.env
    ends = {}

    def compute():
        yield from cluster.machines[0].compute(1.0, threads=2)  # 1 s with both cores
        ends["compute"] = env.now

    def other():
        yield from cluster.machines[0].work(0.5)  # one thread of 0.5 s beside it
        ends["other"] = env.now

    def send():
        yield from cluster.send(0, 1, 500_000)
        ends["send"] = env.now

    for process in (compute, other, send):
        env.process(process())
    env.run()
    # demand 2 + 1 on 2 cores: each job at 2/3 of its speed until `other` ends at 0.75 s
    # (0.5 s of work at 2/3); `compute` did 0.5 s of its work by then, the rest at full speed
    assert ends["other"] == pytest.approx(0.75)
    assert ends["compute"] == pytest.approx(1.25)
    assert ends["send"] == pytest.approx(0.01 + 0.5)
    assert cluster.traffic.wire_bytes == 500_000


def test_a_transfer_alone_is_one_flow_where_the_machines_count_several():
    """A machine whose transfers stand for 4 (represented replicas) takes 4x as long per
    transfer; one marked `alone` (a backup's forward, made one after another) takes its own
    time."""
    cluster = Cluster(2, cores=1, link=Link(bandwidth=1e6))
    cluster.machines[0].flows = 4
    env = cluster.env
    ends = {}

    def send(alone):
        yield from cluster.send(0, 1, 500_000, alone=alone)
        ends[alone] = env.now

    env.process(send(False))
    env.run()
    env.process(send(True))
    began = env.now
    env.run()
    assert ends[False] == pytest.approx(4 * 0.5)
    assert ends[True] - began == pytest.approx(0.5)


def test_a_call_keeps_more_than_a_core_busy():
    """A call of 1 s wall that keeps 1.5 cores busy, beside a 1-thread compute of 1 s, on a
    machine with 2 cores less 0.5 idle: demand 2.5 on 1.5 cores, so both run at 0.6 of
    their speed; the call ends at 1/0.6 s, the compute has 1 - 1/0.6 * 0.6 = 0 left too."""
    cluster = Cluster(1, cores=2, link=Link(1e9), idle_cores=0.5)
    env, machine = cluster.env, cluster.machines[0]
    ends = {}

    def call():
        yield from machine.call(1.0, 1.5)
        ends["call"] = env.now

    def compute():
        yield from machine.work(1.0)
        ends["compute"] = env.now

    env.process(call())
    env.process(compute())
    env.run()
    assert ends["call"] == pytest.approx(1 / 0.6)
    assert ends["compute"] == pytest.approx(1 / 0.6)
    with pytest.raises(ValueError, match="idle_cores"):
        Cluster(1, cores=1, link=Link(1e9), idle_cores=1.0)

    # a call keeping more cores busy than the machine has lasts as long as they take for
    # its core-seconds (4 of them on 2 cores: 2 s, not its 1 s wall)
    cluster = Cluster(1, cores=2, link=Link(1e9))
    cluster.env.process(cluster.machines[0].call(1.0, 4.0))
    cluster.run()
    assert cluster.env.now == pytest.approx(2.0)


def test_testnet_hosts_of_one_box_share_its_cores():
    """Two hosts of a 1-core box (`one_box`): a 1 s job on each takes 2 s; on two real
    machines each has its core."""
    for one_box, end in ((True, 2.0), (False, 1.0)):
        cluster = Cluster(2, cores=1, link=Link(1e9), one_box=one_box)
        env, ends = cluster.env, []

        def job(machine, env=env, ends=ends):
            yield from machine.work(1.0)
            ends.append(env.now)

        for machine in cluster.machines:
            env.process(job(machine))
        env.run()
        assert ends == [pytest.approx(end)] * 2


def test_message_cost_takes_measured_sizes_and_lines_beyond():
    """Measured points win between them (a copy's cost is not linear in size); beyond them
    the fitted lines; a push's caller goes on before the shard has applied it."""
    cost = MessageCost(
        fixed_s=0.001,
        bytes_per_s=1e9,
        cpu_fixed_s=0.002,
        cpu_bytes_per_s=5e8,
        caller_share=0.5,
        measured_bytes=[1000, 3000],
        measured_s=[0.010, 0.020],
        measured_core_s=[0.012, 0.030],
        measured_caller_core_s=[0.006, 0.006],
        measured_caller_s=[0.002, 0.004],
    )
    assert cost.seconds(1000) == pytest.approx(0.010)
    assert cost.seconds(10_000) == pytest.approx(0.001 + 1e-5)  # the line
    assert cost.cpu_s(10_000) == pytest.approx(0.002 + 2e-5)
    caller, callee = cost.sides(3000)
    assert caller == pytest.approx((0.004, 0.006))
    assert callee == pytest.approx((0.016, 0.024))
    caller, callee = cost.sides(10_000)  # beyond: split by the CPU share
    assert caller[0] == pytest.approx(0.5 * cost.seconds(10_000))
    with pytest.raises(ValueError, match="one value per"):
        MessageCost(fixed_s=0, bytes_per_s=1, measured_bytes=[1, 2], measured_s=[1.0])


def test_step_cost_has_a_part_that_does_not_shrink_with_the_batch():
    cost = ModelCost(num_parameters=10, batch_size=128, train_s={1: 1e-4, 2: 6e-5}, eval_s=1e-6)
    assert cost.step_s(64, 1) == pytest.approx(64e-4)  # no fixed part: per example
    fixed = cost.model_copy(update={"fixed_fraction": 0.25})
    assert fixed.step_s(128, 2) == pytest.approx(128 * 6e-5)
    assert fixed.step_s(64, 1) == pytest.approx(128e-4 * (0.25 + 0.75 / 2))


def test_parse_link():
    assert parse_link("1gbit")[0] == pytest.approx(125e6)
    assert parse_link("250mbit")[0] == pytest.approx(31.25e6)
    with pytest.raises(ValueError, match="--link"):
        parse_link("fast")


def config(
    num_replicas=1,
    num_shards=1,
    steps=20,
    codec="fp32",
    n_fetch=1,
    n_push=1,
    threads=False,
    backups=0,
    shared_memory=False,
):
    """`shared_memory` False by default: the closed forms price pulls as calls to the
    shard (as from another node)."""
    return config_from_dict(
        {
            "run": {"name": "sim", "num_threads": 1},
            "data": {"dataset": "mnist", "num_train": 2000, "num_test": 200},
            "model": {"kind": "mlp", "sizes": [784, 32, 10]},
            "train": {
                "strategy": "downpour",
                "steps": steps,
                "batch_size": 64,
                "optimizer": "adagrad",
                "lr": 0.05,
                "eval_every": 1000,
                "log_every": 20,
                "checkpoint_every": 1000,
            },
            "downpour": {
                "num_replicas": num_replicas,
                "num_shards": num_shards,
                "n_fetch": n_fetch,
                "n_push": n_push,
                "warmstart_steps": 0,
                "shard_checkpoint_every": 10_000,
                "threads": threads,
                "shard_backups": backups,
                "shared_memory": shared_memory,
            },
            "compress": {"codec": codec},
        }
    )


NUM_PARAMETERS = 784 * 32 + 32 + 32 * 10 + 10


def calibration(cfg, step_s=0.010, cores=8):
    cost = ModelCost(
        num_parameters=NUM_PARAMETERS,
        batch_size=64,
        train_s={1: step_s / 64},
        eval_s=1e-9,
        train_size=2000,
        test_size=0,
    )
    return Calibration(
        cores=cores,
        models={model_key(cfg): cost},
        apply_ns={"adagrad": 2.0},
        codecs={"dynamic8": CodecCost(sizes=[1000], encode_ns=[1.0], decode_ns=[1.0])},
        pull=MessageCost(fixed_s=0.001, bytes_per_s=1e9),
        push=MessageCost(fixed_s=0.0005, bytes_per_s=1e9),
        checkpoint_bytes_per_s=1e18,
    )


@pytest.mark.parametrize("shared_memory", [False, True])
def test_one_replica_one_shard_closed_form(shared_memory):
    """Fetch, compute, push per step, nothing else on the cores: every step costs the same.
    With the shard's slice in shared memory a fetch still waits for the last push's update
    (its own), then only the caller copies: the shard serves no pull."""
    cfg = config(steps=20, shared_memory=shared_memory)
    cal = calibration(cfg)
    result = DownpourSim(cfg, Setting(cal, machines=1)).run()
    nbytes = 4 * NUM_PARAMETERS
    # No CPU measured: a call keeps one core busy for its wall time, half of it the caller's.
    pull = cal.pull.fixed_s + nbytes / cal.pull.bytes_per_s  # the shard's half, the caller's
    if shared_memory:
        pull /= 2  # the caller's copy alone
    push_wall = cal.push.fixed_s + nbytes / cal.push.bytes_per_s
    push = push_wall / 2  # the caller's half
    apply = push_wall / 2 + cal.apply_s("adagrad", NUM_PARAMETERS)  # in the shard's queue
    # The driver hands the chunk out (a call's caller half) and takes its answer (the
    # replica's half, then the driver's).
    hand_out, chunk_answer = cal.pull.fixed_s / 2, cal.pull.fixed_s
    assert apply < chunk_answer  # so the last push is applied while the chunk answers
    # every fetch but the first waits in the shard's queue behind the last push's update
    step = pull + 0.010 + push
    look = pull  # the evaluation and the checkpoint at the end each fetch once
    expected = hand_out + 20 * step + 19 * apply + chunk_answer + 2 * look
    assert result.run_s == pytest.approx(expected, rel=1e-9)
    assert result.extra["pushes"] == 20 and result.extra["pulls"] == 20
    assert result.wire_bytes == 0  # one machine: nothing crosses a network
    assert result.bytes_by_kind["pull"] == 20 * nbytes  # counted, though no call carries them


def test_a_push_collects_the_last_ones_answers_and_zeroes_its_gradient():
    """`ReplicaClient.push` beyond its calls: the previous push's answers collected (a
    fixed part and one per shard) and the gradient buffer zeroed, each step, priced from
    the calibration; the closed form above plus those."""
    cfg = config(steps=20, num_shards=2)
    plain = calibration(cfg)
    extra = dict(collect_s=1e-3, collect_shard_s=4e-4, zero_bytes_per_s=1e8)
    priced = plain.model_copy(update=extra)
    before = DownpourSim(cfg, Setting(plain, machines=1)).run().run_s
    after = DownpourSim(cfg, Setting(priced, machines=1)).run().run_s
    collect = 1e-3 + 2 * 4e-4  # every push but the first finds the previous one pending
    zero = 4 * NUM_PARAMETERS / 1e8
    assert priced.collect_push_s(2) == pytest.approx(collect)
    # The shards apply the push while the replica zeroes: the next fetch, which waited
    # `apply` behind it at the shards, now waits for the zeroing instead (zero > apply).
    sim = DownpourSim(cfg, Setting(plain, machines=1))
    (_, _), (callee, _) = plain.push.sides(sim.push_bytes[0])
    apply = callee + plain.apply_s("adagrad", sim.shards[0].numel)
    assert sim.push_bytes[0] == sim.push_bytes[1] and zero > apply
    assert after - before == pytest.approx(19 * collect + 20 * zero - 19 * apply, rel=1e-9)

    # the model's zeroing measured after a step stands for the back-to-back rate
    key = next(iter(priced.models))
    cold = priced.model_copy(deep=True)
    cold.models[key] = cold.models[key].model_copy(update={"zero_s": 2 * zero})
    colder = DownpourSim(cfg, Setting(cold, machines=1)).run().run_s
    assert colder - after == pytest.approx(20 * zero, rel=1e-9)


def test_a_replicas_first_calls_after_compute_pay_their_wake_up():
    """With `lockstep["shard_calls"]` measured (1 ms and 0.5 core-ms after 2 to 20 ms of
    compute), each run of compute (one step here: a push after it, then the next fetch)
    costs its calls 1 ms more on the replica's idle cores: 20 steps, 20 ms more, and the
    closed form above shifts by exactly that."""
    cfg = config(steps=20)
    plain = calibration(cfg)
    after = LockstepCost(
        measured_bytes=[1_000, 10_000_000],
        gaps_s=[0.002, 0.02],
        extra_s=[[1e-3, 1e-3], [1e-3, 1e-3]],
        extra_core_s=[[5e-4, 5e-4], [5e-4, 5e-4]],
    )
    woken = plain.model_copy(update={"lockstep": {"shard_calls": after}})
    before = DownpourSim(cfg, Setting(plain, machines=1)).run().run_s
    later = DownpourSim(cfg, Setting(woken, machines=1)).run().run_s
    assert later - before == pytest.approx(20 * 1e-3, rel=1e-9)
    # below the shortest measured gap the extra falls to 0: a run of 1 ms pays half
    assert after.extra(1e-3, 4 * NUM_PARAMETERS) == pytest.approx(5e-4)


def test_a_replicas_calls_wait_for_cores_on_a_busy_machine():
    """`hop_wait_s` (2 ms, a call's wait when every core is busy): a call waits it times
    the busy fraction of its machine's cores as it starts (k computing processes on 2
    cores: k / 2, at most 1), then takes its processor share; two replicas on two cores,
    each calling beside the other's compute, run longer for it."""
    cfg = config(steps=20)
    plain = calibration(cfg, cores=2)
    after = LockstepCost(
        measured_bytes=[1_000, 10_000_000],
        gaps_s=[0.002, 0.02],
        extra_s=[[0.0, 0.0], [0.0, 0.0]],
        hop_wait_s=[2e-3, 2e-3],
    )
    waiting = plain.model_copy(update={"lockstep": {"shard_calls": after}})
    nbytes = 4 * NUM_PARAMETERS
    (wall, _), _ = plain.pull.sides(nbytes)
    for computing in (0, 1, 2, 3):
        sim = DownpourSim(cfg, Setting(waiting, machines=1))
        machine = sim.cluster.machines[0]
        for _ in range(computing):  # processes computing for longer than the call
            machine.cores.start(1.0, contended=True)
        sim.env.run(until=sim.env.process(sim._call(0, plain.pull, nbytes, caller=True)))
        share = min(1.0, 2 / (computing + 1))  # the call's one core beside them
        assert sim.env.now == pytest.approx(2e-3 * min(computing / 2, 1) + wall / share)
    two = config(num_replicas=2, steps=20)  # each one's calls beside the other's compute
    before = DownpourSim(two, Setting(calibration(two, cores=2), machines=1)).run().run_s
    busy = calibration(two, cores=2).model_copy(update={"lockstep": {"shard_calls": after}})
    assert DownpourSim(two, Setting(busy, machines=1)).run().run_s > before
    with pytest.raises(ValueError, match="hop_wait_s"):
        LockstepCost(
            measured_bytes=[1], gaps_s=[1e-3, 1e-2], extra_s=[[0.0, 0.0]], hop_wait_s=[1.0, 2.0]
        )


def test_a_pull_after_a_push_waits_for_it_at_the_shard():
    """Ray runs one caller's calls to an actor in the order they were made: a pull sent
    right after a push to a shard across a slow link starts at the shard once the push's
    payload has crossed and been applied; then its own slice crosses back."""
    cfg = config(num_replicas=2, num_shards=1)
    cal = calibration(cfg)
    sim = DownpourSim(cfg, Setting(cal, machines=2, link=Link(1e6, 0.0)))
    replica, shard = sim.replicas[1], sim.shards[0]
    assert (replica.machine, shard.machine) == (1, 0)
    nbytes = 4 * NUM_PARAMETERS
    crossing = nbytes / 1e6  # 0.1 s each way, on 8 idle cores: nothing else takes time
    (_, _), (push_callee, _) = cal.push.sides(nbytes)
    (pull_caller, _), (pull_callee, _) = cal.pull.sides(nbytes)
    update = push_callee + cal.apply_s("adagrad", NUM_PARAMETERS)
    sim.env.process(sim._apply(replica, shard, 0))
    pull = sim.env.process(sim._pull_all(replica, replica.versions, "pull"))
    sim.env.run(until=pull)
    assert sim.env.now == pytest.approx(crossing + update + pull_callee + crossing + pull_caller)
    assert replica.versions[shard.index] == 1  # the pull saw the push applied

    # a pull alone does not wait; Ray's moving its slice between the nodes' stores runs
    # beside the link's transfer and ends `pull_across` after it (measured beyond it)
    for extra in (0.0, 0.03):
        cal.pull_across = MessageCost(fixed_s=extra, bytes_per_s=1e12) if extra else None
        sim = DownpourSim(cfg, Setting(cal, machines=2, link=Link(1e6, 0.0)))
        alone = sim.replicas[1]
        pull = sim.env.process(sim._pull_all(alone, alone.versions, "pull"))
        sim.env.run(until=pull)
        assert sim.env.now == pytest.approx(pull_callee + crossing + extra + pull_caller)


def test_a_fetch_takes_its_slices_in_one_thread():
    """`pull_into` asks every shard at once and waits for all; then the replica's one
    thread takes and copies the slices in turn: on idle cores a fetch from 4 shards costs
    one shard's side and 4 callers' sides."""
    cfg = config(num_replicas=1, num_shards=4)
    cal = calibration(cfg)
    sim = DownpourSim(cfg, Setting(cal, machines=1))
    replica = sim.replicas[0]
    sides = [cal.pull.sides(nbytes) for nbytes in sim.pull_bytes]
    assert len(sides) == 4 and sum(sim.pull_bytes) == 4 * NUM_PARAMETERS
    fetch = sim.env.process(sim._fetch(replica, replica.versions))
    sim.env.run(until=fetch)
    callee = max(wall for _, (wall, _) in sides)  # side by side, in four actors
    callers = sum(wall for (wall, _), _ in sides)  # in turn
    assert sim.env.now == pytest.approx(callee + callers)


def test_a_backup_applies_every_push_before_it_is_answered():
    """`shard_backups`: the primary forwards each push to its backup on another machine
    (putting the payload into the object store, a caller's side), applies its own copy
    meanwhile, and answers once the backup has applied it too. Backups are on by default
    where the real run has them: another machine, or a core for every replica, shard and
    backup on one."""
    cfg = config(num_replicas=2, num_shards=1, backups=1)
    cal = calibration(cfg)
    sim = DownpourSim(cfg, Setting(cal, machines=2, link=Link(1e6, 0.0)))
    replica, shard = sim.replicas[1], sim.shards[0]
    assert (replica.machine, shard.machine, shard.backup) == (1, 0, 1)
    nbytes = 4 * NUM_PARAMETERS
    crossing = nbytes / 1e6
    (forward, _), (push_callee, _) = cal.push.sides(nbytes)
    apply = cal.apply_s("adagrad", NUM_PARAMETERS)
    sim.env.run(until=sim.env.process(sim._apply(replica, shard, 0)))
    backup = crossing + push_callee + apply  # longer than the primary's own apply
    assert sim.env.now == pytest.approx(crossing + push_callee + forward + backup)
    assert sim.cluster.traffic.by_kind["backup"] == nbytes

    def backup_of(machines, cores, backups=None, replicas=1):
        cfg = config(num_replicas=replicas, backups=backups)
        setting = Setting(calibration(cfg, cores=cores), machines=machines)
        return DownpourSim(cfg, setting).shards[0].backup

    assert backup_of(2, 2) == 1  # another machine
    assert backup_of(1, 3) == 0  # 1 replica + 1 shard + 1 backup on 3 cores
    assert backup_of(1, 2) is None and backup_of(1, 3, replicas=2) is None
    assert backup_of(2, 2, backups=0) is None


def test_threads_hide_communication_behind_compute():
    """Threads mode with cores to spare: the compute thread only waits for its two copies
    per three steps (the fetched parameters in, the gradient out) while fetches and pushes
    run beside it; without threads each step pays its share of a fetch, a push and the
    push's update. Both pay the same chunk hand-outs and answers. Every push is sent; the
    threads fetch once at the start and then every third step."""
    steps, n = 60, 3
    results = {}
    for threads in (False, True):
        cfg = config(steps=steps, n_fetch=n, n_push=n, threads=threads)
        cal = calibration(cfg, cores=8)
        results[threads] = DownpourSim(cfg, Setting(cal, machines=1)).run()
    threaded, plain = results[True], results[False]
    copy = 4 * NUM_PARAMETERS / cal.flatten_bytes_per_s
    nbytes = 4 * NUM_PARAMETERS
    pull = cal.pull.fixed_s + nbytes / cal.pull.bytes_per_s
    push_wall = cal.push.fixed_s + nbytes / cal.push.bytes_per_s
    push = push_wall / 2  # the caller's half
    # without threads the fetch after a push waits in the shard's queue for its update
    apply = push_wall / 2 + cal.apply_s("adagrad", NUM_PARAMETERS)
    step_s = {t: 64 / r.steady_examples_per_s for t, r in results.items()}
    assert step_s[False] - step_s[True] == pytest.approx((pull + push + apply - 2 * copy) / n)
    # the compute thread's time per step in pushes: a call per shard, or a copy
    assert plain.extra["replica_step_s"]["push"] == pytest.approx(push / n)
    assert threaded.extra["replica_step_s"]["push"] == pytest.approx(copy / n)
    assert threaded.extra["pushes"] == plain.extra["pushes"] == steps // n
    # the start's fetch, then one asked every n steps (the client's start counts as one)
    assert threaded.extra["pulls"] == 1 + steps // n


def test_threads_wait_for_a_fetch_after_two_rounds_on_the_same_parameters():
    """A fetch slower than 2 * n_fetch steps: the compute thread asks for the next fetch
    while one runs, so the fetch thread fetches back to back, and the compute thread runs
    its 2 * n_fetch steps on each fetch's parameters and waits for the next."""
    steps, n = 80, 2
    cfg = config(steps=steps, n_fetch=n, n_push=1000, threads=True)
    cal = calibration(cfg, cores=8)
    cal.pull = MessageCost(fixed_s=0.001, bytes_per_s=1e6)  # 0.1 s >> 2 * n steps of 0.010 s
    result = DownpourSim(cfg, Setting(cal, machines=1)).run()
    copy = 4 * NUM_PARAMETERS / cal.flatten_bytes_per_s
    fetch = cal.pull.fixed_s + 4 * NUM_PARAMETERS / cal.pull.bytes_per_s + copy
    assert result.steady_examples_per_s == pytest.approx(2 * n * 64 / fetch, rel=1e-6)


def test_auto_threads_as_the_client_decides():
    """`threads = "auto"`: each replica runs in turn for its first 1 + AUTO_PROBE_PUSHES
    push windows, then starts its threads when its compute (30 ms a window) hides its
    communication (a few ms): its run lies between threads off and on, and every push is
    sent. Where a fetch takes longer than a window's compute, or the replicas' compute takes
    every core, the run is exactly the run with threads off."""
    steps, n = 60, 3

    def run(threads, replicas=1, cores=8, pull_bytes_per_s=1e9):
        cfg = config(num_replicas=replicas, steps=steps, n_fetch=n, n_push=n, threads=threads)
        cal = calibration(cfg, cores=cores)
        cal.pull = MessageCost(fixed_s=0.001, bytes_per_s=pull_bytes_per_s)
        return DownpourSim(cfg, Setting(cal, machines=1)).run()

    off, on, auto = run(False), run(True), run("auto")
    assert on.run_s < auto.run_s < off.run_s
    assert auto.extra["pushes"] == off.extra["pushes"] == steps // n
    # the probes' fetches in turn, the threads' first, then one every n steps
    probed = AUTO_PROBE_PUSHES + 1
    assert auto.extra["pulls"] == probed + 1 + (steps - probed * n) // n
    slow_fetch = 1e6  # 0.1 s a fetch against 30 ms of compute a window
    assert (
        run("auto", pull_bytes_per_s=slow_fetch).run_s
        == run(False, pull_bytes_per_s=slow_fetch).run_s
    )
    # 2 replicas of 1 thread on 2 cores: no core to spare for the threads
    assert run("auto", replicas=2, cores=2).run_s == run(False, replicas=2, cores=2).run_s


def test_replicas_on_machines_cross_the_link():
    cfg = config(num_replicas=2, num_shards=2, steps=40)
    cal = calibration(cfg)
    result = DownpourSim(cfg, Setting(cal, machines=2, link=Link(125e6, 50e-6))).run()
    assert result.extra["replicas"] == 2
    assert result.wire_bytes > 0
    assert 0 < result.utilisation["network link"] <= 1.0


BACKUPS_GAP = "with backups the representatives' forwards meet their transfers in bursts"


@pytest.mark.parametrize(
    ("step_s", "bandwidth", "bottleneck", "backups"),
    [
        (0.010, 125e6, "shard queue", 0),
        (0.050, 12.5e6, "network link", 0),
        (0.2, 125e6, "replica compute", 0),
        pytest.param(
            0.010, 125e6, "shard queue", 1, marks=pytest.mark.xfail(strict=True, reason=BACKUPS_GAP)
        ),
        pytest.param(
            0.050,
            12.5e6,
            "shard queue",
            1,
            marks=pytest.mark.xfail(strict=True, reason=BACKUPS_GAP),
        ),
    ],
)
def test_represented_replicas_match_simulating_every_one(
    monkeypatch, step_s, bandwidth, bottleneck, backups
):
    """128 machines simulated through 16 representatives (each standing for 8) against all
    128, the shards on machines of their own in both: the same throughput, bottleneck and
    bytes, within a few percent. (Evaluation pauses are left out: the driver waits for
    replica 0's chunk, which a representative's coarser steps move.)"""
    import scaleout.sim.downpour as downpour

    cfg = config(num_shards=4, n_fetch=3, n_push=3, backups=backups)
    cfg.train.eval_every = cfg.train.checkpoint_every = 100_000
    cal = calibration(cfg, step_s=step_s)
    setting = Setting(cal, machines=128, link=Link(bandwidth, 50e-6), steps=128 * 60)
    results = {}
    for represented in (16, 1000):
        monkeypatch.setattr(downpour, "REPRESENTED", represented)
        results[represented] = DownpourSim(cfg, setting, own_shard_machines=True).run()
    few, every = results[16], results[1000]
    assert few.extra["simulated_replicas"] == 16 and every.extra["simulated_replicas"] == 128
    assert few.machines == every.machines == 128
    assert every.bottleneck == few.bottleneck == bottleneck
    assert few.steady_examples_per_s == pytest.approx(every.steady_examples_per_s, rel=0.05)
    assert few.examples_per_s == pytest.approx(every.examples_per_s, rel=0.05)
    assert few.wire_bytes == pytest.approx(every.wire_bytes, rel=0.05)
    assert few.extra["pushes"] == pytest.approx(every.extra["pushes"], rel=0.05)
    for role in ("shard queue", "network link"):
        assert few.utilisation[role] == pytest.approx(every.utilisation[role], abs=0.05)


def with_link(cfg, link):
    raw = cfg.model_dump(mode="json")
    raw["compress"]["link"] = link
    return config_from_dict(raw)


@pytest.mark.parametrize(("link", "sent"), [("100mbit", "dynamic8"), ("ib56", "fp32")])
def test_a_wire_with_a_link_is_priced_as_it_chooses(link, sent):
    """`compress.link`: pushes go 8-bit where that is faster on the link (100 Mbit), raw
    where the codec costs more than the bytes it saves (a 12.7k-value shard on FDR
    InfiniBand: 17 us raw, over 50 us encoded), in bytes and in codec time."""
    cfg = with_link(config(num_shards=2, steps=20, codec="dynamic8"), link)
    cal = calibration(cfg)
    sim = DownpourSim(cfg, Setting(cal, machines=1))
    ranges = shard_ranges(NUM_PARAMETERS, 2)
    assert sim.push_codecs == [sent, sent]
    assert sim.push_bytes == [
        4 * (b - a) if sent == "fp32" else payload_size(sent, (b - a,), 0) for a, b in ranges
    ]
    result = sim.run()
    assert result.bytes_by_kind["push"] == result.extra["pushes"] * sum(sim.push_bytes)


def test_payload_size_is_the_encoded_length():
    import torch

    from scaleout.compress import get

    for name, block in (("dynamic8", 0), ("dynamic8", 4096), ("onebit", 0), ("bf16", 0)):
        x = torch.randn(10_001)
        codec = get(name, block_size=block or None)
        assert len(codec.encode(x).to_bytes()) == payload_size(name, (10_001,), block)


def test_cli_simulate_writes_rows_and_refuses_bad_input(tmp_path):
    from scaleout.api import load_config
    from scaleout.cli import main

    path = "configs/mnist_downpour.toml"
    cal_file = calibration(load_config(path)).save(tmp_path / "cal.json")
    out = tmp_path / "sim"
    args = ["simulate", path, "--calibration", str(cal_file), "--out", str(out)]
    sweep = ["--sweep", "downpour.n_push=1,3", "--set", "downpour.mode=gradients"]
    code = main([*args, "--machines", "1,2", "--steps", "60", *sweep])
    assert code == 0
    rows = json.loads((out / "simulate.json").read_text())["rows"]
    assert [(r["downpour.n_push"], r["machines"]) for r in rows] == [
        ("1", 1),
        ("1", 2),
        ("3", 1),
        ("3", 2),
    ]
    assert all(r["examples_per_s"] > 0 and r["bottleneck"] for r in rows)
    assert (out / "simulate.png").stat().st_size > 0
    assert main([*args, "--machines", "0"]) == 2
    assert main([*args, "--link", "fast"]) == 2
    assert main(["simulate", path, "--calibration", str(tmp_path / "none.json")]) == 2
    bad = ["calibrate", path, "--set", "model.sizes=", "--out", str(tmp_path / "c.json")]
    assert main(bad) == 2 and not (tmp_path / "c.json").exists()  # refused before measuring
