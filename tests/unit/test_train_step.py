"""What surrounds the optimizer step, on one worker against independent references:
clipping and the schedule against a hand-written torch loop (clip_grad_norm_, torch's
schedulers), accumulation against one step on the whole batch, bf16 against fp32, and the
user's metrics, perplexity and token accuracy in the metrics and the summary."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

import scaleout
from scaleout.checkpoint import load_checkpoint
from scaleout.data import ShuffledBatchSampler, load_image_idx
from scaleout.metrics import read_metrics
from scaleout.nn import MLP
from scaleout.rundir import RunDir
from scaleout.train.step import micro_batches


def config(tmp_path: Path, name: str, **train) -> dict:
    return {
        "run": {
            "name": name,
            "seed": 3,
            "device": "cpu",
            "num_threads": 1,
            "out_dir": str(tmp_path / "runs"),
        },
        "data": {"dataset": "mnist", "num_train": 2048, "num_test": 512},
        "model": {"kind": "mlp", "sizes": [784, 64, 10], "dropout": [0.2, 0.5]},
        "train": {
            "steps": 25,
            "batch_size": 32,
            "optimizer": "momentum",
            "lr": 0.05,
            "eval_every": 25,
            "log_every": 1,
            "checkpoint_every": 1000,
            **train,
        },
    }


def weights(result) -> dict[str, torch.Tensor]:
    tensors, _ = load_checkpoint(RunDir(result.run_dir).checkpoints.latest())
    return {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}


def test_clipping_and_cosine_schedule_equal_a_hand_written_loop(tmp_path):
    """The same steps as torch's own loop: clip_grad_norm_ on every step's gradient,
    warm-up then cosine annealing from torch's schedulers; the logged lr and grad_norm are
    the loop's."""
    train = {"lr_schedule": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1, "grad_clip_norm": 0.5}
    result = scaleout.fit(config(tmp_path, "clip", **train), overwrite=True)

    torch.manual_seed(3)
    model = MLP([784, 64, 10], dropout=[0.2, 0.5])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ramp = LinearLR(optimizer, start_factor=1 / 5, end_factor=1.0, total_iters=4)
    cosine = CosineAnnealingLR(optimizer, T_max=20, eta_min=0.005)
    scheduler = SequentialLR(optimizer, [ramp, cosine], milestones=[5])
    data = load_image_idx("mnist", "train").subset(2048)
    batches = ShuffledBatchSampler(2048, 32, seed=3, epoch=0, drop_last=True)
    rates, norms = [], []
    for _, indices in zip(range(25), batches, strict=False):
        optimizer.zero_grad()
        F.cross_entropy(model(data.x[indices]), data.y[indices]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    ours = weights(result)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6)
    records = read_metrics(RunDir(result.run_dir).metrics)
    assert [r["lr"] for r in records] == pytest.approx(rates, rel=1e-6)
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-5)
    assert max(norms) > 0.5  # the clipping did act


def test_accumulation_equals_one_step_on_the_whole_batch(tmp_path):
    """SGD on 4 micro-batches of 8 takes the step one batch of 32 takes (fp32 tolerance),
    and the loss it reports is the whole batch's."""
    common = {"optimizer": "sgd", "lr": 0.1}
    fit = lambda name, **extra: scaleout.fit(  # noqa: E731
        config(tmp_path, name, **common, **extra),
        overrides=["model.dropout=0.0"],
        overwrite=True,
    )
    whole, micro = fit("whole"), fit("micro", accumulate_steps=4)
    a, b = weights(whole), weights(micro)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=2e-6)
    losses = [[r["loss"] for r in read_metrics(RunDir(x.run_dir).metrics)] for x in (whole, micro)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_micro_batches_split_unequal_batches_by_their_share():
    batch = [torch.arange(10), torch.arange(10) * 2]
    parts = micro_batches(batch, 4)
    assert [len(p[0]) for p, _ in parts] == [3, 3, 2, 2]
    assert sum(w for _, w in parts) == pytest.approx(1.0)
    assert torch.equal(torch.cat([p[1] for p, _ in parts]), batch[1])
    assert [len(p[0]) for p, _ in micro_batches([torch.arange(2)], 4)] == [1, 1]  # none empty


def test_bf16_learns_as_fp32_does(tmp_path):
    """bf16 autocast on the CPU (fp32 weights): the same run ends within 2% of fp32's
    test loss, with different weights (the matmuls did run in bf16)."""
    train = {"optimizer": "adamw", "lr": 0.003, "steps": 60, "eval_every": 60}
    fp32 = scaleout.fit(config(tmp_path, "fp32", **train), overwrite=True)
    bf16 = scaleout.fit(
        config(tmp_path, "bf16", **train), overrides=["run.precision='bf16'"], overwrite=True
    )
    assert bf16.final_test_loss == pytest.approx(fp32.final_test_loss, rel=0.02)
    assert bf16.final_test_loss < 0.6 * 2.3  # it learned: chance is ln 10 = 2.3
    a, b = weights(fp32), weights(bf16)
    assert all(v.dtype == torch.float32 for v in b.values())
    assert any(not torch.equal(a[k], b[k]) for k in a)


def top3(output, target):
    return {"top3": output.topk(3, dim=1).indices.eq(target[:, None]).any(1).float().mean()}


def test_user_metrics_perplexity_and_accuracy_are_logged_and_summarised(tmp_path):
    result = scaleout.fit(config(tmp_path, "metrics", eval_every=10), metrics=top3, overwrite=True)
    evals = [r for r in read_metrics(RunDir(result.run_dir).metrics) if "test_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 25]
    for record in evals:
        assert record["test_accuracy"] <= record["test_top3"] <= 1.0
        assert record["test_perplexity"] == pytest.approx(torch.tensor(record["test_loss"]).exp())
    summary = result.summary
    assert summary["final_test_top3"] == evals[-1]["test_top3"]
    assert summary["final_test_perplexity"] == evals[-1]["test_perplexity"]
    assert summary["final_test_loss"] == evals[-1]["test_loss"]


def test_ddp_all_reduces_once_per_step_however_many_micro_batches(tmp_path):
    """Under DDP every micro-batch but the last runs in `no_sync`: one all-reduce of each
    bucket per step, with 1 micro-batch or 4, and the same averaged gradient."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from scaleout.train.config import TrainSection
    from scaleout.train.objective import Supervised
    from scaleout.train.outputs import cross_entropy
    from scaleout.train.step import Stepper

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        grads = []
        for micro in (1, 4):
            torch.manual_seed(0)
            network = DistributedDataParallel(torch.nn.Linear(6, 3))
            calls = []

            def counting(state, bucket, calls=calls):
                calls.append(bucket.index())
                return _done(bucket.buffer())

            network.register_comm_hook(None, counting)
            stepper = Stepper(
                TrainSection(batch_size=16, accumulate_steps=micro), "fp32", torch.device("cpu")
            )
            objective = Supervised(cross_entropy, classification=True)
            batch = [
                torch.randn(16, 6, generator=torch.Generator().manual_seed(1)),
                torch.arange(16) % 3,
            ]
            stepper.forward_backward(objective, network.module, network, batch, 0)
            assert len(calls) == 1, (micro, calls)
            grads.append(network.module.weight.grad.clone())
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)
    finally:
        dist.destroy_process_group()


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future
