"""What a model returns, and the default loss and accuracy read from it.

A model may return a tensor, a tuple or list (its first element is the logits), or a
mapping or object with `logits` (a Hugging Face `ModelOutput`). The default loss
(`cross_entropy`) and the accuracy use the logits, with the class dimension found from the
targets' shape:

- last, when `logits.shape[:-1] == target.shape`: sequence models, (N, T, C) for (N, T);
- second, when `logits.shape[2:] == target.shape[1:]`: torch's convention, (N, C, ...) for
  (N, ...); a classifier's (N, C) for (N,) fits both.

Targets equal to `IGNORE_INDEX` (-100, as torch's and Hugging Face's losses) count in
neither. A user's own loss or metrics get the model's output as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def logits_of(output: Any) -> Tensor:  # noqa: ANN401 - whatever the model returns
    """The logits of a model's output (see the module docstring)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], Tensor):
        return output[0]
    raise ValueError(
        f"the model returned a {type(output).__name__}: return a tensor, a tuple whose first "
        "element is the logits, or an object with `logits`; or give train.loss"
    )


def class_dim(logits: Tensor, target: Tensor) -> int | None:
    """The dimension of `logits` that holds the classes for integer `target`, or None when
    the shapes fit neither convention."""
    if logits.dim() < 1 or logits.dim() != target.dim() + 1:
        return None
    if logits.shape[:-1] == target.shape:
        return logits.dim() - 1
    if logits.dim() >= 2 and logits.shape[0] == target.shape[0]:
        if logits.shape[2:] == target.shape[1:]:
            return 1
    return None


def is_class_target(target: Any) -> bool:  # noqa: ANN401
    """Integer class indices (of any shape), for which accuracy is reported."""
    if isinstance(target, bool):
        return False
    if isinstance(target, int):
        return True
    return (
        isinstance(target, Tensor)
        and not target.is_floating_point()
        and (target.dtype != torch.bool and not target.is_complex())
    )


def cross_entropy(output: Any, target: Tensor) -> Tensor:  # noqa: ANN401
    """The default loss: mean cross-entropy of the output's logits over every target that
    is not `IGNORE_INDEX` (class probabilities of the logits' shape are taken as they are)."""
    logits = logits_of(output)
    if target.is_floating_point():
        return F.cross_entropy(logits, target)
    dim = class_dim(logits, target)
    if dim is None:
        raise ValueError(
            f"cross-entropy: outputs of shape {tuple(logits.shape)} do not fit targets of "
            f"shape {tuple(target.shape)}: the classes must be the last dimension ((N, T, C) "
            "for (N, T)) or the second ((N, C, ...) for (N, ...)); or give train.loss"
        )
    if dim == 1:
        return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX
    )


def correct_counts(output: Any, target: Tensor) -> tuple[Tensor, Tensor] | None:  # noqa: ANN401
    """(right predictions, targets counted) of the output's logits (tokens for a sequence
    model), or None where the logits do not fit the targets."""
    try:
        logits = logits_of(output)
    except ValueError:
        return None
    dim = class_dim(logits, target)
    if dim is None:
        return None
    predicted = logits.argmax(dim=dim)
    counted = target != IGNORE_INDEX
    return (predicted.eq(target) & counted).sum(), counted.sum()


def accuracy_sum(output: Any, target: Tensor) -> Tensor | None:  # noqa: ANN401
    """The batch's accuracy times its examples (a per-example sum, as every training sum
    is): right predictions over targets counted, x N; None where it does not apply."""
    counts = correct_counts(output, target)
    if counts is None:
        return None
    right, counted = counts
    if target.dim() <= 1:  # one target per example: the count itself, exactly
        return right.double()
    return right.double() / counted.clamp(min=1).double() * len(target)
