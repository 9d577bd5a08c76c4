"""A model's parameters as one flat vector, and its split into parameter-server shards.

`FlatParameters` re-points every parameter (and its gradient) of a model at a slice of two
contiguous buffers, so a fetch from the shards is a copy into `params` and a push is a slice
of `grads` — no per-tensor flattening on the hot path. Autograd accumulates into the
existing `.grad` views in place, so gradients of several steps add up in `grads` until they
are pushed and zeroed. `use_grads` moves the gradients to another buffer (a replica moves
between buffers in shared memory, so the shards read a push where it lies while the next
gradient adds up in another), and `use_params` the parameters (a fetch thread's fresh
values adopted without a copy).

`shard_ranges` cuts the vector into S contiguous ranges of near-equal size; a parameter may
span two shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from scaleout.errors import UserError


def shard_ranges(num_values: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, stop) of each shard; sizes differ by at most one."""
    if num_shards < 1:
        raise ValueError(f"downpour.num_shards must be >= 1, got {num_shards}")
    if num_shards > max(num_values, 1):
        raise ValueError(
            f"downpour.num_shards = {num_shards} exceeds the model's {num_values} parameters"
        )
    bounds = [num_values * i // num_shards for i in range(num_shards + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class FlatParameters:
    """Parameters and gradients of `params` (a module's trainable parameters, or a list of
    `(name, parameter)` / parameters) as views into two flat buffers."""

    def __init__(
        self, params: nn.Module | Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]]
    ) -> None:
        named = _named(params)
        if not named:
            raise ValueError("a flat parameter vector needs at least one trainable parameter")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"a flat parameter vector needs one dtype and one device, got {dtypes} on {devices}"
            )
        (dtype,), (device,) = dtypes, devices
        _check_unshared(named)
        self.entries: list[Entry] = []
        offset = 0
        for name, p in named:
            self.entries.append(Entry(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        self.numel = offset
        self.params = torch.empty(offset, dtype=dtype, device=device)  # (P,)
        self.grads = torch.zeros(offset, dtype=dtype, device=device)  # (P,)
        for entry, (_, p) in zip(self.entries, named, strict=True):
            view = self.params[entry.offset : entry.offset + entry.numel].view(entry.shape)
            view.copy_(p.detach())
            p.data = view
            p.grad = self.grads[entry.offset : entry.offset + entry.numel].view(entry.shape)
        self._params = [p for _, p in named]
        self.own_grads = self.grads  # where `grads` points unless `use_grads` moved it

    def use_grads(self, grads: torch.Tensor) -> None:
        """Point every parameter's `.grad` into `grads` (P,) from now on (e.g. a buffer in
        shared memory a push names where it lies); its values are kept."""
        self._check("gradient", grads)
        self.grads = grads
        for entry, p in zip(self.entries, self._params, strict=True):
            p.grad = grads[entry.offset : entry.offset + entry.numel].view(entry.shape)

    def use_params(self, params: torch.Tensor) -> None:
        """Point every parameter into `params` (P,) from now on (a fetch thread's fresh
        buffer, adopted without a copy); between steps only, with no graph alive."""
        self._check("parameter", params)
        self.params = params
        for entry, p in zip(self.entries, self._params, strict=True):
            p.data = params[entry.offset : entry.offset + entry.numel].view(entry.shape)

    def _check(self, what: str, buffer: torch.Tensor) -> None:
        own = self.own_grads
        if buffer.shape != own.shape or buffer.dtype != own.dtype or buffer.device != own.device:
            raise ValueError(
                f"a {what} buffer must be {tuple(own.shape)} {own.dtype} on {own.device}, "
                f"got {tuple(buffer.shape)} {buffer.dtype} on {buffer.device}"
            )

    def zero_grads(self) -> None:
        """Zero the gradient buffer in place (the parameters keep their views)."""
        self.grads.zero_()
        storage = self.grads.untyped_storage().data_ptr()
        for p in self._params:
            assert p.grad is not None and p.grad.untyped_storage().data_ptr() == storage, (
                "a gradient left the flat buffer: use zero_grads(), not model.zero_grad()"
            )

    def names(self) -> list[str]:
        return [e.name for e in self.entries]


def _check_unshared(named: list[tuple[str, nn.Parameter]]) -> None:
    """A parameter shared by two modules (tied weights) is one `nn.Parameter`, listed once;
    two distinct parameters over the same memory would get two places in the flat vector
    and part ways after the first step: one line naming them."""
    spans = sorted(
        (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), str(p.device), name)
        for name, p in named
        if p.numel()
    )
    for (_, end, device, first), (start, _, other_device, second) in zip(
        spans, spans[1:], strict=False
    ):
        if start < end and device == other_device:
            raise UserError(
                f"parameters {first} and {second} share memory but are two nn.Parameter "
                "objects: tie them by assigning one parameter to both modules "
                "(b.weight = a.weight), so it is trained as one"
            )


def _named(
    params: nn.Module | Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]],
) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params, nn.Module):
        return [(n, p) for n, p in params.named_parameters() if p.requires_grad]
    named = []
    for i, item in enumerate(params):
        named.append(item if isinstance(item, tuple) else (f"param{i}", item))
    return named
