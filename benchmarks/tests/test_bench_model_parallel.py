"""Suite `model_parallel`: the update it times is the right computation, and its code paths
run end to end at a tiny size with sane rows (timings themselves are never asserted)."""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.model_parallel import (
    ExchangeMeter,
    Settings,
    Updater,
    joint_objective,
    network,
    plot,
    results,
)
from scaleout.comm import free_port
from scaleout.parallel import bytes_per_step, parallelize, parts

SIZE = 24  # 4x4 first-stack positions: the smallest input the suite's layout takes
BATCH = 3


def reference_joint(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every stack's objective through the generic autograd layers (`objective_reference`),
    fed the stack below's features with autograd on: the paper's update of all layers."""
    total, h = x.new_zeros(()), x
    for stack in net.stacks:
        total = total + stack.objective_reference(h).total
        h = stack(h)
    return total


def _joint_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x = torch.randn(BATCH, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
        reference = network(SIZE)
        expected = reference_joint(reference, x)
        expected.backward()
        part = parallelize(network(SIZE), (1, 2), rank)
        meter = ExchangeMeter()
        for composed in (False, True):
            part.zero_grad()
            with meter.metering():
                mine = joint_objective(part.stacks, x, composed)
                mine.backward()
                parts.sync_grads(part)
            total = mine.detach().clone()
            dist.all_reduce(total)  # the workers' parts add up to the whole objective
            torch.testing.assert_close(total, expected.detach(), rtol=1e-5, atol=0)
            for stack, ref in zip(part.stacks, reference.stacks, strict=True):
                want = ref.filter.weight.grad[stack.filter.units.slices]
                scale = want.abs().max().item()
                torch.testing.assert_close(
                    stack.filter.weight.grad, want, rtol=1e-4, atol=1e-5 * scale
                )
                torch.testing.assert_close(stack.alpha.grad, ref.alpha.grad, rtol=1e-4, atol=0)
            # gradients reach all
            assert all(s.filter.weight.grad.abs().sum() > 0 for s in part.stacks)
        assert meter.bytes_sent > 0 and meter.exchange_s >= meter.transfer_s > 0
        # the greedy step of stack 3: the measured payload is what bytes_per_step counts
        meter = ExchangeMeter()
        with meter.metering():
            part.zero_grad()
            part.train_only(2)
            part.stack_objective(x, 2).total.backward()
        assert meter.bytes_sent == bytes_per_step(part, 2, BATCH)
    finally:
        dist.destroy_process_group()


def test_joint_update_equals_single_process_gradients() -> None:
    mp.spawn(_joint_worker, args=(free_port(),), nprocs=2, join=True)


@pytest.mark.parametrize("composed", [False, True])
def test_single_process_joint_update_equals_reference(composed: bool) -> None:
    x = torch.randn(BATCH, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    reference, net = network(SIZE), network(SIZE)
    expected = reference_joint(reference, x)
    expected.backward()
    total = joint_objective(net.stacks, x, composed)
    total.backward()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for mine, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        scale = theirs.grad.abs().max().item()
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5 * scale)


def test_meter_restores_what_it_wraps() -> None:
    from scaleout.comm import darray

    before = (darray.exchange, dist.all_to_all_single)
    with ExchangeMeter().metering():
        assert darray.exchange is not before[0]
    assert (darray.exchange, dist.all_to_all_single) == before


def test_plain_updater_takes_a_momentum_step() -> None:
    net = network(SIZE)
    before = [p.detach().clone() for p in net.parameters()]
    Updater(net, lr=1e-3).step(torch.randn(BATCH, 1, SIZE, SIZE))
    assert all(not torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))


def test_settings_reject_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCALEOUT_BENCH_MP_SIZES", "24,40")
    monkeypatch.setenv("SCALEOUT_BENCH_MP_TIMED", "7")
    settings = Settings()
    assert settings.sizes == [24, 40] and settings.timed == 7
    with pytest.raises(ValueError, match="SIZES"):
        Settings(sizes=[16])
    with pytest.raises(ValueError, match="batch"):
        Settings(batch=0)


@pytest.mark.slow
def test_suite_runs_at_tiny_size(tmp_path: Path) -> None:
    settings = Settings(sizes=[SIZE, 32], batch=2, warmup=1, timed=2, train_steps=3, num_eval=8)
    rows, notes, scaling, runs = results(settings)
    by_name = {row.name: row for row in rows}
    assert len(by_name) == len(rows)
    for entry in scaling:
        summary = entry["summary"]
        assert entry["parameters"] == sum(p.numel() for p in network(entry["size"]).parameters())
        for name in (
            "1 worker",
            "1 worker, 2 threads",
            "1x1 partitioned",
            "1 worker, composed update",
        ):
            assert summary[name]["workers"] == 1 and summary[name]["bytes"] == 0
        assert summary["2x2"]["workers"] == 4
        for name in ("1x2", "1x2 dynamic8", "2x2", "1x2, composed update"):
            assert summary[name]["bytes"] > 0
            shares = summary[name]
            assert 0 <= shares["waiting_share"] <= shares["transfer_share"]
            assert 0 < shares["transfer_share"] <= shares["exchange_share"] < 1
            assert 0 < shares["cpu_busy"] < 4  # gloo's own threads count too
        # dynamic8: one byte per value, plus a float32 scale per block
        ratio = summary["1x2 dynamic8"]["bytes"] / summary["1x2"]["bytes"]
        assert 0.25 < ratio < 0.3
    label = "32px (1.7M params)"
    speedup = by_name[f"{label}: speedup over 1 worker, 1x2"]
    assert speedup.target == 1.7 and speedup.value > 0
    assert by_name[f"{SIZE}px (0.6M params): speedup over 1 worker, 1x2"].target is None
    assert set(runs) == {"single, data order 0", "single, data order 1", "1x2 fp32", "1x2 dynamic8"}
    for run in runs.values():
        assert len(run["curve"]) == 3 * settings.train_steps
        assert all(math.isfinite(v) and v > 0 for v in run["objective"])
    for name in ("1x2 fp32", "1x2 dynamic8"):
        assert runs[name]["bytes_measured"] == runs[name]["bytes_per_step"]
        assert all(b > 0 for b in runs[name]["bytes_measured"])
    # fp32 on 1x2 is the single process up to summation order
    single = runs["single, data order 0"]["objective"]
    torch.testing.assert_close(runs["1x2 fp32"]["objective"], single, rtol=1e-4, atol=0)
    differences = [row for row in rows if "dynamic8 vs fp32" in row.name]
    assert len(differences) == 3 and all(math.isfinite(r.value) for r in differences)
    assert all(r.target is not None and r.target > 0 for r in differences)
    assert any("bytes_per_step" in note for note in notes)
    plot(scaling, runs, tmp_path / "model_parallel.png")
    assert (tmp_path / "model_parallel.png").stat().st_size > 0
