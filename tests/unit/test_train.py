"""Single-worker training: against a hand-written loop, convergence, resume, kill and Ctrl-C."""

from pathlib import Path

import torch
import torch.nn.functional as F

import scaleout
from scaleout.checkpoint import load_checkpoint
from scaleout.cli import main
from scaleout.data import ShuffledBatchSampler, load_image_idx
from scaleout.metrics import read_metrics
from scaleout.nn import MLP
from scaleout.rundir import RunDir
from tests.run_config import config_file


def write_config(tmp_path: Path, name: str = "t", **fields) -> Path:
    v = dict(
        num_train=2048,
        sizes=[784, 64, 10],
        steps=40,
        optimizer="momentum",
        lr=0.05,
        eval_every=20,
        checkpoint_every=1000,
    )
    v.update(fields)
    return config_file(
        tmp_path,
        name,
        run={"seed": 3, "num_threads": 2},
        data={"dataset": "mnist", "num_train": v["num_train"], "num_test": 1000},
        model={"kind": "mlp", "sizes": v["sizes"], "dropout": [0.2, 0.5]},
        train={
            "steps": v["steps"],
            "batch_size": 32,
            "optimizer": v["optimizer"],
            "lr": v["lr"],
            "eval_every": v["eval_every"],
            "log_every": 10,
            "checkpoint_every": v["checkpoint_every"],
        },
    )


def train(path: Path, *overrides: str, resume: bool = False):
    result = scaleout.fit(path, overrides=list(overrides), resume=resume, overwrite=not resume)
    return result, RunDir(result.run_dir)


def final_tensors(run: RunDir) -> dict[str, torch.Tensor]:
    tensors, _ = load_checkpoint(run.checkpoints.latest())
    return tensors


def test_matches_hand_written_loop(tmp_path):
    """The same SGD-with-momentum steps, dropout masks and batches as a plain torch loop."""
    result, run = train(write_config(tmp_path), "train.steps=25")
    assert result.step == 25 and not result.interrupted

    torch.manual_seed(3)
    model = MLP([784, 64, 10], dropout=[0.2, 0.5])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = load_image_idx("mnist", "train").subset(2048)
    batches = ShuffledBatchSampler(2048, 32, seed=3, epoch=0, drop_last=True)
    for _, indices in zip(range(25), batches, strict=False):
        x, y = data.x[indices], data.y[indices]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    tensors = final_tensors(run)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(tensors[f"model.{name}"], value, rtol=0, atol=1e-6)


def test_converges_and_writes_metrics_plot_checkpoint(tmp_path):
    path = write_config(
        tmp_path,
        num_train=8192,
        steps=500,
        optimizer="adam",
        lr=0.001,
        eval_every=250,
        checkpoint_every=250,
    )
    result, run = train(path, "model.dropout=0.0")
    assert result.summary["final_test_accuracy"] > 0.9
    records = read_metrics(run.metrics)
    assert [r["step"] for r in records] == list(range(10, 501, 10))
    for record in records:
        assert {"time_s", "step", "examples", "loss", "lr", "train_accuracy"} <= record.keys()
        assert record["examples"] == 32 * record["step"]
    evals = [r for r in records if "test_accuracy" in r]
    assert [r["step"] for r in evals] == [250, 500]
    assert records[-1]["loss"] < records[0]["loss"] / 2
    assert run.plot.stat().st_size > 10_000
    assert run.checkpoints.steps() == [250, 500]
    _, meta = load_checkpoint(run.checkpoints.latest())
    assert meta["step"] == 500 and meta["config"]["train"]["lr"] == 0.001


def test_resume_equals_uninterrupted_run(tmp_path):
    _, straight = train(write_config(tmp_path, name="straight"))
    path = write_config(tmp_path, name="split")
    first, split = train(path, "train.steps=15")
    assert first.step == 15
    second, split = train(path, resume=True)
    assert second.step == 40
    a, b = final_tensors(straight), final_tensors(split)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    steps = [r["step"] for r in read_metrics(split.metrics)]
    assert steps == sorted(set(steps)) and steps[-1] == 40


def test_existing_run_needs_resume_or_overwrite(tmp_path, capsys):
    path = write_config(tmp_path, steps=5)
    assert main(["train", str(path)]) == 0
    assert main(["train", str(path)]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert main(["train", str(path), "--overwrite"]) == 0
    fresh = write_config(tmp_path, name="fresh")
    assert main(["train", str(fresh), "--resume"]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err


def test_corrupted_checkpoint_refused_on_resume(tmp_path, capsys):
    path = write_config(tmp_path, steps=5)
    assert main(["train", str(path)]) == 0
    latest = RunDir(tmp_path / "runs" / "t").checkpoints.latest().with_suffix(".safetensors")
    data = bytearray(latest.read_bytes())
    data[-3] ^= 0x10
    latest.write_bytes(bytes(data))
    assert main(["train", str(path), "--resume", "--set", "train.steps=10"]) == 2
    err = capsys.readouterr().err
    assert "corrupted: SHA-256 differs" in err and "Traceback" not in err


def test_divergence_is_a_clear_error(tmp_path, capsys):
    path = write_config(tmp_path, optimizer="sgd", lr=1e12, steps=30)
    assert main(["train", str(path)]) == 2
    assert "training diverged" in capsys.readouterr().err


def test_model_that_does_not_fit_data(tmp_path, capsys):
    path = write_config(tmp_path, sizes=[700, 10])
    assert main(["train", str(path), "--set", "model.dropout=0.0"]) == 2
    assert "does not accept the data's examples of shape (1, 28, 28)" in capsys.readouterr().err


def test_stops_at_target_accuracy(tmp_path):
    path = write_config(tmp_path, steps=400, optimizer="adam", lr=0.001, eval_every=20)
    result, run = train(path, "train.target_accuracy=0.8", "model.dropout=0.0")
    evals = [r for r in read_metrics(run.metrics) if "test_accuracy" in r]
    assert (
        evals[-1]["test_accuracy"] >= 0.8 > max((r["test_accuracy"] for r in evals[:-1]), default=0)
    )
    assert result.step == evals[-1]["step"] < 400
    assert run.checkpoints.steps()[-1] == result.step
