"""The simulations of models too big for one worker against hand-computable cases: FSDP's
collectives per block (sync.mode = "fsdp") and pipeline stages' schedules. Calibrations are
built by hand (`test_sim_strategies.calibration`): every cost a case does not exercise is
free, so the simulated times are sums of the few that remain."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from scaleout.api import load_config
from scaleout.parallel import fsdp
from scaleout.sim.calibration import CodecCost, MessageCost
from scaleout.sim.engine import Link
from scaleout.sim.pipeline import PipelineSim, schedule_order, stage_plans
from scaleout.sim.setting import Setting
from scaleout.sim.sync import SyncSim
from tests.unit.test_sim_strategies import calibration

FREE_LINK = Link(1e30, 0.0)


def setting_for(config, machines, steps, link, per_example_s=1e-3, **options):
    numel = sum(p.numel() for p in config.model.build().parameters())
    cal = calibration(config, numel, per_example_s, **options)
    return Setting(cal, machines=machines, cores=2, link=link, steps=steps)


# --- FSDP ---------------------------------------------------------------------------------


def fsdp_config(*overrides):
    return load_config(
        "configs/mnist_sync.toml",
        [
            "sync.mode=fsdp",
            'sync.fsdp_blocks=["Linear"]',  # the MLP's 3 layers, one block each
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
            *overrides,
        ],
    )


def test_fsdp_moves_two_gathers_and_a_reduce_scatter_per_block_from_the_librarys_plan():
    """On 2 machines: the root gathered once, each block twice (forward, then again for
    backward: resharded after forward), every unit's gradient reduce-scattered; each a
    ring of 1 step in which both ranks send the values `exchange_numels` plans."""
    config, steps = fsdp_config(), 3
    result = SyncSim(config, setting_for(config, 2, steps, Link(1e8, 1e-4))).run()
    units = fsdp.exchange_numels(config.model.build(), ["Linear"], 2)
    blocks = sum(numel for name, numel in units if name)
    root = dict(units)[""]
    per_step = 2 * 4 * (3 * blocks + 2 * root)  # both ranks send
    assert len(units) == 4
    gather_all = 2 * 4 * (blocks + root)  # the checkpoint's (no test set to evaluate)
    assert result.wire_bytes == steps * per_step + gather_all


def test_fsdp_collectives_run_one_at_a_time_and_the_compute_waits_for_them():
    """No compute to speak of: a step is its collectives back to back, each one ring step
    of one latency (the link is otherwise free), then the optimizer on half the values."""
    config, latency, opt, steps = fsdp_config(), 1e-3, 0.004, 2
    link = Link(1e30, latency)
    setting = setting_for(config, 2, steps, link, per_example_s=1e-12, optimizer_s=opt)
    units = len(fsdp.exchange_numels(config.model.build(), ["Linear"], 2))
    result = SyncSim(config, setting).run()
    step = 3 * (units - 1) * latency + opt / 2  # (the root holds nothing: no collective)
    after = (units - 1) * latency  # every block gathered for the checkpoint
    assert result.run_s == pytest.approx(steps * step + after, rel=1e-6)


def test_fsdp_on_a_free_link_costs_allreduces_compute_and_half_the_optimizer():
    opt = 0.004
    fsdp_run = fsdp_config()
    plain = load_config("configs/mnist_sync.toml", ["train.eval_every=1000"])
    sharded = SyncSim(fsdp_run, setting_for(fsdp_run, 2, 3, FREE_LINK, optimizer_s=opt)).run()
    whole = SyncSim(plain, setting_for(plain, 2, 3, FREE_LINK, optimizer_s=opt)).run()
    assert sharded.step_s == pytest.approx(whole.step_s - opt / 2, rel=1e-6)


# --- pipelines ----------------------------------------------------------------------------


class Shaped(nn.Sequential):
    input_shape = (8,)


def test_a_stage_plan_is_the_splits_flops_and_the_activation_it_sends():
    """Cut as `stages.split` cuts (the parameters balanced: 144 | 272 + 68, the earliest cut
    of two as good); forward FLOPs
    2 * in * out per Linear; the first stage sends its 16 values per example."""
    model = lambda: Shaped(  # noqa: E731
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )
    config = SimpleNamespace(model=SimpleNamespace(build=model), data=None)
    first, second = stage_plans(config, 2)
    assert (first.names, second.names) == (("0",), ("1", "2", "3", "4"))
    assert first.share == pytest.approx(256 / 896) and second.share == pytest.approx(640 / 896)
    assert (first.params, second.params) == (144, 340)
    assert (first.sends_per_example, second.sends_per_example) == (16, 0)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 5])
def test_1f1b_orders_each_pass_once_with_at_most_the_stages_left_in_flight(stages, microbatches):
    for stage in range(stages):
        order = schedule_order("1f1b", stage, stages, microbatches)
        assert sorted(order) == sorted(
            [f"F{i}" for i in range(microbatches)] + [f"B{i}" for i in range(microbatches)]
        )
        in_flight = 0
        for op in order:
            in_flight += 1 if op[0] == "F" else -1
            assert 0 <= in_flight <= stages - stage
        assert order.index(f"B{microbatches - 1}") > order.index(f"F{microbatches - 1}")


def pipeline_config(schedule, microbatches, *overrides):
    return load_config(
        "examples/fashion_cnn.toml",
        [
            'train.strategy="model_parallel"',
            "model_parallel.stages=2",
            f"model_parallel.microbatches={microbatches}",
            f'model_parallel.schedule="{schedule}"',
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
            *overrides,
        ],
    )


def gpipe_closed_form(forward, backward, microbatches):
    """A flow shop: a pass starts when its stage is free and its input has arrived."""
    stages = len(forward)
    done = [[0.0] * microbatches for _ in range(stages)]
    for s in range(stages):
        for i in range(microbatches):
            before = max(done[s - 1][i] if s else 0.0, done[s][i - 1] if i else 0.0)
            done[s][i] = before + forward[s]
    back = [[0.0] * microbatches for _ in range(stages)]
    for s in reversed(range(stages)):
        for i in range(microbatches):
            before = max(
                back[s + 1][i] if s < stages - 1 else 0.0,
                back[s][i - 1] if i else done[s][-1],
            )
            back[s][i] = before + backward[s]
    return max(row[-1] for row in back)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_gpipe_takes_the_flow_shops_time_and_1f1b_no_longer(microbatches):
    """On 2 machines joined by a free link: GPipe's step is the flow shop's (the bubble
    included); 1F1B's is no longer; one micro-batch leaves half the stage-time idle at
    best."""
    config = pipeline_config("gpipe", microbatches)
    sim = PipelineSim(config, setting_for(config, 2, 2, FREE_LINK))
    result = sim.run()
    expected = gpipe_closed_form(sim.forward_s, sim.backward_s, microbatches)
    assert result.step_s == pytest.approx(expected, rel=1e-6)
    other = pipeline_config("1f1b", microbatches)
    assert PipelineSim(other, setting_for(other, 2, 2, FREE_LINK)).run().step_s <= (
        result.step_s * (1 + 1e-9)
    )
    if microbatches == 1:
        assert result.extra["bubble"] >= 0.5 - 1e-9


def test_pipeline_messages_are_the_micro_batches_activations_and_their_gradients():
    microbatches, steps = 4, 2
    config = pipeline_config("1f1b", microbatches)
    sim = PipelineSim(config, setting_for(config, 2, steps, Link(1e9, 1e-5)))
    result = sim.run()
    micro = config.train.batch_size // microbatches
    sends = sim.plans[0].sends_per_example
    with torch.device("meta"):
        model = config.model.build()
    x = torch.empty(micro, 1, 28, 28, device="meta")
    for name in sim.plans[0].names:
        x = model.get_submodule(name)(x)
    assert micro * sends == x.numel()
    assert result.wire_bytes == steps * microbatches * 2 * 4 * x.numel()


def test_coded_pipeline_messages_are_the_payloads_a_stage_sends_and_cost_their_coding():
    """`compress.codec = "dynamic8"`: each crossing moves the payload the first stage's
    real activation encodes to (`encode_activation`), both ways; on a free link, a codec
    takes 1 ns a value to encode and to decode adds both to each stage's passes."""
    from scaleout.compress.activations import activation_codec, encode_activation

    microbatches, steps = 4, 2
    config = pipeline_config("gpipe", microbatches, 'compress.codec="dynamic8"')
    setting = setting_for(config, 2, steps, Link(1e9, 1e-5))
    free_codec = CodecCost(sizes=[1], encode_ns=[0.0], decode_ns=[0.0])
    setting.calibration.codecs["dynamic8"] = free_codec
    sim = PipelineSim(config, setting)
    result = sim.run()
    micro = config.train.batch_size // microbatches
    model, x = config.model.build(), torch.zeros(micro, 1, 28, 28)
    for name in sim.plans[0].names:
        x = model.get_submodule(name)(x)
    payload = encode_activation(x, activation_codec(config.compress.build()))
    assert payload.numel() < 0.26 * x.numel()  # 8-bit: about a quarter of fp32's bytes
    assert result.wire_bytes == steps * microbatches * 2 * 4 * payload.numel()
    uncoded = setting_for(config, 2, steps, FREE_LINK)
    uncoded.calibration.codecs["dynamic8"] = free_codec
    free = PipelineSim(config, uncoded)
    costly = setting_for(config, 2, steps, FREE_LINK)
    costly.calibration.codecs["dynamic8"] = CodecCost(sizes=[1], encode_ns=[1.0], decode_ns=[1.0])
    coded = PipelineSim(config, costly)
    for stage in range(2):
        added = coded.forward_s[stage] + coded.backward_s[stage]
        plain = free.forward_s[stage] + free.backward_s[stage]
        assert added == pytest.approx(plain + 2 * x.numel() * 1e-9)


def test_fsdp_adds_its_calibrated_local_work_to_every_step():
    """`ModelCost.fsdp_s` (FSDP2's hooks and copies, measured in one process) replaces the
    copies priced by bytes: on a free link each step is that much longer."""
    config, opt, steps = fsdp_config(), 0.004, 3
    plain = SyncSim(config, setting_for(config, 2, steps, FREE_LINK, optimizer_s=opt)).run()
    setting = setting_for(config, 2, steps, FREE_LINK, optimizer_s=opt)
    cost = next(iter(setting.calibration.models.values()))
    cost.fsdp_s = 0.006
    priced = SyncSim(config, setting).run()
    assert priced.run_s == pytest.approx(plain.run_s + steps * 0.006 + 0.006 / 3, rel=1e-6)


def test_two_workers_of_one_machine_take_the_calibrated_gather_and_reduce_scatter():
    """On one machine gloo's own collectives are priced as measured (its reduce-scatter
    costs more than the ring half of an all-reduce would): here 1 ms per all-gather and 2 ms
    per reduce-scatter, back to back when there is no compute to hide them behind."""
    config, opt, steps = fsdp_config(), 0.004, 2
    setting = setting_for(config, 1, steps, FREE_LINK, per_example_s=1e-12, optimizer_s=opt)
    setting.cores = 4.0
    setting.calibration.allgather = MessageCost(fixed_s=1e-3, bytes_per_s=1e30)
    setting.calibration.reduce_scatter = MessageCost(fixed_s=2e-3, bytes_per_s=1e30)
    units = len(fsdp.exchange_numels(config.model.build(), ["Linear"], 2))
    result = SyncSim(config, setting).run()
    step = 2 * (units - 1) * 1e-3 + (units - 1) * 2e-3 + opt / 2  # (the root holds nothing)
    assert result.run_s == pytest.approx(steps * step + (units - 1) * 1e-3, rel=1e-6)


def test_fsdp_with_a_codec_moves_its_payloads():
    """`compress.codec = "dynamic8"`: each collective moves the unit's packed payload
    (`layout`'s codes and scales, a flag byte) instead of its float32 values."""
    from scaleout.compress.payload import layout

    config, steps = fsdp_config('compress.codec="dynamic8"'), 2
    setting = setting_for(config, 2, steps, Link(1e8, 1e-4))
    free = CodecCost(sizes=[1], encode_ns=[0.0], decode_ns=[0.0])
    setting.calibration.codecs["dynamic8"] = free
    result = SyncSim(config, setting).run()
    units = fsdp.exchange_numels(config.model.build(), ["Linear"], 2)
    block = config.compress.block_size or 0

    def packed(numel: int) -> int:
        codes, scales = layout("dynamic8", numel, block)
        return codes + 4 * scales + 1

    per_step = sum((2 if name == "" else 3) * packed(numel) for name, numel in units if numel)
    checkpoint = sum(packed(numel) for _, numel in units if numel)
    assert result.wire_bytes == 2 * (steps * per_step + checkpoint)


def test_downpour_pipelines_have_no_simulation_yet_in_one_line():
    from scaleout.errors import ConfigError
    from scaleout.sim.simulate import simulation_for

    with pytest.raises(ConfigError, match='"downpour" with model_parallel.stages') as caught:
        simulation_for("downpour", pipelined=True)
    assert "\n" not in str(caught.value)


def test_a_weight_tied_across_stages_costs_an_allreduce_of_its_gradient_each_step():
    """The LM's token embedding is its output layer: the first and last stages each hold
    it, and each step sums its gradient over the pipeline (a ring of 2: each rank sends
    the whole fp32 gradient once)."""
    import dataclasses

    config = load_config(
        "examples/char_lm.toml",
        [
            'train.strategy="model_parallel"',
            "model_parallel.stages=2",
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
        ],
    )
    steps = 2
    tied = PipelineSim(config, setting_for(config, 2, steps, Link(1e8, 0.0)))
    model = config.model.build()
    assert tied.plans[0].tied == model.head.weight.numel()
    untied = PipelineSim(config, setting_for(config, 2, steps, Link(1e8, 0.0)))
    untied.plans = [dataclasses.replace(p, tied=0) for p in untied.plans]
    added = tied.run().wire_bytes - untied.run().wire_bytes
    assert added == steps * 2 * 4 * model.head.weight.numel()
