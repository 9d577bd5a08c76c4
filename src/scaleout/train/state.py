"""A replica's training state as checkpoint tensors, in the format every strategy shares.

`model.<name>` for the model's state dict, `optim.<param>.<key>` for the optimizer's tensors
(its scalars and hyper-parameters go to the metadata), `rng.torch` (and `rng.cuda`) for the
random streams. Strategy "single" writes exactly this; the others write it for their replica
0 (or the whole model assembled from its parts), so a checkpoint resumes under another
strategy or grid where the two train the same model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from scaleout.checkpoint import load_optimizer_state, optimizer_state, required_optimizer_part
from scaleout.errors import CheckpointError


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def model_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and metadata of a training state: parameters, buffers, optimizer, RNG."""
    tensors = model_tensors(model)
    meta: dict[str, Any] = {}
    if optimizer is not None:
        optim_tensors, meta["optimizer"] = optimizer_state(optimizer)
        tensors.update(optim_tensors)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors, meta


def load_model_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointError(
            f"checkpoint {source} does not fit the configured model: {str(err).splitlines()[0]}"
        ) from None


def load_model_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    source: str,
) -> None:
    """Inverse of `model_state`."""
    load_model_weights(model, tensors, source)
    if optimizer is not None:
        values, info = required_optimizer_part(tensors, meta, source)
        load_optimizer_state(optimizer, values, info)
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


@contextmanager
def restored(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside the block the parameters may take other values (the shards', the workers'
    average) to be evaluated; afterwards they are put back as they were."""
    params = list(params)
    saved = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)
