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

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from scaleout.data import make_loader
from scaleout.nn.layerwise import LayerwiseModel
from scaleout.train.job import LossFn

Reduce = Callable[[Tensor], Tensor]  # sums a worker's parts over its model-parallel group


def _no_reduce(values: Tensor) -> Tensor:
    return values


def is_classification(dataset: Dataset) -> bool:
    """Whether the targets are class indices (integers): accuracy is reported then."""
    example = dataset[0]
    if not isinstance(example, tuple | list) or len(example) < 2:
        return False
    target = example[1]
    if isinstance(target, bool):
        return False
    if isinstance(target, int):
        return True
    return isinstance(target, Tensor) and target.dim() == 0 and not target.is_floating_point()


def objective_for(model: nn.Module, loss: LossFn, test_set: Dataset) -> Objective:
    """The objective of `model`: layer-wise when it has phases, else supervised."""
    if isinstance(model, LayerwiseModel):
        return Layerwise()
    return Supervised(loss, is_classification(test_set))


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
    """`loss(model(x), y)`; accuracy when the targets are class indices."""

    def __init__(self, loss: LossFn, classification: bool) -> None:
        self.loss, self.classification = loss, classification

    def parameter_groups(self, model: nn.Module, phase: int, lr: float) -> Sequence[Any]:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]

    def begin_phase(self, model: nn.Module, batch: Sequence[Tensor], phase: int) -> None:
        pass

    def step(
        self, model: nn.Module, forward: nn.Module, batch: Sequence[Tensor], phase: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one minibatch, and its sums (detached): loss x examples, and the
        number of right predictions."""
        x, y = batch[0], batch[1]
        out = forward(x)  # (N, num_classes) for classifiers
        loss = self.loss(out, y)
        sums = {"loss": loss.detach() * len(y)}
        if self.classification:
            sums["correct"] = (out.detach().argmax(dim=1) == y).sum()
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
        """Mean loss (and accuracy) of `model` on `test_set`, in eval mode."""
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        correct = torch.zeros((), device=device, dtype=torch.long)
        dtype = next(model.parameters()).dtype  # e.g. float64 for Sandblaster's convex runs
        loader = make_loader(test_set, batch_size, shuffle=False, pin_memory=device.type == "cuda")
        for batch in loader:
            x, y = _to_device(batch, device, dtype)
            out = model(x)
            loss_sum += self.loss(out, y).double() * len(y)
            if self.classification:
                correct += (out.argmax(dim=1) == y).sum()
        model.train(was_training)
        count = len(test_set)  # type: ignore[arg-type]
        metrics = {"test_loss": loss_sum.item() / count}
        if self.classification:
            metrics["test_accuracy"] = correct.item() / count
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
