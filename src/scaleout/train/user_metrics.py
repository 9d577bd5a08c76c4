"""A user's own test metrics: `fn(output, target) -> {name: batch mean}`.

Given as `scaleout.fit(metrics=fn)` or `[train] metrics = "package.module:function"`, the
function sees the model's output as it is (a tensor, a tuple, a Hugging Face `ModelOutput`)
and the batch's targets, and returns numbers. The driver logs each as `test_<name>`: its
batch means weighted by the batches' sizes over the whole test set, at every evaluation.
A function that raises or returns anything but numbers is one line naming it, checked on
one batch before training starts and at every call after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from scaleout.errors import ConfigError, UserError
from scaleout.factories import one_line

MetricsFn = Callable[[Any, Tensor], Mapping[str, Any]]
MetricSource = tuple[MetricsFn, str]  # a user's metrics function and its name


def call_metrics(
    fn: MetricsFn,
    name: str,
    output: Any,  # noqa: ANN401 - whatever the model returns
    target: Tensor,
    error: type[UserError] = UserError,
) -> dict[str, float]:
    """`fn(output, target)` as {name: float}; `error` (one line naming `name`) when it
    raises or returns something else."""
    try:
        result = fn(output, target)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: one line, never a traceback
        raise error(f"train.metrics = {name!r} raised {one_line(err)}; fix the function") from None
    if not isinstance(result, Mapping):
        raise error(
            f"train.metrics = {name!r} returned a {type(result).__name__}: return a dict of "
            "batch means, e.g. {'top5': 0.93}"
        )
    values: dict[str, float] = {}
    for key, value in result.items():
        number = _number(value)
        if not isinstance(key, str) or not key or number is None:
            raise error(
                f"train.metrics = {name!r} returned {key!r}: {_shown(value)}: every entry "
                "must be a name and a number (a float, an int or a one-value tensor)"
            )
        values[key] = number
    return values


def _number(value: Any) -> float | None:  # noqa: ANN401
    if isinstance(value, bool):
        return None
    if isinstance(value, Real):
        return float(value)
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.detach().float().item())
    return None


def _shown(value: Any) -> str:  # noqa: ANN401
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class MetricSums:
    """Batch means of a user's metrics, weighted by batch size over an evaluation."""

    def __init__(self, fn: MetricsFn, name: str) -> None:
        self.fn, self.name = fn, name
        self.sums: dict[str, float] = {}
        self.examples = 0

    def add(self, output: Any, target: Tensor) -> None:  # noqa: ANN401
        batch = len(target)
        for key, value in call_metrics(self.fn, self.name, output, target).items():
            self.sums[key] = self.sums.get(key, 0.0) + value * batch
        self.examples += batch

    def means(self) -> dict[str, float]:
        """`test_<name>` for each metric."""
        count = max(self.examples, 1)
        return {f"test_{key}": total / count for key, total in self.sums.items()}


@torch.no_grad()
def check_metrics(fn: MetricsFn, name: str, model: torch.nn.Module, x: Tensor, y: Tensor) -> None:
    """Call `fn` on `model`'s output for one batch (x, y): a `ConfigError` before training
    when it raises or returns anything but numbers."""
    was_training = model.training
    model.eval()
    try:
        output = model(x)
    finally:
        model.train(was_training)
    call_metrics(fn, name, output, y, ConfigError)
