"""Model outputs: the logits of a tensor, a tuple, a mapping or an object with `logits`;
the class dimension found from the targets; the default cross-entropy and token accuracy
against torch's own; a user's metrics checked as one line."""

from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from scaleout.errors import ConfigError, UserError
from scaleout.train.outputs import (
    accuracy_sum,
    class_dim,
    correct_counts,
    cross_entropy,
    logits_of,
)
from scaleout.train.user_metrics import MetricSums, call_metrics, check_metrics


@dataclass
class Output:  # as a Hugging Face ModelOutput: a dataclass with `logits`
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class MappingOutput(OrderedDict):  # ModelOutput is also an OrderedDict
    pass


def test_the_logits_of_every_kind_of_output():
    logits = torch.randn(4, 3)
    assert logits_of(logits) is logits
    assert logits_of((logits, torch.zeros(1))) is logits
    assert logits_of([logits]) is logits
    assert logits_of({"logits": logits, "loss": torch.zeros(())}) is logits
    assert logits_of(Output(logits)) is logits
    assert logits_of(MappingOutput(logits=logits)) is logits
    with pytest.raises(ValueError, match="returned a str"):
        logits_of("no")


def test_the_class_dimension_follows_the_targets():
    assert class_dim(torch.zeros(8, 10), torch.zeros(8, dtype=torch.long)) == 1
    assert class_dim(torch.zeros(8, 16, 50), torch.zeros(8, 16, dtype=torch.long)) == 2
    assert class_dim(torch.zeros(8, 5, 7, 9), torch.zeros(8, 7, 9, dtype=torch.long)) == 1
    assert class_dim(torch.zeros(8, 16, 50), torch.zeros(8, dtype=torch.long)) is None
    assert class_dim(torch.zeros(8, 10), torch.zeros(4, dtype=torch.long)) is None


def test_default_loss_equals_torch_cross_entropy_on_the_class_dimension():
    g = torch.Generator().manual_seed(0)
    seq, target = torch.randn(4, 6, 11, generator=g), torch.randint(0, 11, (4, 6), generator=g)
    target[0, :2] = -100  # ignored, as torch's and Hugging Face's losses do
    want = F.cross_entropy(seq.reshape(-1, 11), target.reshape(-1))
    torch.testing.assert_close(cross_entropy(Output(seq), target), want)
    images, pixels = torch.randn(2, 5, 3, 3, generator=g), torch.randint(0, 5, (2, 3, 3))
    torch.testing.assert_close(cross_entropy(images, pixels), F.cross_entropy(images, pixels))
    flat, labels = torch.randn(8, 4, generator=g), torch.randint(0, 4, (8,), generator=g)
    assert torch.equal(cross_entropy((flat,), labels), F.cross_entropy(flat, labels))
    with pytest.raises(ValueError, match=r"outputs of shape \(4, 6, 11\) do not fit targets"):
        cross_entropy(seq, torch.zeros(4, dtype=torch.long))


def test_token_accuracy_counts_every_target_but_the_ignored():
    logits = torch.zeros(2, 3, 4)
    logits[..., 1] = 1.0  # predicts class 1 everywhere
    target = torch.tensor([[1, 1, 2], [1, -100, 0]])
    right, counted = correct_counts(logits, target)
    assert (int(right), int(counted)) == (3, 5)
    assert float(accuracy_sum(logits, target)) == pytest.approx(3 / 5 * 2)
    labels = torch.tensor([1, 0, 1])
    assert float(accuracy_sum(torch.eye(4)[[1, 1, 1]], labels)) == 2.0  # a count, exactly
    assert accuracy_sum(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long)) is None


def test_user_metrics_are_weighted_by_batch_size():
    def mean_target(output, target):
        return {"mean": target.float().mean(), "n": len(target)}

    sums = MetricSums(mean_target, "m")
    sums.add(None, torch.tensor([0, 0, 0]))
    sums.add(None, torch.tensor([4]))
    assert sums.means() == {"test_mean": pytest.approx(1.0), "test_n": pytest.approx(2.5)}


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda out, y: 1 / 0, "raised ZeroDivisionError: division by zero; fix the function"),
        (lambda out, y: 0.5, "returned a float: return a dict"),
        (lambda out, y: {"acc": "high"}, "returned 'acc': 'high': every entry must be"),
        (lambda out, y: {"acc": torch.ones(3)}, "returned 'acc'"),
        (lambda out, y: {"ok": True}, "returned 'ok': True"),
    ],
)
def test_a_metrics_function_that_fails_is_one_line(fn, match):
    with pytest.raises(UserError, match=match) as raised:
        call_metrics(fn, "pkg:fn", torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    assert len(str(raised.value).splitlines()) == 1
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match=match):
        check_metrics(fn, "pkg:fn", model, torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
