"""scaleout.fit and the factories: dict and TOML configs, models and data defined by the user
(also in a script that cannot be imported), every bad factory as one line and exit 2, and
TensorBoard event files."""

import json
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import scaleout
from scaleout.cli import main
from scaleout.errors import ConfigError, FactoryError
from scaleout.metrics import read_metrics
from tests.run_config import config_file


def linear_task(num_train: int = 1536, num_test: int = 512) -> tuple[TensorDataset, TensorDataset]:
    """Three classes of 8-dimensional points, separable by a linear map."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_train + num_test, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    return TensorDataset(x[:num_train], y[:num_train]), TensorDataset(x[num_train:], y[num_train:])


def small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


def config(tmp_path: Path, name: str, **train) -> dict:
    """A dict config holding only what it sets: every other key has its default."""
    return {
        "run": {"name": name, "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "train": {"steps": 60, "batch_size": 32, "optimizer": "adam", "lr": 0.01, **train},
    }


def test_fit_with_a_users_model_and_data(tmp_path):
    result = scaleout.fit(
        config(tmp_path, "mine", eval_every=30), model=small_net, data=linear_task
    )
    assert result.steps == 60 and not result.interrupted
    assert result.final_test_accuracy >= 0.85 and result.best_test_accuracy >= 0.85
    assert result.run_dir == tmp_path / "runs" / "mine"
    recorded = json.loads((result.run_dir / "config.json").read_text())
    assert recorded["model"] == {"kind": "factory", "factory": f"{__name__}:small_net"}
    assert recorded["data"] == {"dataset": "factory", "factory": f"{__name__}:linear_task"}


def test_loss_function_and_targets_that_are_not_classes(tmp_path):
    """Regression with a user's loss: no accuracy, the test loss is the measure."""

    def data():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(640, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])  # (N, 1) float targets
        return TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])

    result = scaleout.fit(
        config(tmp_path, "regression", steps=200, eval_every=100, optimizer="sgd", lr=0.05),
        model=lambda: nn.Linear(4, 1),
        data=data,
        loss=nn.functional.mse_loss,
    )
    assert result.final_test_accuracy is None
    assert result.summary["final_test_loss"] < 0.05
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert "train_accuracy" not in records[-1] and records[-1]["test_loss"] < records[0]["loss"]


def test_factory_given_overrides_the_sections_and_missing_ones_are_named(tmp_path):
    raw = config(tmp_path, "named")
    raw["model"] = {"kind": "mlp", "sizes": [784, 10]}  # overridden by model=
    result = scaleout.fit(raw, model=small_net, data=linear_task, overrides=["train.steps=5"])
    assert result.steps == 5
    with pytest.raises(ConfigError, match=r"\[model\] is missing.*pass model= to scaleout.fit"):
        scaleout.fit(config(tmp_path, "no_model"), data=linear_task)
    with pytest.raises(ConfigError, match=r"\[data\] is missing"):
        scaleout.fit(config(tmp_path, "no_data"), model=small_net)


# --- bad factories: one line, exit 2, named -----------------------------------------------------

FACTORIES = """
import torch
from torch.utils.data import TensorDataset


def good_data():
    x, y = torch.randn(64, 8), torch.zeros(64, dtype=torch.long)
    return TensorDataset(x, y), TensorDataset(x, y)


def one_set():
    return TensorDataset(torch.randn(64, 8), torch.zeros(64, dtype=torch.long))


def broken():
    raise RuntimeError("the weights file is not there")


def not_a_module():
    return 42


def good_model():
    return torch.nn.Linear(8, 2)
"""


@pytest.mark.parametrize(
    ("model", "data", "expected"),
    [
        (
            "no_such_module_xyz:build",
            "{m}:good_data",
            "model.factory = 'no_such_module_xyz:build': cannot import 'no_such_module_xyz'",
        ),
        ("{m}:nope", "{m}:good_data", "module {m} has no 'nope'"),
        (
            "{m}:broken",
            "{m}:good_data",
            "model factory {m}:broken raised RuntimeError: the weights file is not there",
        ),
        (
            "{m}:not_a_module",
            "{m}:good_data",
            "model factory {m}:not_a_module returned int, expected a torch.nn.Module",
        ),
        (
            "{m}:good_model",
            "{m}:one_set",
            "data factory {m}:one_set returned TensorDataset; it must return (train, test)",
        ),
        ("{m}:good_model", "{m}:broken", "data factory {m}:broken raised RuntimeError"),
        ("{m}", "{m}:good_data", "expected 'package.module:function'"),
    ],
)
@pytest.mark.parametrize("strategy", ["single", "downpour"])
def test_bad_factory_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys, model, data, expected, strategy
):
    module = f"factories_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, data = model.format(m=module), data.format(m=module)
    path = config_file(
        tmp_path,
        model={"factory": model},
        data={"factory": data},
        train={"strategy": strategy, "steps": 2},
    )
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert expected.format(m=module) in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_bad_factory_through_the_python_api():
    with pytest.raises(FactoryError, match="model factory .*returned str"):
        scaleout.fit({}, model=lambda: "not a model", data=linear_task)
    with pytest.raises(FactoryError, match="data factory .* returned 3 values"):
        scaleout.fit({}, model=small_net, data=lambda: (1, 2, 3))
    with pytest.raises(ConfigError, match="model = 3: give a function"):
        scaleout.fit({}, model=3, data=linear_task)


# --- TensorBoard --------------------------------------------------------------------------------


def test_tensorboard_event_files_beside_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    raw = config(tmp_path, "tb", eval_every=30, log_every=10)
    raw["run"]["tensorboard"] = True
    result = scaleout.fit(raw, model=small_net, data=linear_task)
    events = EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/train_accuracy", "test/accuracy", "test/loss"} <= set(tags)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(10, 61, 10))
    logged = [r["loss"] for r in read_metrics(result.run_dir / "metrics.jsonl")]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(logged)


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    raw = config(tmp_path, "no_tb")
    raw["run"]["tensorboard"] = True
    with pytest.raises(ConfigError, match=r"pip install 'scaleout\[tensorboard\]'"):
        scaleout.fit(raw, model=small_net, data=linear_task)
    assert not (tmp_path / "runs").exists()
