"""Optimizers and learning-rate schedules: each schedule equals torch's own schedulers (or
its closed form) at every step, warm-up is on by default for Adagrad only and counts the
updates' steps, AdamW and the fused kernels equal torch.optim's, and a factory's optimizer
is checked to step element by element before it runs on parameter-server shards."""

import math

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR

from scaleout.errors import ConfigError
from scaleout.nn.optim import (
    OptimizerSpec,
    build_optimizer,
    check_elementwise,
    warmup_steps,
)
from scaleout.nn.schedule import Schedule, apply_lr
from scaleout.train.config import TrainSection
from scaleout.train.step import schedule_for
from tests.whole_tensor_optim import lamb


def run(optimizer, model, steps, schedule=None, seed=0, start=0):
    losses = []
    g = torch.Generator().manual_seed(seed)
    for k in range(start, start + steps):
        x = torch.randn(32, 20, generator=g)
        y = (x[:, :5].sum(1) > 0).long()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if schedule is not None:
            apply_lr(optimizer, schedule, k)
        optimizer.step()
        losses.append(loss.item())
    return losses


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def rates(schedule: Schedule, steps: int, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return [apply_lr(opt, schedule, k) for k in range(steps)]


def torch_rates(scheduler_for, steps: int, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = scheduler_for(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_cosine_equals_torch_warmup_then_cosine_annealing(warmup):
    total, m = 50, 0.1

    def torch_schedule(opt):
        cosine = CosineAnnealingLR(opt, T_max=total - warmup, eta_min=0.1 * m)
        if warmup == 0:
            return cosine
        ramp = LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        return SequentialLR(opt, [ramp, cosine], milestones=[warmup])

    ours = rates(Schedule("cosine", warmup, total, min_lr_ratio=m), total)
    theirs = torch_rates(torch_schedule, total)
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)


def test_linear_equals_torch_linear_decay():
    total, warmup, m = 40, 5, 0.25

    def torch_schedule(opt):
        ramp = LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        decay = LinearLR(opt, start_factor=1.0, end_factor=m, total_iters=total - warmup)
        return SequentialLR(opt, [ramp, decay], milestones=[warmup])

    ours = rates(Schedule("linear", warmup, total, min_lr_ratio=m), total)
    assert ours == pytest.approx(torch_rates(torch_schedule, total), rel=1e-9, abs=1e-12)


def test_every_schedule_equals_its_closed_form_at_every_step():
    total, warmup, decay, m, lr = 100, 10, 30, 0.05, 0.3
    for kind in ("constant", "cosine", "linear", "wsd"):
        got = rates(Schedule(kind, warmup, total, decay, m), total, lr)
        for k, value in enumerate(got):
            if k < warmup:
                want = (k + 1) / warmup
            elif kind == "constant":
                want = 1.0
            elif kind == "wsd":
                want = 1.0 if k < total - decay else m + (1 - m) * (1 - (k - 70) / decay)
            else:
                p = (k - warmup) / (total - warmup)
                cos = 0.5 * (1 + math.cos(math.pi * p))
                want = m + (1 - m) * (cos if kind == "cosine" else 1 - p)
            assert value == pytest.approx(lr * want, rel=1e-12), (kind, k)
    wsd = Schedule("wsd", 0, 100)  # decay_steps None: the last fifth
    assert wsd.factor(79) == 1.0 and wsd.factor(80) == 1.0 and wsd.factor(90) == 0.5


def test_bad_schedules_are_one_line_errors():
    with pytest.raises(ValueError, match="not a schedule"):
        Schedule("cosinee")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_steps = 10 leaves no step"):
        Schedule("cosine", 10, 10)
    with pytest.raises(ValueError, match="decay_steps = 95 must lie in 1..90"):
        Schedule("wsd", 10, 100, 95)
    with pytest.raises(ConfigError, match="warmup_steps"):
        schedule_for(TrainSection(lr_schedule="linear", warmup_steps=50), 50)


def test_warmup_equals_torch_lambda_lr():
    ours_model, ref_model = model(), model()
    ours = build_optimizer(ours_model.parameters(), OptimizerSpec("adagrad", 0.1))
    schedule = Schedule(warmup_steps=7)
    ref = torch.optim.Adagrad(ref_model.parameters(), lr=0.1, fused=True)  # as ours on the CPU
    lambda_lr = LambdaLR(ref, lambda k: min(1.0, (k + 1) / 7))
    g = torch.Generator().manual_seed(1)
    for k in range(12):
        x = torch.randn(8, 20, generator=g)
        for net, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            if opt is ours:
                apply_lr(opt, schedule, k)
            opt.step()
        lambda_lr.step()
    for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_default_warmup_is_adagrad_only_and_counts_the_steps_of_an_update():
    assert warmup_steps(OptimizerSpec("adagrad")) == 200
    assert warmup_steps(OptimizerSpec("sgd")) == 0 and warmup_steps(OptimizerSpec("adamw")) == 0
    assert warmup_steps(OptimizerSpec("adagrad", warmup_steps=0)) == 0
    assert schedule_for(TrainSection(optimizer="adagrad"), 1000).warmup_steps == 200
    # a Downpour shard's update holds n_push steps: 200 updates are 600 steps at n_push = 3
    assert schedule_for(TrainSection(optimizer="adagrad"), 1000, 3).warmup_steps == 600
    given = TrainSection(optimizer="adagrad", warmup_steps=5)
    assert schedule_for(given, 1000, 3).warmup_steps == 5


def test_a_restored_optimizer_keeps_its_base_rate():
    """The rate is a function of the step: a state saved mid-warm-up and loaded into a new
    optimizer goes on from the same base, not from the warmed-up rate it held."""
    from scaleout.checkpoint import load_optimizer_state, optimizer_state

    schedule, net = Schedule(warmup_steps=10), model()
    first = build_optimizer(net.parameters(), OptimizerSpec("adagrad", 0.1))
    run(first, net, 4, schedule)
    tensors, meta = optimizer_state(first)
    again = build_optimizer(net.parameters(), OptimizerSpec("adagrad", 0.1))
    load_optimizer_state(again, tensors, meta)
    run(again, net, 1, schedule, start=4)
    assert again.param_groups[0]["lr"] == pytest.approx(0.1 * 5 / 10)


def test_adagrad_loss_no_longer_blows_up_at_the_start():
    """Adagrad's first step moves every weight by about lr at once: on a 200-512-512-10
    net with inputs in [0, 1] the loss doubles without warm-up; with the default warm-up
    it falls from the first step."""

    def net():
        torch.manual_seed(0)
        sizes = [200, 512, 512, 10]
        layers = []
        for a, b in zip(sizes, sizes[1:], strict=False):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])

    def losses(warmup):
        m, g = net(), torch.Generator().manual_seed(0)
        spec = OptimizerSpec("adagrad", 0.01, warmup_steps=warmup)
        opt = build_optimizer(m.parameters(), spec)
        schedule = Schedule(warmup_steps=warmup_steps(spec))
        teacher, out = torch.randn(200, 10, generator=g), []
        for k in range(8):
            x = torch.rand(64, 200, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), (x @ teacher).argmax(1))
            loss.backward()
            apply_lr(opt, schedule, k)
            opt.step()
            out.append(loss.item())
        return out

    cold, warm = losses(0), losses(None)
    assert cold[1] > 1.5 * cold[0]
    assert all(b < a for a, b in zip(warm, warm[1:], strict=False))


def test_fused_steps_equal_torch_fused_adamw_included():
    """`build_optimizer` picks torch's one-pass kernels where they exist; the steps equal
    torch.optim's fused ones bit for bit (the unfused ones differ by an ulp). AdamW's
    betas, eps and decoupled weight decay come from the options."""
    cases = (
        ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True), {}),
        ("adam", lambda p: torch.optim.Adam(p, lr=0.1, fused=True), {}),
        (
            "adamw",
            lambda p: torch.optim.AdamW(
                p, lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, fused=True
            ),
            {"betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1},
        ),
    )
    for name, reference, options in cases:
        ours_model, ref_model = model(), model()
        ours = build_optimizer(ours_model.parameters(), OptimizerSpec(name, 0.1, **options))
        assert ours.defaults["fused"] is True
        ref = reference(ref_model.parameters())
        run(ours, ours_model, 5)
        run(ref, ref_model, 5)
        for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    sgd = build_optimizer(model().parameters(), OptimizerSpec("sgd", 0.1))
    assert not sgd.defaults.get("fused")  # SGD's fused step is no faster here


def test_a_group_of_a_generator_keeps_its_parameters():
    """`{"params": model.parameters()}` (a generator) is looked at for the fused step and
    still handed to torch whole."""
    net = model()
    opt = build_optimizer([{"params": net.parameters()}], OptimizerSpec("adagrad", 0.1))
    assert [len(g["params"]) for g in opt.param_groups] == [len(list(net.parameters()))]
    assert opt.defaults["fused"] is True


# --- factories --------------------------------------------------------------------------------


def test_a_factory_builds_the_optimizer_and_its_rate_is_the_base():
    made = []

    def factory(params):
        made.append(params)
        return torch.optim.AdamW(params, lr=0.02)

    net = model()
    opt = build_optimizer(net.parameters(), OptimizerSpec(factory))
    assert isinstance(opt, torch.optim.AdamW) and len(made) == 1
    assert apply_lr(opt, Schedule("linear", 0, 10), 5) == pytest.approx(0.01)


def test_factories_that_fail_are_one_line():
    with pytest.raises(ConfigError, match="returned a list, not a torch.optim.Optimizer"):
        build_optimizer(model().parameters(), OptimizerSpec(lambda params: list(params)))
    with pytest.raises(ConfigError, match="raised RuntimeError: boom"):

        def broken(params):
            raise RuntimeError("boom")

        build_optimizer(model().parameters(), OptimizerSpec(broken))


def test_element_wise_optimizers_pass_and_whole_tensor_ones_are_named():
    for factory in (
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.RAdam(p, lr=0.01),
        lambda p: torch.optim.Adamax(p, lr=0.01),
    ):
        check_elementwise(OptimizerSpec(factory))
    check_elementwise(OptimizerSpec("adamw"))  # by name: element-wise by construction
    with pytest.raises(ConfigError, match="does not step element by element.*moved differently"):
        check_elementwise(OptimizerSpec(lamb))
    with pytest.raises(ConfigError, match="does not step element by element.*on a 1-D slice"):
        check_elementwise(OptimizerSpec(lambda p: torch.optim.Muon(p, lr=0.01)))


# --- a parameter-server shard's schedule ----------------------------------------------------


@pytest.fixture
def one_thread_after():
    threads = torch.get_num_threads()  # a shard sets one thread, as in its own process
    yield
    torch.set_num_threads(threads)


def test_a_shard_steps_at_the_rate_of_each_pushs_last_step(tmp_path, one_thread_after):
    """A push of n steps is applied at the schedule's rate of its last step, and the shard
    counts the steps its pushes carried, through a checkpoint too."""
    from scaleout.ps import ParameterShard, Wire

    spec = OptimizerSpec("sgd", lr=1.0, schedule=Schedule("linear", 0, 10))
    shard = ParameterShard(0, 4, spec, checkpoint_dir=str(tmp_path / "shard"))
    shard.initialize(torch.zeros(4).numpy(), step=0)
    shard.push(Wire().encode(torch.ones(4)), shard.version, "c", 1, 3)  # steps 0, 1, 2
    torch.testing.assert_close(shard.param.detach(), torch.full((4,), -0.8))  # lr(2) = 0.8
    shard.push(Wire().encode(torch.ones(4)), shard.version, "c", 2, 2)  # steps 3, 4
    torch.testing.assert_close(shard.param.detach(), torch.full((4,), -1.4))  # + lr(4) = 0.6
    assert shard.steps == 5
    shard.checkpoint()
    again = ParameterShard(0, 4, spec, checkpoint_dir=str(tmp_path / "shard"))
    assert again.steps == 5 and again.restored_version == 2
    started = ParameterShard(1, 4, spec)
    started.initialize(torch.zeros(4).numpy(), step=7)  # resumed from the driver's step 7
    started.push(Wire().encode(torch.ones(4)), 0, "c", 1, 1)
    torch.testing.assert_close(started.param.detach(), torch.full((4,), -0.3))  # lr(7)
