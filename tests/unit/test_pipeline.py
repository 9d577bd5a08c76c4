"""Pipeline stages (`model_parallel.stages`): a user's nn.Sequential CNN cut into 2 stages on
2 workers takes strategy single's steps under GPipe and 1F1B (single with the same
micro-batches accumulated: BatchNorm sees the same examples), checkpoints in single's format
that resume in one process, clipping to the whole model's norm, and one line for what cannot
be cut. Under sync, 2 pipelines of 2 stages take the steps of 2 DDP workers (each with the
same micro-batches accumulated) and reach single's accuracy. Under Downpour, a replica of 2
stages takes a one-worker replica's steps, and 2 such replicas resume and reach single's
accuracy."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaleout.api import prepare
from scaleout.errors import ConfigError

pytestmark = pytest.mark.usefixtures("in_the_repository")


def cnn_config(tmp_path: Path, name: str, strategy: str, steps: int = 60) -> dict:
    return {
        "run": {
            "name": name,
            "seed": 0,
            "device": "cpu",
            "num_threads": 1,
            "out_dir": str(tmp_path),
        },
        "model": {"factory": "examples.fashion_cnn:build_model", "kwargs": {"width": 8}},
        "data": {"factory": "examples.fashion_cnn:build_data"},
        "train": {
            "strategy": strategy,
            "steps": steps,
            "batch_size": 32,
            "optimizer": "adam",
            "lr": 0.001,
            "grad_clip_norm": 0.5,  # the whole model's norm: the stages add their squares
            "eval_every": 30,
            "eval_batch_size": 500,
            "log_every": 10,
            "checkpoint_every": 30,
        },
        "model_parallel": {"stages": 2, "microbatches": 4},
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model_parallel.stages=20"], "has 13 parts to cut between"),
        (["model_parallel.microbatches=5"], "does not divide train.batch_size = 32"),
        (["model_parallel.grid=[2, 1]"], "set it to [1, 1]"),
        (["train.accumulate_steps=2"], "use model_parallel.microbatches"),
        (['model.factory="tests.tp_models:build_tiny_lm"'], "give an nn.Sequential"),
        (
            ["sync.num_workers=2", "model_parallel.microbatches=32"],
            "train.batch_size = 32 over 2 pipelines: make the batch a multiple of 64",
        ),
        (['sync.mode="average"'], 'under sync with sync.mode = "average": use "allreduce"'),
        (["sync.num_workers=2", "model_parallel.tensor=2"], "model_parallel.tensor are for"),
        (
            ['train.strategy="downpour"', "downpour.threads=true"],
            "downpour.threads = true needs replicas of one worker",
        ),
        (
            ['train.strategy="downpour"', "model_parallel.stages=1", "model_parallel.tensor=2"],
            "model_parallel.tensor = 2 with Downpour",
        ),
    ],
)
def test_what_a_pipeline_cannot_train_is_one_line(tmp_path, overrides, message):
    strategy = "sync" if any(o.startswith("sync.") for o in overrides) else "model_parallel"
    config = cnn_config(tmp_path, "bad", strategy)
    if any("tp_models" in o for o in overrides):
        config["model"]["kwargs"] = {}
        config["data"] = {"factory": "examples.char_lm:build_data"}
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")
    ) as caught:
        prepare(config, overrides=overrides)
    assert "\n" not in str(caught.value)
