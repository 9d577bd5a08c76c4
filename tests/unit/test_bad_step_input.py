"""Bad step options are one line and exit 2 before training, each naming the key and the
fix: an unknown schedule, micro-batches that do not divide the batch, fp16 on the CPU, an
optimizer that needs whole tensors under Downpour, a metrics function that raises or
returns a non-number, a schedule under Sandblaster (and the other step options it cannot
honour)."""

from __future__ import annotations

import uuid

import pytest

from scaleout.cli import main
from tests.run_config import config_file

FACTORIES = """
import torch
from torch.utils.data import TensorDataset


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])


def model():
    return torch.nn.Linear(8, 2)


from tests.whole_tensor_optim import lamb  # noqa: F401 - named by train.optimizer below


def not_an_optimizer(params):
    return list(params)


def metrics_raising(output, target):
    raise KeyError("logits")


def metrics_text(output, target):
    return {"accuracy": "high"}
"""


@pytest.mark.parametrize(
    ("strategy", "overrides", "expected"),
    [
        ("single", ["train.lr_schedule='cosinus'"], "train.lr_schedule = 'cosinus': Input should"),
        (
            "single",
            ["train.batch_size=32", "train.accumulate_steps=3"],
            "train.accumulate_steps = 3: does not divide train.batch_size = 32",
        ),
        (
            "sync",
            ["train.batch_size=32", "train.accumulate_steps=32"],
            "train.accumulate_steps = 32 does not divide each worker's slice",
        ),
        ("single", ["run.precision='fp16'"], 'run.precision = "fp16" needs a CUDA device'),
        (
            "downpour",
            ["train.optimizer='{m}:lamb'"],
            "train.optimizer = '{m}:lamb' does not step element by element",
        ),
        (
            "single",
            ["train.metrics='{m}:metrics_raising'"],
            "train.metrics = '{m}:metrics_raising' raised KeyError: 'logits'",
        ),
        (
            "downpour",
            ["train.metrics='{m}:metrics_text'"],
            "train.metrics = '{m}:metrics_text' returned 'accuracy': 'high'",
        ),
        (
            "sandblaster",
            ["train.lr_schedule='wsd'"],
            'train.lr_schedule = "wsd" with train.strategy = "sandblaster"',
        ),
        (
            "sandblaster",
            ["train.grad_clip_norm=1.0"],
            'train.grad_clip_norm with train.strategy = "sandblaster"',
        ),
        (
            "single",
            ["train.lr_schedule='cosine'", "train.warmup_steps=50"],
            "train.warmup_steps = 50 leaves no step of the run's 20",
        ),
        (
            "single",
            ["train.optimizer='{m}:not_an_optimizer'"],
            "returned a list, not a torch.optim.Optimizer",
        ),
    ],
)
def test_bad_step_option_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys, strategy, overrides, expected
):
    module = f"step_factories_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = config_file(
        tmp_path,
        model={"factory": f"{module}:model"},
        data={"factory": f"{module}:data"},
        train={"strategy": strategy, "steps": 20, "batch_size": 16},
        sandblaster={"max_iterations": 20},
    )
    argv = ["train", str(path)]
    for override in overrides:
        argv += ["--set", override.format(m=module)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert expected.format(m=module) in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written
