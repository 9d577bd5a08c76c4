"""Learning-rate warm-up: equal to torch's LambdaLR, on by default for Adagrad only, kept
across a save and load of the optimizer's state, and what it is for: no blow-up at the
start of Adagrad."""

import torch
from torch.optim.lr_scheduler import LambdaLR

from scaleout.checkpoint import load_optimizer_state, optimizer_state
from scaleout.nn.optim import OptimizerSpec, build_optimizer, warmup_steps


def run(optimizer, model, steps, seed=0):
    losses = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 20, generator=g)
        y = (x[:, :5].sum(1) > 0).long()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def test_warmup_equals_torch_lambda_lr():
    ours_model, ref_model = model(), model()
    ours = build_optimizer(ours_model.parameters(), OptimizerSpec("adagrad", 0.1, warmup_steps=7))
    ref = torch.optim.Adagrad(ref_model.parameters(), lr=0.1, fused=True)  # as ours on the CPU
    schedule = LambdaLR(ref, lambda k: min(1.0, (k + 1) / 7))
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        x = torch.randn(8, 20, generator=g)
        for net, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
        schedule.step()
    for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_default_is_adagrad_only_and_zero_turns_it_off():
    assert warmup_steps(OptimizerSpec("adagrad")) == 200
    assert warmup_steps(OptimizerSpec("sgd")) == 0 and warmup_steps(OptimizerSpec("adam")) == 0
    assert warmup_steps(OptimizerSpec("adagrad", warmup_steps=0)) == 0
    net = model()
    plain = build_optimizer(net.parameters(), OptimizerSpec("adagrad", 0.1, warmup_steps=0))
    run(plain, net, 1)
    assert plain.param_groups[0]["lr"] == 0.1 and "warmup_step" not in plain.param_groups[0]


def test_after_the_warmup_the_rate_is_the_callers():
    net = model()
    opt = build_optimizer(net.parameters(), OptimizerSpec("sgd", 0.1, warmup_steps=3))
    run(opt, net, 3)
    assert opt.param_groups[0]["lr"] == 0.1
    opt.param_groups[0]["lr"] = 0.02  # e.g. a phase's own rate, or a scheduler's
    run(opt, net, 2)
    assert opt.param_groups[0]["lr"] == 0.02


def test_restored_state_does_not_warm_up_again():
    spec = OptimizerSpec("adagrad", 0.1, warmup_steps=10)
    net = model()
    first = build_optimizer(net.parameters(), spec)
    run(first, net, 4)
    tensors, meta = optimizer_state(first)
    again = build_optimizer(net.parameters(), spec)
    load_optimizer_state(again, tensors, meta)
    run(again, net, 1)
    assert again.param_groups[0]["lr"] == 0.1 * 5 / 10


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
        opt = build_optimizer(m.parameters(), OptimizerSpec("adagrad", 0.01, warmup_steps=warmup))
        teacher, out = torch.randn(200, 10, generator=g), []
        for _ in range(8):
            x = torch.rand(64, 200, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), (x @ teacher).argmax(1))
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    cold, warm = losses(0), losses(None)
    assert cold[1] > 1.5 * cold[0]
    assert all(b < a for a, b in zip(warm, warm[1:], strict=False))


def test_adagrad_and_adam_step_fused_on_the_cpu_and_equal_torch_fused():
    """`build_optimizer` picks torch's one-pass kernels where they exist; the steps equal
    torch.optim's fused ones bit for bit (the unfused ones differ by an ulp)."""
    for name, cls in (("adagrad", torch.optim.Adagrad), ("adam", torch.optim.Adam)):
        ours_model, ref_model = model(), model()
        ours = build_optimizer(ours_model.parameters(), OptimizerSpec(name, 0.1, warmup_steps=0))
        assert ours.defaults["fused"] is True
        ref = cls(ref_model.parameters(), lr=0.1, fused=True)
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
