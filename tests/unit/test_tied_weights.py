"""Models whose parameters share storage (tied embeddings): saved once and tied again on
load, counted once by the flat layouts, and trained, checkpointed and resumed under every
strategy; a model-parallel grid refuses them in one line, pipeline stages hold a copy at
each end. The same with Hugging Face's
`GPT2LMHeadModel` where transformers is installed. And AdamW with a cosine schedule and
clipping on one Downpour replica equals strategy single bit for bit."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

import scaleout
from examples.char_lm import CharGPT
from scaleout.api import prepare
from scaleout.checkpoint import load_checkpoint, save_checkpoint
from scaleout.errors import UserError
from scaleout.parallel import synced_state
from scaleout.ps import FlatParameters
from scaleout.rundir import RunDir
from scaleout.train.state import load_model_weights, model_tensors

pytestmark = pytest.mark.usefixtures("in_the_repository")


TINY = {"block": 16, "width": 32, "layers": 1, "heads": 2}


def lm_config(tmp_path: Path, name: str, strategy: str, model: str = "examples.char_lm") -> dict:
    return {
        "run": {
            "name": name,
            "seed": 0,
            "device": "cpu",
            "num_threads": 1,
            "out_dir": str(tmp_path / "runs"),
        },
        "model": {"factory": f"{model}:build_model", "kwargs": TINY},
        "data": {
            "factory": "examples.char_lm:build_data",
            "kwargs": {"block": 16, "max_chars": 40_000, "test_chars": 4096},
        },
        "train": {
            "strategy": strategy,
            "steps": 20,
            "batch_size": 16,
            "optimizer": "adamw",
            "lr": 0.01,
            "weight_decay": 0.1,
            "lr_schedule": "cosine",
            "warmup_steps": 3,
            "grad_clip_norm": 1.0,
            "eval_every": 10,
            "log_every": 5,
            "checkpoint_every": 10,
        },
        "downpour": {"num_replicas": 2, "num_shards": 2},
        "sync": {"num_workers": 2},
        "sandblaster": {
            "num_replicas": 2,
            "num_shards": 2,
            "portion_size": 64,
            "batch_size": 512,
            "max_iterations": 6,
            "dtype": "float32",
        },
    }


def final(result) -> tuple[dict[str, torch.Tensor], dict]:
    return load_checkpoint(RunDir(result.run_dir).checkpoints.latest())


def fit(config: dict, *overrides: str, resume: bool = False):
    return scaleout.fit(config, overrides=list(overrides), resume=resume, overwrite=not resume)


def killed_after_first_checkpoint(config: dict, result, name: str) -> dict:
    """A copy of a finished run as a run killed after its first checkpoint (step 10)
    leaves it; returns the config that resumes it."""
    copy_dir = Path(config["run"]["out_dir"]) / name
    shutil.copytree(result.run_dir, copy_dir)
    for path in (copy_dir / "checkpoints").glob("step_00000020.*"):
        path.unlink()
    again = copy.deepcopy(config)
    again["run"]["name"] = name
    return again


def assert_same_weights(a, b) -> None:
    (x, _), (y, _) = final(a), final(b)
    names = [k for k in x if k.startswith("model.")]
    assert names and all(torch.equal(x[k], y[k]) for k in names)


# --- no processes -----------------------------------------------------------------------------


def test_a_checkpoint_saves_a_tied_weight_once_and_ties_it_again(tmp_path):
    torch.manual_seed(0)
    model = CharGPT(**{k: v for k, v in TINY.items()})
    path = save_checkpoint(tmp_path / "tied", model_tensors(model), {"step": 1})
    tensors, _ = load_checkpoint(path)
    assert tensors["model.head.weight"] is tensors["model.embed.tokens.weight"]
    from safetensors.torch import load_file

    assert "model.head.weight" not in load_file(str(tmp_path / "tied.safetensors"))
    other = CharGPT(**TINY)
    load_model_weights(other, tensors, str(path))
    assert other.head.weight is other.embed.tokens.weight
    assert torch.equal(other.embed.tokens.weight, model.embed.tokens.weight)


def test_flat_layouts_count_a_tied_parameter_once():
    model = CharGPT(**TINY)
    flat = FlatParameters(model)
    assert flat.numel == sum(p.numel() for p in model.parameters())
    assert flat.numel < sum(t.numel() for t in model.state_dict().values())
    assert model.head.weight.data_ptr() == model.embed.tokens.weight.data_ptr()  # still one
    averaged = synced_state(model, torch.optim.SGD(model.parameters(), lr=0.1))  # sync average
    assert sum(t.numel() for t in averaged) == flat.numel  # no buffers, no momentum here

    untied = CharGPT(**TINY)
    untied.head.weight = torch.nn.Parameter(untied.embed.tokens.weight.data)  # two, one memory
    with pytest.raises(UserError, match="share memory but are two nn.Parameter objects"):
        FlatParameters(untied)


def test_single_trains_checkpoints_and_resumes_exactly(tmp_path):
    """Killed after step 10 and resumed: the same weights at step 20 as the run that was
    not (the schedule is a function of the step: nothing to restore)."""
    config = lm_config(tmp_path, "straight", "single")
    straight = fit(config)
    resumed = fit(killed_after_first_checkpoint(config, straight, "resumed"), resume=True)
    assert resumed.step == 20
    assert_same_weights(straight, resumed)
    assert straight.final_test_loss < 4.0 and 0 < straight.final_test_accuracy <= 1


def test_a_model_parallel_run_refuses_a_tied_model_in_one_line(tmp_path):
    config = lm_config(tmp_path, "grid", "model_parallel")
    with pytest.raises(UserError) as raised:
        prepare(config, overrides=["model_parallel.grid=[1, 2]"])
    assert len(str(raised.value).splitlines()) == 1
    assert "parallelize" in str(raised.value)
