"""FSDP's collectives with compressed payloads (`scaleout.compress.fsdp`), on two gloo
processes: the all-gather gives every rank each shard as the codec round-trips it, the
reduce-scatter each rank's own chunk exact plus the others' round-tripped, and a model
sharded with them gets gradients within the codec's few percent of torch's; an LM under
sync.mode = "fsdp" with `compress.codec = "dynamic8"` ends near fp32's loss."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from scaleout.compress import get
from scaleout.compress.fsdp import fsdp_comms
from scaleout.parallel import fsdp
from tests.unit.test_tied_weights import fit, lm_config


def _round_trip(codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x)).view(-1)


def _on_two_ranks(rank: int, port: int, failures) -> None:  # noqa: ANN001
    try:
        torch.manual_seed(0)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        codec = get("dynamic8")
        gather, scatter = fsdp_comms("dynamic8")
        # the all-gather: every rank gets every shard as the codec round-trips it
        shards = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        out = torch.empty(2000)
        assert gather(out, shards[rank], dist.group.WORLD) is None
        torch.testing.assert_close(out, torch.cat([_round_trip(codec, s) for s in shards]))
        # the reduce-scatter: my chunk exact, the other rank's chunk for me round-tripped
        grads = [
            torch.randn(2000, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)
        ]
        mine = torch.empty(1000)
        scatter(mine, grads[rank], dist.group.WORLD, dist.ReduceOp.AVG)
        other = grads[1 - rank].view(2, -1)[rank]
        expected = (grads[rank].view(2, -1)[rank] + _round_trip(codec, other)) / 2
        torch.testing.assert_close(mine, expected)
        # a model sharded with them: its gradients differ from torch's own collectives' (the
        # payloads are used) by the few percent 8-bit weights and gradients cost
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        coded, exact = copy.deepcopy(model), copy.deepcopy(model)
        fsdp.shard(coded, None, fsdp_comms("dynamic8"))
        fsdp.shard(exact, None)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 + rank))
        for m in (coded, exact):
            m(x).square().mean().backward()
        for a, b in zip(coded.parameters(), exact.parameters(), strict=True):
            ga, gb = a.grad.full_tensor(), b.grad.full_tensor()
            error = float((ga - gb).norm() / gb.norm())
            assert 0.0 < error < 0.15, (tuple(ga.shape), error)
        dist.destroy_process_group()
    except BaseException as err:  # report to the parent, which fails the test
        failures.put(f"rank {rank}: {type(err).__name__}: {err}")
        raise


def test_coded_collectives_equal_the_codecs_round_trip_on_two_ranks():
    from scaleout.comm import free_port

    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_on_two_ranks, args=(r, port, failures)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    messages = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not messages, messages
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]


@pytest.mark.slow
def test_fsdp_with_8bit_payloads_ends_near_fp32s_loss(ray_session, tmp_path):
    config = lm_config(tmp_path, "fsdp8", "sync")
    exact = fit(config, 'sync.mode="fsdp"', "run.name='exact'")
    coded = fit(config, 'sync.mode="fsdp"', 'compress.codec="dynamic8"', "run.name='coded'")
    assert coded.final_test_loss < exact.final_test_loss * 1.02, (
        coded.final_test_loss,
        exact.final_test_loss,
    )
