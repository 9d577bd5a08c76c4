"""The sync and Sandblaster simulations on hand-computable cases equal their closed forms.

Calibrations are built by hand: every cost a case does not exercise is zero (or a rate of
1e30 bytes/s), so the simulated times are sums of the few costs that remain.
"""

from __future__ import annotations

import math

import pytest

from scaleout.api import load_config
from scaleout.errors import ConfigError
from scaleout.sim.calibrate import model_key
from scaleout.sim.calibration import (
    Calibration,
    CodecCost,
    LockstepCost,
    MessageCost,
    ModelCost,
)
from scaleout.sim.engine import Cluster, Link
from scaleout.sim.sandblaster import SandblasterSim
from scaleout.sim.setting import Setting
from scaleout.sim.sync import SyncSim, driver_chunks, ring_allgather, ring_allreduce

FREE = MessageCost(fixed_s=0.0, bytes_per_s=1e30)
REL = 1e-9


def calibration(
    config,
    num_parameters: int,
    per_example_s: float,
    *,
    cores: int = 4,
    optimizer_s: float = 0.0,
    allreduce: MessageCost | None = None,
    codecs: dict[str, CodecCost] | None = None,
    flatten_bytes_per_s: float = 1e30,
    parameter_numels: list[int] | None = None,
    backward_fraction: float | None = None,
) -> Calibration:
    cost = ModelCost(
        backward_fraction=backward_fraction,
        num_parameters=num_parameters,
        batch_size=1,
        train_s={1: per_example_s},
        eval_s=1e-6,
        test_size=0,  # no evaluation cost
        optimizer_s=optimizer_s,
        parameter_numels=parameter_numels or [],
    )
    return Calibration(
        cores=cores,
        models={model_key(config): cost},
        apply_ns={"sgd": 0.0},
        codecs=codecs or {},
        pull=FREE,
        push=FREE,
        allreduce=allreduce,
        checkpoint_bytes_per_s=1e30,
        flatten_bytes_per_s=flatten_bytes_per_s,
    )


# --- the ring ------------------------------------------------------------------------------


@pytest.mark.parametrize("exact", [True, False])
def test_ring_allreduce_equals_closed_form(exact):
    n, bandwidth, latency, nbytes = 4, 1e8, 1e-4, 4_000_000
    cluster = Cluster(n, cores=1, link=Link(bandwidth, latency))
    done = cluster.env.process(ring_allreduce(cluster, list(range(n)), nbytes, exact=exact))
    cluster.run(done)
    expected = 2 * (n - 1) * (latency + nbytes / n / bandwidth)
    assert cluster.env.now == pytest.approx(expected, rel=REL)
    assert cluster.traffic.wire_bytes == 2 * (n - 1) * n * (nbytes // n)
    assert cluster.traffic.by_kind == {"allreduce": 2 * (n - 1) * nbytes}
    assert cluster.traffic.local_bytes == 0


def test_ring_allgather_equals_closed_form():
    n, bandwidth, latency, nbytes = 5, 1e7, 2e-4, 100_001
    cluster = Cluster(n, cores=1, link=Link(bandwidth, latency))
    done = cluster.env.process(ring_allgather(cluster, list(range(n)), nbytes))
    cluster.run(done)
    assert cluster.env.now == pytest.approx((n - 1) * (latency + nbytes / bandwidth), rel=REL)
    assert cluster.traffic.wire_bytes == (n - 1) * n * nbytes


@pytest.mark.parametrize("core_factor", [1.0, 6.0])
def test_two_ranks_on_one_machine_take_the_calibrated_allreduce(core_factor):
    """Measured points are interpolated; calls that keep more cores busy than the machine
    has are slower: two ranks of 3 core-seconds per second each on 2 cores take 3x as long
    (every core-second is worked off; none is lost to a cap)."""
    sizes, walls = [1_000_000, 16_000_000], [1e-3, 5e-3]
    cost = MessageCost(
        fixed_s=3e-4,
        bytes_per_s=2e9,
        measured_bytes=sizes,
        measured_s=walls,
        measured_core_s=[core_factor * w for w in walls],
        measured_caller_core_s=[core_factor * w / 2 for w in walls],
    )
    config = load_config("configs/mnist_sync.toml")
    cal = calibration(config, 1000, 1e-3, cores=2, allreduce=cost)
    cluster = Cluster(1, cores=2, link=Link(1e9, 0.0))
    done = cluster.env.process(ring_allreduce(cluster, [0, 0], 8_000_000, cal))
    cluster.run(done)
    quiet = 1e-3 + 4e-3 * math.log(8) / math.log(16)  # interpolated in log size
    assert cost.seconds(8_000_000) == pytest.approx(quiet, rel=REL)
    per_rank = core_factor / 2  # cores a rank's call keeps busy on a machine of its own
    slower = max(1.0, 2 * per_rank / 2)  # two ranks' core-seconds on the machine's 2 cores
    assert cluster.env.now == pytest.approx(slower * quiet, rel=REL)
    assert cluster.traffic.local_bytes == 2 * 8_000_000 and cluster.traffic.wire_bytes == 0


def test_a_ring_on_one_machine_needs_the_allreduce_calibration():
    cluster = Cluster(1, cores=2, link=Link(1e9, 0.0))
    with pytest.raises(ConfigError, match="all-reduce"):
        cluster.run(cluster.env.process(ring_allreduce(cluster, [0, 0], 1000)))


# --- sync ----------------------------------------------------------------------------------

N_PARAMS = 1_000_000  # 4 MB of fp32 gradient


def sync_setting(overrides, machines, steps, bandwidth=1e8, latency=1e-4, **cal_options):
    config = load_config("configs/mnist_sync.toml", overrides)
    cal = calibration(config, N_PARAMS, 1e-3, **cal_options)
    link = Link(bandwidth, latency)
    return config, Setting(cal, machines=machines, cores=2, link=link, steps=steps)


def test_sync_allreduce_one_bucket_after_backward():
    n, steps, bandwidth, latency, opt = 2, 3, 1e8, 1e-4, 0.004
    config, setting = sync_setting([], n, steps, bandwidth, latency, optimizer_s=opt)
    result = SyncSim(config, setting).run()
    compute = 1e-3 * 128 / n
    ring = 2 * (n - 1) * (latency + 4 * N_PARAMS / n / bandwidth)
    assert result.extra["buckets"] == 1
    assert result.step_s == pytest.approx(compute + ring + opt, rel=REL)
    assert result.wire_bytes == steps * 2 * (n - 1) * 4 * N_PARAMS
    assert result.bytes_by_kind == {"allreduce": result.wire_bytes}


def test_sync_allreduce_after_compute_pays_the_lockstep_extra():
    """The calibrated extra of an all-reduce after compute (here: 0 after 10 ms of compute,
    rising linearly to 4 ms after 200 ms) lengthens every step by its value at the compute
    before the bucket: the first step's forward and backward, later ones the optimizer's
    step too."""
    n, steps, bandwidth, latency, opt = 2, 3, 1e8, 1e-4, 0.004
    config, setting = sync_setting([], n, steps, bandwidth, latency, optimizer_s=opt)
    lockstep = LockstepCost(measured_bytes=[1], gaps_s=[0.01, 0.2], extra_s=[[0.0, 4e-3]])
    setting.calibration.lockstep["allreduce"] = lockstep
    result = SyncSim(config, setting).run()
    compute = 1e-3 * 128 / n
    ring = 2 * (n - 1) * (latency + 4 * N_PARAMS / n / bandwidth)
    first = lockstep.extra(compute, 4 * N_PARAMS)
    later = lockstep.extra(opt + compute, 4 * N_PARAMS)
    assert 0 < first < later < 4e-3
    total = steps * (compute + ring + opt) + first + (steps - 1) * later
    assert result.step_s == pytest.approx(total / steps, rel=REL)


def test_lockstep_extra_between_and_beyond_the_measured_points():
    cost = LockstepCost(
        measured_bytes=[1_000, 100_000],
        gaps_s=[1e-3, 2e-3, 3e-3],
        extra_s=[[1e-3, 2e-3, 3e-3], [3e-3, 3e-3, 3e-3]],  # a line; a constant
    )
    assert cost.extra(2.5e-3, 1_000) == pytest.approx(2.5e-3)
    assert cost.extra(10.0, 1_000) == pytest.approx(3e-3)  # constant beyond the last gap
    assert cost.extra(0.5e-3, 1_000) == pytest.approx(0.5e-3)  # to 0 below the first
    assert cost.extra(0.0, 1_000) == 0.0
    assert cost.extra(2e-3, 10_000) == pytest.approx(2.5e-3)  # halfway in log(bytes)
    assert cost.extra(2e-3, 1e9) == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="one row per measured_bytes"):
        LockstepCost(measured_bytes=[1, 2], gaps_s=[1.0], extra_s=[[0.0]])
    with pytest.raises(ValueError, match="ascending"):
        LockstepCost(measured_bytes=[1], gaps_s=[2.0, 1.0], extra_s=[[0.0, 0.0]])
    with pytest.raises(ValueError, match="two distinct gaps"):
        LockstepCost(measured_bytes=[1], gaps_s=[1.0], extra_s=[[0.0]])
    assert cost.extra_core(2e-3, 1_000) == 0.0  # a collective's extra keeps no cores busy
    calls = cost.model_copy(update={"extra_core_s": [[2e-3, 4e-3, 6e-3], [1e-3, 1e-3, 1e-3]]})
    calls = LockstepCost.model_validate(calls.model_dump())  # the lines are fitted anew
    assert calls.extra_core(2.5e-3, 1_000) == pytest.approx(5e-3)
    assert calls.extra_core(0.5e-3, 100_000) == pytest.approx(0.5e-3)
    assert calls.extra(2.5e-3, 1_000) == pytest.approx(2.5e-3)
    with pytest.raises(ValueError, match="extra_core_s needs one row"):
        LockstepCost(
            measured_bytes=[1], gaps_s=[1.0, 2.0], extra_s=[[0.0, 0.0]], extra_core_s=[[0.0]]
        )


@pytest.mark.parametrize("latency", [1e-5, 2e-3])
def test_sync_buckets_overlap_backward(latency):
    """4 buckets of 1 MB (cap 1 MiB), ready every backward/4: the ring of each bucket either
    hides behind the next quarter of backward (short), or the rings queue up (long)."""
    n, bandwidth = 2, 1e9
    config, setting = sync_setting([], n, 2, bandwidth, latency)
    result = SyncSim(config, setting, bucket_cap_mb=1.0).run()
    compute = 1e-3 * 128 / n
    forward, backward = compute / 3, compute * 2 / 3
    ring = 2 * (n - 1) * (latency + 4 * N_PARAMS / 4 / n / bandwidth)
    assert result.extra["buckets"] == 4
    if ring <= backward / 4:
        expected = forward + backward + ring
    else:
        expected = forward + backward / 4 + 4 * ring
    assert result.step_s == pytest.approx(expected, rel=REL)
    assert result.extra["exposed_communication_s"] == pytest.approx(expected - compute, rel=REL)


def test_sync_backward_takes_the_measured_share_of_a_step():
    """With a measured backward share (a quarter here, not the default two thirds), the
    buckets become ready over that quarter of the step: the rings queue up behind a
    shorter backward."""
    n, bandwidth, latency = 2, 1e9, 2e-3
    config, setting = sync_setting([], n, 2, bandwidth, latency, backward_fraction=0.25)
    result = SyncSim(config, setting, bucket_cap_mb=1.0).run()
    compute = 1e-3 * 128 / n
    forward, backward = compute * 0.75, compute * 0.25
    ring = 2 * (n - 1) * (latency + 4 * N_PARAMS / 4 / n / bandwidth)
    assert ring > backward / 4
    assert result.step_s == pytest.approx(forward + backward / 4 + 4 * ring, rel=REL)


@pytest.mark.parametrize(("forward_s", "backward_s"), [(0.002, 0.006), (0.006, 0.002)])
def test_the_backward_share_is_measured_apart_from_forward(forward_s, backward_s):
    """`_Stepper.backward_fraction` times the forward pass (and loss) and backward apart:
    a step of 2 ms forward and 6 ms backward is three quarters backward, the reverse a
    quarter (sleeps overshoot a little on a busy machine: a margin either way)."""
    import time

    import torch

    from scaleout.sim.measure_compute import _Stepper

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(backward_s)
            return grad

    def step(model, network, batch, phase):
        time.sleep(forward_s)
        return SlowBackward.apply(torch.ones(1, requires_grad=True)).sum(), {}

    config = load_config(
        "configs/mnist_sync.toml",
        ["run.device=cpu", "model.sizes=[784,16,10]", "model.dropout=[0.2,0.5]"],
    )
    stepper = _Stepper(config)
    stepper.objective.step = step
    stepper.next_batch = lambda: ()  # the step above takes no data
    share = backward_s / (forward_s + backward_s)
    assert stepper.backward_fraction(5) == pytest.approx(share, abs=0.12)


def test_sync_average_every_two_steps():
    n, steps, bandwidth, latency, opt = 4, 4, 1e8, 1e-4, 0.002
    overrides = ['sync.mode="average"', "sync.average_every=2"]  # momentum: 1 state float
    config, setting = sync_setting(
        overrides, n, steps, bandwidth, latency, optimizer_s=opt, flatten_bytes_per_s=1e9
    )
    result = SyncSim(config, setting).run()
    nbytes = 4 * N_PARAMS * 2  # parameters and momentum

    def ring(size):
        return 2 * (n - 1) * (latency + size / n / bandwidth)

    def average(size):  # flatten, all-reduce, scale and copy back
        return size / setting.calibration.flatten_bytes_per_s + ring(size)

    # after the last step the driver evaluates (the workers average their weights first)
    # and checkpoints (they average weights and momentum first)
    averages = steps // 2 + 1
    expected = steps * (1e-3 * 128 / n + opt) + averages * average(nbytes) + average(4 * N_PARAMS)
    assert result.run_s == pytest.approx(expected, rel=REL)
    assert result.wire_bytes == 2 * (n - 1) * (averages * nbytes + 4 * N_PARAMS)
    # examples/s as `scaleout train` stamps it: up to the last chunk's answer, before the
    # final evaluation's and checkpoint's averaging
    trained = expected - average(4 * N_PARAMS) - average(nbytes)
    assert result.examples_per_s == pytest.approx(steps * 128 / trained, rel=REL)


@pytest.mark.parametrize(("loader_workers", "load_share"), [(0, 0.2), (1, 0.2), (1, 0.9)])
def test_sync_parallel_loading(loader_workers, load_share):
    """One worker, loading a part of its calibrated step: in the step itself without loader
    processes; with one, beside the step on the machine's other core, so a step takes the
    longer of the two (the first waits for its batch; 40 steps less 20 cancel it). Loading
    can be at most forward's share of the step."""
    overrides = ["sync.num_workers=1", f"loader.workers={loader_workers}"]
    config = load_config("configs/mnist_sync.toml", overrides)
    cal = calibration(config, N_PARAMS, 1e-3)
    cal.models[model_key(config)].load_s = load_share * 1e-3
    step = 1e-3 * 128
    load = min(load_share, 1 / 3) * step
    trained = {}
    for steps in (20, 40):
        setting = Setting(cal, machines=1, cores=2, link=Link(1e9, 0.0), steps=steps)
        result = SyncSim(config, setting).run()
        trained[steps] = steps * 128 / result.steady_examples_per_s
    expected = step if loader_workers == 0 else max(step - load, load)
    assert (trained[40] - trained[20]) / 20 == pytest.approx(expected, rel=REL)


def test_sync_average_priced_by_the_measured_average():
    """Two workers of one machine average weights and momentum every step: the measured
    two-process `average_tensors` (all-reduce and the local work around it), not one
    process's flattening speed."""
    overrides = ['sync.mode="average"']
    config = load_config("configs/mnist_sync.toml", overrides)
    allreduce = MessageCost(fixed_s=1e-3, bytes_per_s=1e9)
    cal = calibration(config, N_PARAMS, 1e-3, allreduce=allreduce, flatten_bytes_per_s=1e30)
    cal.average = MessageCost(fixed_s=2e-3, bytes_per_s=4e8)
    setting = Setting(cal, machines=1, cores=2, link=Link(1e9, 0.0), steps=4)
    result = SyncSim(config, setting).run()
    nbytes = 4 * N_PARAMS * 2  # parameters and momentum
    local = cal.average.seconds(nbytes) - allreduce.seconds(nbytes)
    assert local > 0
    # a two-rank ring on one machine takes the calibrated all-reduce (no core measured:
    # each rank's call keeps one core busy, so the two fit on the two cores)
    per_step = 1e-3 * 64 + local + allreduce.seconds(nbytes)
    assert per_step == pytest.approx(1e-3 * 64 + cal.average.seconds(nbytes), rel=REL)
    assert 4 * 128 / result.steady_examples_per_s == pytest.approx(4 * per_step, rel=REL)


def test_ddp_buckets_match_torch():
    """The buckets DDP itself builds (from its second step) for two MLPs."""
    dist = pytest.importorskip("torch.distributed")
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from scaleout.comm import free_port
    from scaleout.sim.sync import ddp_buckets

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        for sizes in ([784, 1024, 1024, 10], [784, 256, 10], [784, 2048, 2048, 2048, 10]):
            layers = [torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False)]
            model = torch.nn.Sequential(*layers)
            ddp = DistributedDataParallel(model)
            for _ in range(2):
                ddp(torch.randn(4, sizes[0])).sum().backward()
            real = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
            assert ddp_buckets([p.numel() for p in model.parameters()]) == real
    finally:
        dist.destroy_process_group()


def test_sync_ddp_buckets_copy_and_overlap():
    """Buckets from the tensor sizes; each is copied in, reduced, scaled and copied back
    (priced as `average_tensors`' local work) while backward goes on."""
    n, bandwidth, latency, flatten = 2, 1e9, 1e-4, 2e9
    numels = [600_000, 150_000, 250_000]  # 1 MB < 1 MiB: the last two make the first bucket
    config, setting = sync_setting(
        [], n, 2, bandwidth, latency, flatten_bytes_per_s=flatten, parameter_numels=numels
    )
    result = SyncSim(config, setting).run()
    assert result.extra["buckets"] == 2
    compute = 1e-3 * 128 / n
    forward, backward = compute / 3, compute * 2 / 3

    def bucket(numel):  # copies, then the ring
        return 4 * numel / flatten + 2 * (n - 1) * (latency + 4 * numel / n / bandwidth)

    first_ready = forward + backward * 400_000 / N_PARAMS
    expected = max(first_ready + bucket(400_000), forward + backward) + bucket(600_000)
    assert result.step_s == pytest.approx(expected, rel=REL)


def test_sync_8bit_gathers_codes():
    n, bandwidth, latency = 2, 1e8, 1e-4
    ns = CodecCost(sizes=[1000], encode_ns=[2.0], decode_ns=[3.0])
    config, setting = sync_setting(
        ['compress.codec="dynamic8"'], n, 1, bandwidth, latency, codecs={"dynamic8": ns}
    )
    result = SyncSim(config, setting).run()
    packed = N_PARAMS + 4 + 1  # one code byte per value, one float32 scale, a flag byte
    expected = (
        1e-3 * 128 / n
        + 2e-9 * N_PARAMS
        + (n - 1) * (latency + packed / bandwidth)
        + n * 3e-9 * N_PARAMS
    )
    assert result.step_s == pytest.approx(expected, rel=REL)
    assert result.wire_bytes == (n - 1) * n * packed


@pytest.mark.parametrize(
    ("link", "encode_ns", "coded"), [("100mbit", 2.0, True), ("10gbit", 2e3, False)]
)
def test_sync_on_a_link_takes_the_hooks_choice(link, encode_ns, coded):
    """With `compress.link` a bucket is priced as the hook sends it: 8-bit where the
    calibrated codec makes that faster on the link, else raw, as fp32 is."""
    ns = {"dynamic8": CodecCost(sizes=[1000], encode_ns=[encode_ns], decode_ns=[3.0])}
    overrides = ['compress.codec="dynamic8"', f'compress.link="{link}"']
    config, setting = sync_setting(overrides, 2, 1, codecs=ns)
    result = SyncSim(config, setting).run()
    same = ['compress.codec="dynamic8"'] if coded else []
    reference = SyncSim(*sync_setting(same, 2, 1, codecs=ns)).run()
    assert result.step_s == pytest.approx(reference.step_s, rel=REL)
    assert result.wire_bytes == reference.wire_bytes


def test_sync_workers_on_one_machine_share_it():
    cost = MessageCost(fixed_s=5e-4, bytes_per_s=1e9)
    config, setting = sync_setting([], 1, 2, allreduce=cost)
    result = SyncSim(config, setting).run()  # 2 workers, 2 cores
    assert result.extra["workers"] == 2
    assert result.step_s == pytest.approx(1e-3 * 64 + cost.seconds(4 * N_PARAMS), rel=REL)
    assert result.wire_bytes == 0 and result.local_bytes == 2 * 2 * 4 * N_PARAMS


def test_sync_batch_must_split_over_the_machines():
    config, setting = sync_setting([], 3, 1)
    with pytest.raises(ConfigError, match="multiple"):
        SyncSim(config, setting)


def test_driver_chunks_follow_the_cadence():
    config = load_config(
        "configs/mnist_sync.toml",
        ["train.log_every=4", "train.eval_every=6", "train.checkpoint_every=8"],
    )
    assert driver_chunks(10, config.train) == [
        (4, False, False),
        (2, True, False),
        (2, False, True),
        (2, True, True),
    ]
    # a layer-wise model's phases end at 5 and 10: a chunk ends there, evaluates and saves
    assert driver_chunks(15, config.train, [5, 10, 15]) == [
        (4, False, False),
        (1, True, True),
        (1, True, False),
        (2, False, True),
        (2, True, True),
        (2, True, False),
        (3, True, True),
    ]


# --- Sandblaster ---------------------------------------------------------------------------

C = 0.1  # seconds per portion of 1000 examples


def sandblaster(replicas, portions, backups, slow=None, steps=1):
    config = load_config(
        "configs/mnist_sandblaster.toml",
        [
            f"sandblaster.num_replicas={replicas}",
            f"sandblaster.batch_size={1000 * portions}",
            f"sandblaster.backup_tasks={str(backups).lower()}",
        ],
    )
    cal = calibration(config, 7850, C / 1000, cores=replicas)
    setting = Setting(cal, machines=1, cores=replicas, steps=steps)
    return SandblasterSim(config, setting, slow=slow).run()


@pytest.mark.parametrize(("replicas", "portions"), [(2, 4), (3, 4), (4, 4), (2, 7)])
@pytest.mark.parametrize("backups", [True, False])
def test_sandblaster_pass_without_straggler(replicas, portions, backups):
    """The initial evaluation and one iteration: two passes of ceil(P/R) rounds each."""
    result = sandblaster(replicas, portions, backups)
    rounds = math.ceil(portions / replicas) * C
    assert result.step_s == pytest.approx(rounds, rel=REL)
    assert result.run_s == pytest.approx(2 * rounds, rel=REL)
    assert result.extra["evaluations"] == 2


def test_sandblaster_straggler_without_backups():
    """R=2, P=4, replica 1 k=5 times slower: the fast replica does 3 portions (3c), the
    straggler one (5c); each pass ends with the straggler's portion, at k*c."""
    k = 5.0
    result = sandblaster(2, 4, backups=False, slow={1: k})
    assert result.step_s == pytest.approx(k * C, rel=REL)
    assert result.run_s == pytest.approx(2 * k * C, rel=REL)
    assert result.extra["backups"] == 0 and result.extra["duplicates"] == 0


def test_sandblaster_straggler_with_backups():
    """R=2, P=4, k=5. Pass 1: the fast replica does p0, p2, p3 (to 3c), then a copy of the
    straggler's p1, which wins at 4c. Pass 2 (from 4c): the straggler computes its losing
    copy until 5c, the fast replica p0 (to 5c); then one takes p1 and the other p2 (the
    straggler's takes 5c more), the fast one p3 (to 7c) and a copy of the straggler's portion,
    which wins at 8c: 4c per pass instead of 5c."""
    k = 5.0
    result = sandblaster(2, 4, backups=True, slow={1: k})
    assert result.run_s == pytest.approx(8 * C, rel=REL)
    assert result.step_s == pytest.approx(4 * C, rel=REL)
    assert result.extra["backups"] == 2
    assert result.extra["duplicates"] == 1  # pass 1's losing copy; pass 2's never ends


def test_sandblaster_slow_replica_must_exist():
    with pytest.raises(ValueError, match="does not exist"):
        sandblaster(2, 4, backups=True, slow={2: 3.0})


def test_allreduce_sizes_cover_what_sync_reduces():
    from scaleout.sim.measure_calls import ALLREDUCE_SIZES, allreduce_sizes

    sync = load_config("configs/mnist_sync.toml")  # momentum: one state float per weight
    downpour = load_config("configs/mnist_downpour.toml")
    numels = [784 * 1024, 1024, 1024 * 1024, 1024, 1024 * 10, 10]
    cost = ModelCost(
        num_parameters=sum(numels),
        batch_size=128,
        train_s={1: 1e-4},
        eval_s=1e-6,
        parameter_numels=numels,
    )
    sizes = allreduce_sizes([sync, downpour], {model_key(sync): cost})
    expected = {*ALLREDUCE_SIZES, sum(numels), 2 * sum(numels), 1_059_850, 803_840}
    assert sizes == sorted(expected)
    assert allreduce_sizes([downpour], {model_key(downpour): cost}) == list(ALLREDUCE_SIZES)


def test_a_calibration_on_a_busy_machine_says_so():
    from scaleout.sim.calibrate import contended

    def cost(together: float) -> ModelCost:
        return ModelCost(
            num_parameters=10,
            batch_size=1,
            train_s={1: 1e-3},
            eval_s=1e-6,
            concurrent_s={1: 1e-3, 2: together},
        )

    assert contended({"quiet": cost(1.05e-3)}) is None
    assert "1.39x" in contended({"quiet": cost(1.0e-3), "busy": cost(1.39e-3)})


def test_shard_updates_are_priced_per_value_for_every_optimizer():
    """Measured as a shard meets them (cold, a new gradient each): every optimizer has a
    price, and Adagrad's step, which reads and writes its state too, costs more than SGD's.
    At a shard's size (1M values): fused, Adagrad is only 12-20% dearer (0.80-0.86 against
    0.70-0.72 ns/value here), which 200k values and 9 repeats did not always show."""
    from scaleout.sim.calibrate import OPTIMIZERS, measure_apply

    prices = measure_apply(numel=1_000_000, repeats=15)
    assert set(prices) == set(OPTIMIZERS)
    assert all(0 < ns < 1_000 for ns in prices.values()), prices
    assert prices["adagrad"] > prices["sgd"], prices


def test_a_replicas_zeroing_is_timed_after_a_step(monkeypatch):
    """`zero_after_step` zeroes a buffer of the model's size right after each training
    step (a replica's after a push, its gradient cold), never twice in a row."""
    import torch

    from scaleout.sim.measure_compute import _Stepper, zero_after_step

    config = load_config(
        "configs/mnist_downpour.toml", ["model.sizes=[784,16,10]", "model.dropout=[0.2,0.5]"]
    )
    stepper = _Stepper(config)
    events: list[str] = []
    step, zero = stepper.step, torch.Tensor.zero_
    monkeypatch.setattr(stepper, "step", lambda *a: (events.append("step"), step(*a))[1])

    def spied(tensor):
        if tensor.numel() == 784 * 16 + 16 + 16 * 10 + 10:
            events.append("zero")
        return zero(tensor)

    monkeypatch.setattr(torch.Tensor, "zero_", spied)
    seconds = zero_after_step(stepper, 4)
    assert 0 < seconds < 0.01
    assert events.count("zero") == 5 and "zero zero" not in " ".join(events)
    assert events[0] == "step" and events[-1] == "zero"


def test_the_optimizer_is_timed_after_a_fresh_step(monkeypatch):
    """The calibration times the optimizer as a sync worker runs it: each timed step comes
    after zeroing the gradients and a new forward and backward pass, not back to back on
    one warm gradient (which runs from the caches and costs less)."""
    import scaleout.nn.optim as optim
    from scaleout.sim.measure_compute import _Stepper, optimizer_after_step

    config = load_config(
        "configs/mnist_sync.toml",
        ["run.device=cpu", "model.sizes=[784,16,10]", "model.dropout=[0.2,0.5]"],
    )
    stepper = _Stepper(config)
    events: list[str] = []
    step = stepper.step
    monkeypatch.setattr(stepper, "step", lambda *a: (events.append("pass"), step(*a))[1])
    build = optim.build_optimizer

    def spied(params, train):
        optimizer = build(params, train)
        zero, update = optimizer.zero_grad, optimizer.step
        optimizer.zero_grad = lambda **kw: (events.append("zero"), zero(**kw))[1]

        def timed_step():
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
            events.append("update" if all(g is not None for g in grads) else "no gradient")
            return update()

        optimizer.step = timed_step
        return optimizer

    monkeypatch.setattr(optim, "build_optimizer", spied)
    assert optimizer_after_step(stepper, 3) > 0
    assert events == ["zero", "pass", "update"] * 4  # the first builds the state, untimed
