"""Cutting a model into pipeline stages: the forms that split, a cut as balanced as a brute
force over every cut finds, stages that compose to the model's forward under its own names,
and one line for what cannot be cut."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from scaleout.parallel.stages import (
    _balanced_cuts,
    split,
    splittable_parts,
    stage_module,
    tied_parameters,
)


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def largest(sizes: list[int], cut: tuple[int, ...]) -> int:
    """The largest run's sum when `sizes` is cut at `cut`."""
    bounds = [0, *cut, len(sizes)]
    return max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))


def test_the_cut_is_as_balanced_as_a_brute_force_finds():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        sizes = [rng.choice([0, rng.randint(1, 100)]) for _ in range(n)]
        stages = rng.randint(1, n)
        cuts = _balanced_cuts(sizes, stages)
        assert (
            len(cuts) == stages - 1 and cuts == sorted(set(cuts)) and all(0 < c < n for c in cuts)
        )

        every = itertools.combinations(range(1, n), stages - 1)
        best = min(largest(sizes, cut) for cut in every)
        assert largest(sizes, tuple(cuts)) == best


def test_stages_compose_to_the_models_forward_under_its_own_names():
    torch.manual_seed(0)
    model = cnn()
    plan = split(model, 3)
    assert [name for names in plan for name in names] == splittable_parts(model)
    stages = [stage_module(model, names) for names in plan]
    x = torch.randn(5, 1, 8, 8)  # (N, C, H, W)
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    names = {stage.full_name(n) for stage in stages for n in stage.state_dict()}
    assert names == set(model.state_dict())


def test_a_module_that_lists_its_parts_splits_in_that_order():
    class Listed(nn.Module):
        pipeline_split = ["embed", "body.0", "body.1", "head"]

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.body = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.head = nn.Linear(8, 2)

    plan = split(Listed(), 2)
    assert plan == [["embed", "body.0"], ["body.1", "head"]]


@pytest.mark.parametrize(
    ("model", "stages", "message"),
    [
        (cnn(), 10, "has 9 parts to cut between"),
        (nn.Linear(2, 2), 2, "give an nn.Sequential"),
        (type("Bad", (nn.Module,), {"pipeline_split": ["nope"]})(), 1, "'nope', which is no"),
    ],
)
def test_what_cannot_be_cut_is_one_line(model, stages, message):
    with pytest.raises(ValueError, match=message) as caught:
        split(model, stages)
    assert "\n" not in str(caught.value)


def test_a_parameter_tied_across_stages_is_held_by_each_stage_that_uses_it():
    embed, head = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.ReLU(), nn.Linear(4, 4), head)
    plan = split(model, 2)
    assert plan[0][0] == "0" and plan[1][-1] == "3"  # the embedding and the head apart
    (tied,) = tied_parameters(model, plan)
    assert (tied.index, tied.shape, tied.stages) == (0, (4, 4), (0, 1))
    assert tied_parameters(model, split(model, 1)) == []
