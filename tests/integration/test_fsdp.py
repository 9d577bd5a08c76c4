"""Sharded data parallelism (`sync.mode = "fsdp"`): which modules are sharded, the same
steps as `allreduce` (clipping, accumulation, tied weights) with about half the bytes on each
of 2 workers, checkpoints that resume under the other mode, and bad blocks in one line. The
same with Hugging Face's `GPT2LMHeadModel` where transformers is installed."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_tied_weights import final, fit, killed_after_first_checkpoint, lm_config

# --- two workers ------------------------------------------------------------------------------


def assert_close_weights(a, b, rtol: float = 1e-3, atol: float = 1e-4) -> None:
    """Equal to float rounding, as Adam amplifies it: a value whose gradient is near zero
    moves by up to the learning rate (0.01) on a sign that rounding can flip."""
    (x, _), (y, _) = final(a), final(b)
    names = [k for k in y if k.startswith(("model.", "optim."))]
    assert names
    for name in names:
        torch.testing.assert_close(x[name], y[name], rtol=rtol, atol=atol, msg=name)


def test_fsdp_takes_allreduces_steps_with_half_the_bytes_and_resumes_under_either_mode(
    ray_session, tmp_path
):
    """20 steps of AdamW, cosine, clipping and 2 micro-batches on a tied LM: FSDP's weights
    and optimizer state equal DDP's (float rounding: the reduce-scatter sums in another
    order); each worker holds at most 55% of DDP's bytes; a checkpoint of either mode,
    resumed under the other, ends where the uninterrupted run ends."""
    config = lm_config(tmp_path, "allreduce", "sync")
    config["train"]["accumulate_steps"] = 2
    allreduce = fit(config)
    sharded_config = lm_config(tmp_path, "fsdp", "sync")
    sharded_config["train"]["accumulate_steps"] = 2
    sharded_config["sync"]["mode"] = "fsdp"
    sharded = fit(sharded_config)
    assert_close_weights(sharded, allreduce)
    loss = allreduce.final_test_loss
    assert abs(sharded.final_test_loss - loss) < 1e-3 * loss
    for key in ("parameter_bytes", "optimizer_bytes"):
        assert sharded.summary[key] <= 0.55 * allreduce.summary[key], key

    to_allreduce = killed_after_first_checkpoint(sharded_config, sharded, "fsdp_then_allreduce")
    to_allreduce["sync"]["mode"] = "allreduce"
    assert_close_weights(fit(to_allreduce, resume=True), allreduce)
    to_fsdp = killed_after_first_checkpoint(config, allreduce, "allreduce_then_fsdp")
    to_fsdp["sync"]["mode"] = "fsdp"
    assert_close_weights(fit(to_fsdp, resume=True), allreduce)


@pytest.mark.slow
def test_hugging_face_gpt2_under_fsdp_takes_allreduces_steps(ray_session, tmp_path):
    pytest.importorskip("transformers")
    model = "examples.hf_char_lm"
    runs = {}
    for mode in ("allreduce", "fsdp"):
        config = lm_config(tmp_path, f"gpt2_{mode}", "sync", model=model)
        config["sync"]["mode"] = mode
        if mode == "fsdp":
            config["sync"]["fsdp_blocks"] = ["GPT2Block"]
        runs[mode] = fit(config)
    # GPT-2's key biases have a gradient of rounding noise only (softmax ignores a shift),
    # which Adam turns into steps of up to its learning rate: a looser bound there.
    assert_close_weights(runs["fsdp"], runs["allreduce"], atol=1e-3)
    loss = runs["allreduce"].final_test_loss
    assert abs(runs["fsdp"].final_test_loss - loss) < 1e-3 * loss
    for key in ("parameter_bytes", "optimizer_bytes"):
        assert runs["fsdp"].summary[key] <= 0.55 * runs["allreduce"].summary[key], key


@pytest.mark.slow
def test_fsdp_under_bf16_autocast_takes_allreduces_steps(ray_session, tmp_path):
    losses = {}
    for mode in ("allreduce", "fsdp"):
        config = lm_config(tmp_path, f"bf16_{mode}", "sync")
        config["sync"]["mode"] = mode
        config["run"]["precision"] = "bf16"
        losses[mode] = fit(config).final_test_loss
    assert abs(losses["fsdp"] - losses["allreduce"]) < 1e-3 * losses["allreduce"]
