"""The DDP hook on real gloo process groups: replicas stay identical, training matches fp32."""

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from scaleout.compress import ErrorFeedback, OnLink, ddp_hook, get
from scaleout.compress.link import TIMED_SIZES, average_8bit
from scaleout.compress.transfer import CodecSpeed, LinkSpeed

STEPS = 50
CASES = {  # label -> hook factory (None: DDP's own fp32 all-reduce)
    "allreduce": None,
    "fp32": lambda: ddp_hook("fp32"),
    "bf16": lambda: ddp_hook("bf16"),
    "dynamic8": lambda: ddp_hook("dynamic8"),
    "dynamic8_blocks": lambda: ddp_hook("dynamic8", block_size=64, refresh_every=5),
    "linear8_feedback": lambda: ddp_hook(get("linear8"), error_feedback=True),
    "onebit": lambda: ddp_hook(ErrorFeedback(get("onebit"))),
    # on a link: every bucket priced faster raw (a codec call costs 1 s) or 8-bit (free)
    "link_raw": lambda: ddp_hook(on_link(ErrorFeedback(get("linear8")), 1.0)),
    "link_8bit": lambda: ddp_hook(on_link(get("dynamic8"), 0.0)),
}


def on_link(codec, call_s: float) -> OnLink:
    return OnLink(codec, LinkSpeed.parse("1gbit"), CodecSpeed(call_s, 0.0, call_s, 0.0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed teacher (the same on every rank) labels random inputs drawn from `seed`."""
    teacher = torch.randn(20, 4, generator=torch.Generator().manual_seed(7))
    x = torch.randn(n, 20, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip


def train(rank: int, make_hook) -> tuple[np.ndarray, float, float]:
    net = model()
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.01)  # several buckets, rebuilt once
    if make_hook is not None:
        ddp.register_comm_hook(None, make_hook())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = task(100 + rank, STEPS * 32)
    for step in range(STEPS):
        batch = slice(32 * step, 32 * step + 32)
        optimizer.zero_grad()
        F.cross_entropy(ddp(x[batch]), y[batch]).backward()
        optimizer.step()
    x_test, y_test = task(999, 2000)
    with torch.no_grad():
        logits = net(x_test)
    loss = F.cross_entropy(logits, y_test).item()
    accuracy = (logits.argmax(1) == y_test).float().mean().item()
    flat = torch.cat([p.detach().view(-1) for p in net.parameters()]).numpy()
    return flat, loss, accuracy


def worker(rank: int, world: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        results = {}
        for label, make_hook in CASES.items():
            flat, loss, accuracy = train(rank, make_hook)
            results[f"{label}.params"] = flat
            results[f"{label}.metrics"] = np.array([loss, accuracy])
        # the ranks price with the slowest one's codec: every term's maximum
        agreed = on_link(get("dynamic8"), 0.1 * (rank + 1))
        agreed.agree()
        results["agreed"] = np.array(list(agreed.speed.to_dict().values()))
        assert agreed.timed is not None  # both schedules timed between the ranks
        results["timed"] = np.array(agreed.timed)
        # the 8-bit schedule it timed is the hook's: the mean of both ranks' round trips
        xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        codec = get("dynamic8")
        results["average_8bit"] = average_8bit(xs[rank], codec).numpy()
        results["round_trips"] = ((codec.roundtrip(xs[0]) + codec.roundtrip(xs[1])) / 2).numpy()
        np.savez(out / f"rank{rank}.npz", **results)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(worker, args=(2, free_port(), out), nprocs=2, join=True)
    return [dict(np.load(out / f"rank{rank}.npz")) for rank in range(2)]


@pytest.mark.parametrize("label", list(CASES))
def test_replicas_stay_identical(trained, label):
    np.testing.assert_array_equal(trained[0][f"{label}.params"], trained[1][f"{label}.params"])


@pytest.mark.parametrize("label", ["fp32", "link_raw"])
def test_fp32_hook_equals_ddp_allreduce(trained, label):
    """A bucket sent raw on a link is DDP's own all-reduce (error feedback then has no
    residual to carry)."""
    np.testing.assert_allclose(
        trained[0][f"{label}.params"], trained[0]["allreduce.params"], rtol=1e-4, atol=1e-5
    )


def test_a_link_where_8bit_wins_sends_every_bucket_8bit(trained):
    np.testing.assert_array_equal(trained[0]["link_8bit.params"], trained[0]["dynamic8.params"])


def test_ranks_agree_on_the_slowest_codec_cost(trained):
    """Each term the slower rank's; both schedules' timings agreed alike on both."""
    for rank in range(2):
        np.testing.assert_allclose(trained[rank]["agreed"], [0.2, 0.0, 0.2, 0.0])
    np.testing.assert_array_equal(trained[0]["timed"], trained[1]["timed"])
    assert trained[0]["timed"].shape == (2, len(TIMED_SIZES)) and (trained[0]["timed"] > 0).all()


def test_the_timed_8bit_average_is_the_mean_of_the_round_trips(trained):
    for rank in range(2):
        np.testing.assert_array_equal(trained[rank]["average_8bit"], trained[0]["round_trips"])


def rebuilt_buckets(out: Path) -> None:
    """In a one-process group, DDP rebuilds its buckets after the first step; writes the
    residuals the hook holds then, and leaves with os._exit.

    Own process and no teardown: dropping DDP's reducer right after a backward through a
    Python comm hook can deadlock in ProcessGroupGloo's destructor, which joins gloo's
    threads while holding the GIL that one of them still needs to release the hook's
    callback (pytorch/pytorch#56297); a deadlock that holds the GIL defeats any timeout
    inside the process, so the test waits on this one from outside."""
    code = 1
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        net = model()
        ddp = DistributedDataParallel(net, bucket_cap_mb=0.01)
        hook = ddp_hook("dynamic8", error_feedback=True)
        ddp.register_comm_hook(None, hook)
        x, y = task(1, 64)
        for _ in range(3):
            F.cross_entropy(ddp(x), y).backward()
        sizes = [r.numel() for r in hook.codec.residuals.values()]
        total = sum(p.numel() for p in net.parameters())
        out.write_text(json.dumps({"sizes": sizes, "total": total}))
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def test_hook_state_follows_rebuilt_buckets(tmp_path):
    """The residuals left are exactly one per current bucket, sized like it."""
    out = tmp_path / "residuals.json"
    process = mp.get_context("spawn").Process(target=rebuilt_buckets, args=(out,))
    process.start()
    process.join(timeout=240)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("the one-process DDP run did not finish in 240 s")
    assert process.exitcode == 0
    result = json.loads(out.read_text())
    assert len(result["sizes"]) > 1 and sum(result["sizes"]) == result["total"]


def test_hook_rejects_options_with_a_codec_object():
    with pytest.raises(ValueError, match="options with a codec name"):
        ddp_hook(get("dynamic8"), block_size=4)
