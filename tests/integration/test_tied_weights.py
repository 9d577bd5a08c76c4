"""Models whose parameters share storage (tied embeddings): saved once and tied again on
load, counted once by the flat layouts, and trained, checkpointed and resumed under every
strategy; a model-parallel grid refuses them in one line, pipeline stages hold a copy at
each end. The same with Hugging Face's
`GPT2LMHeadModel` where transformers is installed. And AdamW with a cosine schedule and
clipping on one Downpour replica equals strategy single bit for bit."""

from __future__ import annotations

import pytest
import torch

from scaleout.api import prepare
from scaleout.errors import UserError
from scaleout.metrics import read_metrics
from scaleout.rundir import RunDir
from tests.unit.test_tied_weights import (
    assert_same_weights,
    final,
    fit,
    killed_after_first_checkpoint,
    lm_config,
)

pytestmark = pytest.mark.usefixtures("in_the_repository")


# --- Ray strategies ---------------------------------------------------------------------------


def test_pipeline_stages_hold_the_tied_weight_at_both_ends_and_take_single_steps(
    ray_session, tmp_path
):
    """The LM in 2 stages: the embedding on the first, the output layer on the last, each
    with a copy of the tied weight whose gradients are summed before the step (clipped to
    the whole model's norm, counted once); the steps of single with the same micro-batches,
    and a checkpoint that saves the weight once. Downpour refuses the cut in one line."""
    config = lm_config(tmp_path, "piped", "model_parallel")
    config["model_parallel"] = {"stages": 2, "microbatches": 4}
    piped = fit(config)
    single = fit(lm_config(tmp_path, "single", "single"), "train.accumulate_steps=4")
    (x, _), (y, _) = final(piped), final(single)
    assert x["model.head.weight"] is x["model.embed.tokens.weight"]
    names = [k for k in y if k.startswith(("model.", "optim."))]
    assert names and set(names) <= set(x)
    for name in names:
        a, b = x[name], y[name]
        if name.endswith("qkv.bias"):  # the key bias: its true gradient is 0, and AdamW
            width = len(a) // 3  # scales each process's round-off to a full step
            torch.testing.assert_close(
                a[width : 2 * width], b[width : 2 * width], atol=1e-3, rtol=0
            )
            a, b = torch.cat([a[:width], a[2 * width :]]), torch.cat([b[:width], b[2 * width :]])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert piped.final_test_loss == pytest.approx(single.final_test_loss, rel=1e-5)
    downpour = lm_config(tmp_path, "downpour", "downpour")
    downpour["model_parallel"] = {"stages": 2, "microbatches": 4}
    with pytest.raises(UserError, match="embed.tokens.weight .tied weights.") as caught:
        prepare(downpour)
    assert "\n" not in str(caught.value)


def test_sync_trains_checkpoints_and_resumes_exactly(ray_session, tmp_path):
    config = lm_config(tmp_path, "sync_straight", "sync")
    straight = fit(config)
    resumed = fit(killed_after_first_checkpoint(config, straight, "sync_resumed"), resume=True)
    assert resumed.step == 20
    assert_same_weights(straight, resumed)


def test_sync_clips_after_the_all_reduce_as_single_clips_the_whole_batch(ray_session, tmp_path):
    """Two workers on halves of each batch: DDP averages the gradient, every rank clips the
    average, and the run ends where single's does on whole batches (fp32 rounding, which
    Adam's normalised step turns into at most 1% of one step of lr = 0.01 here)."""
    config = lm_config(tmp_path, "sync_clip", "sync")
    sync = fit(config)
    single = fit(config, "train.strategy='single'", "run.name='single_clip'")
    (ours, _), (reference, _) = final(sync), final(single)
    for name in (k for k in reference if k.startswith("model.")):
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-3, atol=1e-4)
    norms = [read_metrics(RunDir(r.run_dir).metrics)[-1]["grad_norm"] for r in (sync, single)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_downpour_trains_checkpoints_and_resumes(ray_session, tmp_path):
    config = lm_config(tmp_path, "downpour", "downpour")
    first = fit(config, "train.steps=10")
    assert first.step == 10
    second = fit(config, resume=True)
    assert second.step >= 20
    tensors, meta = final(second)
    assert tensors["model.head.weight"] is tensors["model.embed.tokens.weight"]
    assert meta["strategy"] == "downpour" and second.final_test_loss < 4.0
    lines = read_metrics(RunDir(second.run_dir).metrics)
    assert all(line["lr"] <= 0.01 for line in lines if line.get("lr") is not None)


@pytest.mark.slow
def test_sandblaster_trains_and_resumes_a_tied_model_and_refuses_a_schedule(ray_session, tmp_path):
    config = lm_config(tmp_path, "sandblaster", "sandblaster")
    config["train"].update(lr_schedule="constant", grad_clip_norm=None)
    with pytest.raises(UserError, match='lr_schedule = "cosine" with train.strategy'):
        prepare(config, overrides=["train.lr_schedule='cosine'"])
    first = fit(config, "sandblaster.max_iterations=3")
    assert first.step == 3
    result = fit(config, resume=True)  # from the shards' state, to the config's 6
    assert result.step == 6
    tensors, _ = final(result)
    assert tensors["model.head.weight"] is tensors["model.embed.tokens.weight"]
    losses = [r["loss"] for r in read_metrics(RunDir(result.run_dir).metrics)]
    assert [r["step"] for r in read_metrics(RunDir(result.run_dir).metrics)][-1] == 6
    assert losses[-1] < losses[0]


def test_downpour_adamw_cosine_clipping_one_replica_is_single_bit_for_bit(ray_session, tmp_path):
    """One replica fetching and pushing every step, threads off: it clips the gradient of
    each step as single does, and the shards step AdamW at the schedule's rate of the
    global step their pushes carried: the same weights, bit for bit."""
    config = lm_config(tmp_path, "downpour_one", "downpour")
    config["downpour"] = {
        "num_replicas": 1,
        "num_shards": 2,
        "n_fetch": 1,
        "n_push": 1,
        "threads": False,
    }
    downpour = fit(config)
    single = fit(config, "train.strategy='single'", "run.name='single_one'")
    (ours, _), (reference, _) = final(downpour), final(single)
    weights = [k for k in reference if k.startswith("model.")]
    assert weights and all(torch.equal(ours[k], reference[k]) for k in weights)
    pushed = read_metrics(RunDir(downpour.run_dir).path / "pushes.jsonl")
    assert [p["steps"] for p in pushed] == [1] * 20 and all(p["grad_norm"] > 0 for p in pushed)


# --- Hugging Face -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy", ["single", "sync", pytest.param("downpour", marks=pytest.mark.slow)]
)
def test_hugging_face_gpt2_trains_checkpoints_and_resumes(ray_session, tmp_path, strategy):
    pytest.importorskip("transformers")
    config = lm_config(tmp_path, f"gpt2_{strategy}", strategy, model="examples.hf_char_lm")
    first = fit(config, "train.steps=10")
    second = fit(config, resume=True)
    assert second.step >= 20
    tensors, _ = final(second)
    assert tensors["model.lm_head.weight"] is tensors["model.transformer.wte.weight"]
    assert second.final_test_loss < first.final_test_loss
    assert second.summary["final_test_perplexity"] > 1 and second.final_test_accuracy > 0
