"""What training minimises, and how the test set measures it.

Two kinds of model:

- supervised (any `nn.Module`): the loss of `model(x)` against `y` (the user's loss
  function, cross-entropy by default), with accuracy when the targets are class indices;
- layer-wise (a model with `phase_objective`, such as the sparse autoencoder): trained
  greedily, one phase (stack) at a time, each phase with its own objective, parameters and
  a start-of-phase fit (`begin_phase`). See `LayerwiseModel`.

Every strategy trains through an `Objective`, so a model means the same training whether it
runs on one worker, a grid or a parameter server. Sums are per example (value x examples),
so windows of steps and the parts of a model-parallel worker add up exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from scaleout.data import make_loader
from scaleout.nn.layerwise import LayerwiseModel
from scaleout.train.job import LossFn
from scaleout.train.outputs import accuracy_sum, correct_counts, cross_entropy, is_class_target
from scaleout.train.user_metrics import MetricSource, MetricSums

MAX_LOG_PERPLEXITY = 700.0  # exp(700) ~ 1e304: a diverged loss gives a huge, finite number

Reduce = Callable[[Tensor], Tensor]  # sums a worker's parts over its model-parallel group


def _no_reduce(values: Tensor) -> Tensor:
    return values


def is_classification(dataset: Dataset) -> bool:
    """Whether the targets are class indices (integers, of any shape): accuracy is reported
    then, wherever the model's logits fit them (`scaleout.train.outputs`)."""
    example = dataset[0]
    if not isinstance(example, tuple | list) or len(example) < 2:
        return False
    target = example[1]
    if isinstance(target, np.ndarray | np.integer):
        target = torch.as_tensor(target)
    return is_class_target(target)


def objective_for(
    model: nn.Module, loss: LossFn, test_set: Dataset, metrics: MetricSource | None = None
) -> Objective:
    """The objective of `model`: layer-wise when it has phases, else supervised."""
    if isinstance(model, LayerwiseModel):
        return Layerwise()
    return Supervised(loss, is_classification(test_set), metrics)


class Objective(Protocol):
    """How a worker trains and evaluates its model (`Supervised` or `Layerwise`)."""

    def parameter_groups(self, model: nn.Module, phase: int, lr: float) -> Sequence[Any]: ...
    def begin_phase(self, model: nn.Module, batch: Sequence[Tensor], phase: int) -> None: ...
    def step(
        self, model: nn.Module, forward: nn.Module, batch: Sequence[Tensor], phase: int
    ) -> tuple[Tensor, dict[str, Tensor]]: ...
    def evaluate(
        self,
        model: nn.Module,
        test_set: Dataset,
        batch_size: int,
        device: torch.device,
        phase: int,
        reduce: Reduce = _no_reduce,
    ) -> dict[str, float]: ...
    def phase_metrics(self, model: nn.Module, phase: int) -> dict[str, Any]: ...


def _to_device(batch: Sequence[Tensor], device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """Inputs to the model's device and floating dtype (float64 for Sandblaster's convex
    runs); targets keep theirs."""
    moved = []
    for i, t in enumerate(batch):
        t = torch.as_tensor(t)
        cast = dtype if i == 0 and t.is_floating_point() else None
        moved.append(t.to(device, cast, non_blocking=True))
    return moved


class Supervised:
    """`loss(model(x), y)`; accuracy (token accuracy for sequence models) when the targets
    are class indices the logits fit; perplexity with the default cross-entropy; the user's
    metrics (`metrics`: the function and its name) at every evaluation."""

    def __init__(
        self, loss: LossFn, classification: bool, metrics: MetricSource | None = None
    ) -> None:
        self.loss, self.classification, self.metrics = loss, classification, metrics
        self.perplexity = loss is cross_entropy

    def parameter_groups(self, model: nn.Module, phase: int, lr: float) -> Sequence[Any]:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]

    def begin_phase(self, model: nn.Module, batch: Sequence[Tensor], phase: int) -> None:
        pass

    def step(
        self, model: nn.Module, forward: nn.Module, batch: Sequence[Tensor], phase: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one minibatch, and its sums (detached): loss x examples, and
        accuracy x examples (right predictions, for one target per example)."""
        x, y = batch[0], batch[1]
        out = forward(x)  # (N, C), (N, T, C), a tuple, a ModelOutput, ...
        loss = self.loss(out, y)
        sums = {"loss": loss.detach() * len(y)}
        if self.classification:
            correct = accuracy_sum(out, y)  # argmax and compare: outside autograd
            if correct is not None:
                sums["correct"] = correct
        return loss, sums

    @torch.inference_mode()
    def evaluate(
        self,
        model: nn.Module,
        test_set: Dataset,
        batch_size: int,
        device: torch.device,
        phase: int = 0,
        reduce: Reduce = _no_reduce,
    ) -> dict[str, float]:
        """Mean loss, accuracy (over every target counted), perplexity and the user's
        metrics of `model` on `test_set`, in eval mode."""
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        right = torch.zeros((), device=device, dtype=torch.long)
        counted = torch.zeros((), device=device, dtype=torch.long)
        fits = self.classification
        user = MetricSums(*self.metrics) if self.metrics is not None else None
        dtype = next(model.parameters()).dtype  # e.g. float64 for Sandblaster's convex runs
        loader = make_loader(test_set, batch_size, shuffle=False, pin_memory=device.type == "cuda")
        for batch in loader:
            x, y = _to_device(batch, device, dtype)
            out = model(x)
            loss_sum += self.loss(out, y).double() * len(y)
            if fits:
                counts = correct_counts(out, y)
                if counts is None:
                    fits = False
                else:
                    right += counts[0]
                    counted += counts[1]
            if user is not None:
                user.add(out, y)
        model.train(was_training)
        count = len(test_set)  # type: ignore[arg-type]
        metrics = {"test_loss": loss_sum.item() / count}
        if fits:
            metrics["test_accuracy"] = right.item() / max(counted.item(), 1)
        if self.perplexity:
            metrics["test_perplexity"] = math.exp(min(metrics["test_loss"], MAX_LOG_PERPLEXITY))
        if user is not None:
            metrics.update(user.means())
        return metrics

    def phase_metrics(self, model: nn.Module, phase: int) -> dict[str, Any]:
        return {}


class Layerwise:
    """Greedy layer-wise training of a `LayerwiseModel`: phase k's terms, per example."""

    def parameter_groups(self, model: nn.Module, phase: int, lr: float) -> Sequence[Any]:
        model.train_only(phase)  # type: ignore[operator]
        return model.phase_parameter_groups(phase, lr)  # type: ignore[operator]

    def begin_phase(self, model: nn.Module, batch: Sequence[Tensor], phase: int) -> None:
        model.begin_phase(batch[0], phase)  # type: ignore[operator]

    def step(
        self, model: nn.Module, forward: nn.Module, batch: Sequence[Tensor], phase: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        x = batch[0]
        terms: dict[str, Tensor] = model.phase_objective(x, phase)  # type: ignore[operator]
        loss = sum(terms.values())
        sums = {name: value.detach().double() * len(x) for name, value in terms.items()}
        sums["loss"] = sum(sums.values())  # type: ignore[assignment]
        return loss, sums  # type: ignore[return-value]

    @torch.no_grad()
    def evaluate(
        self,
        model: nn.Module,
        test_set: Dataset,
        batch_size: int,
        device: torch.device,
        phase: int = 0,
        reduce: Reduce = _no_reduce,
    ) -> dict[str, float]:
        """Phase `phase`'s objective per example on the test set: `test_loss` and each term
        as `test_<term>` (a model-parallel worker's parts summed by `reduce`)."""
        names: list[str] = []
        sums: Tensor | None = None
        for batch in make_loader(test_set, batch_size, shuffle=False):
            x = batch[0].to(device)
            terms = model.phase_objective(x, phase)  # type: ignore[operator]
            names = list(terms)
            values = torch.stack([terms[n].double() for n in names]) * len(x)
            sums = values if sums is None else sums + values
        assert sums is not None, "an empty test set"
        means = (reduce(sums) / len(test_set)).tolist()  # type: ignore[arg-type]
        metrics = {f"test_{name}": value for name, value in zip(names, means, strict=True)}
        metrics["test_loss"] = sum(means)
        return {"test_loss": metrics.pop("test_loss"), **metrics}

    def phase_metrics(self, model: nn.Module, phase: int) -> dict[str, Any]:
        return model.phase_metrics(phase)  # type: ignore[operator]
