"""Tensor-parallel Linear layers (`model_parallel.tensor` with a `tensor_plan`): on 2
workers, a 2-layer MLP and a small LM whose attention and MLP projections are split take
strategy single's steps, each worker holding about half the split layers' bytes; a plan
that names no Linear is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaleout.api import prepare
from scaleout.errors import ConfigError

pytestmark = pytest.mark.usefixtures("in_the_repository")


MLP_PLAN = {"layers.fc1": "colwise", "layers.fc2": "rowwise"}
LM_PLAN = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.out": "rowwise",
    "mlp.0": "colwise",
    "mlp.2": "rowwise",
}


def config(tmp_path: Path, name: str, strategy: str, lm: bool) -> dict:
    model = (
        {"factory": "tests.tp_models:build_tiny_lm"}
        if lm
        else {"kind": "mlp", "sizes": [784, 64, 10]}
    )
    data = (
        {
            "factory": "examples.char_lm:build_data",
            "kwargs": {"block": 16, "max_chars": 40_000, "test_chars": 4096},
        }
        if lm
        else {"dataset": "mnist", "num_train": 4096, "num_test": 1000}
    )
    return {
        "run": {
            "name": name,
            "seed": 0,
            "device": "cpu",
            "num_threads": 1,
            "out_dir": str(tmp_path),
        },
        "model": model,
        "data": data,
        "train": {
            "strategy": strategy,
            "steps": 30,
            "batch_size": 32,
            "optimizer": "adamw",
            "lr": 0.003,
            "grad_clip_norm": 0.5,  # split weights count whole in the norm
            "eval_every": 15,
            "log_every": 5,
            "checkpoint_every": 15,
        },
        "model_parallel": {"tensor": 2, "tensor_plan": LM_PLAN if lm else MLP_PLAN},
    }


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"layers.fc9": "colwise"}, "names 'layers.fc9', which is no nn.Linear"),
        ({"layers.act1": "rowwise"}, "its Linear layers are layers.fc1, layers.fc2"),
        ({}, "tensor_plan is empty"),
    ],
)
def test_a_plan_that_names_no_linear_is_one_line(tmp_path, plan, message):
    cfg = config(tmp_path, "bad", "model_parallel", lm=False)
    cfg["model_parallel"]["tensor_plan"] = plan
    with pytest.raises(ConfigError, match=message) as caught:
        prepare(cfg)
    assert "\n" not in str(caught.value)
