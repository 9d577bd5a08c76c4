"""Sharded data parallelism (`sync.mode = "fsdp"`): which modules are sharded, the same
steps as `allreduce` (clipping, accumulation, tied weights) with about half the bytes on each
of 2 workers, checkpoints that resume under the other mode, and bad blocks in one line. The
same with Hugging Face's `GPT2LMHeadModel` where transformers is installed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.char_lm import CharGPT
from scaleout.api import prepare
from scaleout.errors import ConfigError
from scaleout.parallel import fsdp
from scaleout.parallel.fsdp import blocks_of
from tests.unit.test_tied_weights import TINY, lm_config

# --- no processes -----------------------------------------------------------------------------


def test_default_blocks_are_the_children_less_tied_ones_a_lists_items_in_its_place():
    model = CharGPT(**TINY)  # embed and head share the token weight: the root keeps both
    assert blocks_of(model, None) == ["blocks.0", "norm"]
    assert blocks_of(CharGPT(**{**TINY, "layers": 3}), ["Block"]) == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
    ]


def test_named_blocks_nested_in_named_blocks_are_sharded_with_the_outer_one():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2))
    assert blocks_of(model, ["Sequential", "Linear"]) == ["0", "1"]


def test_a_block_name_that_matches_nothing_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"\['Nope'\], which match no module") as caught:
        blocks_of(CharGPT(**TINY), ["Nope"])
    assert "\n" not in str(caught.value)
    config = lm_config(tmp_path, "nope", "sync")
    overrides = ['sync.mode="fsdp"', 'sync.fsdp_blocks=["Block", "Nope"]']
    with pytest.raises(ConfigError, match="Nope match no module of the model") as caught:
        prepare(config, overrides=overrides)
    assert "\n" not in str(caught.value) and "Block" in str(caught.value)


def test_fsdp_refuses_fp16_in_one_line(tmp_path):
    config = lm_config(tmp_path, "refused", "sync")
    with pytest.raises(ConfigError, match='use "bf16"') as caught:
        prepare(config, overrides=['sync.mode="fsdp"', 'run.precision="fp16"'])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_numels_are_what_fully_shard_gathers(world):
    """Per unit, the values a rank sends in FSDP2's all-gather: torch's own sharded
    parameters on a fake process group of `world` ranks (padding included: 7 and 5 rows do
    not divide by 2 or 3)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = nn.Sequential(
        nn.Linear(7, 5), nn.ReLU(), nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3)), nn.Linear(3, 2)
    )
    planned = fsdp.exchange_numels(model, None, world)
    assert [name for name, _ in planned] == ["0", "2", "3", ""]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        fsdp.shard(model, None)
        sent = []
        for name in ["0", "2", "3", ""]:
            group = model.get_submodule(name)._get_fsdp_state()._fsdp_param_group
            numels = [p._sharded_param_data.numel() for p in group.fsdp_params] if group else []
            sent.append((name, sum(numels)))
    finally:
        dist.destroy_process_group()
    assert planned == sent
