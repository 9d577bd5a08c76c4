"""1-bit quantisation (Seide et al. 2014), the comparison method of the 8-bit paper (5.3).

Each value becomes one bit, its sign (zero counts as positive); a group of values (the whole
tensor, or each block of `block_size` values, e.g. a row) sends two floats, the mean of its
non-negative values and the mean of its negative values, which the receiver substitutes
for the bits. An empty group's mean is 0. The error is large, so on its own 1-bit
quantisation does not train; it needs error feedback (`ErrorFeedback(get("onebit"))`),
which adds each message's error to the next one, as CNTK's 1-bit SGD does.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
import torch.nn.functional as F

from scaleout.compress.codecs import Codec, NonFinite
from scaleout.compress.payload import Encoded

_SHIFTS = torch.arange(8, dtype=torch.uint8)  # bit i of byte j holds value 8 * j + i


class OneBitCodec(Codec):
    name = "onebit"

    def __init__(self, block_size: int | None = None, nonfinite: NonFinite = "raise") -> None:
        super().__init__(nonfinite)
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size = {block_size!r}: give a positive integer or None")
        self.block_size = block_size

    @property
    def options(self) -> dict[str, object]:
        return {"block_size": self.block_size} | super().options

    def _groups(self, n: int) -> tuple[int, int]:
        """(number of groups, values per group) covering n values."""
        length = self.block_size or max(n, 1)
        return math.ceil(n / length) if self.block_size else 1, length

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Encoded:
        flat = self._flat(x).float()
        n = flat.numel()
        flag = self._nonfinite(int((~torch.isfinite(flat)).sum()), n)
        num_groups, length = self._groups(n)
        positive = flat >= 0  # (n,); zero and -0.0 count as positive
        pad = num_groups * length - n
        means = torch.stack(
            [_group_means(flat, positive, length, pad), _group_means(flat, ~positive, length, pad)],
            dim=1,
        )  # (G, 2): mean of the non-negative, mean of the negative values
        bits = F.pad(positive.to(torch.uint8), (0, -n % 8)).view(-1, 8)
        codes = (bits << _SHIFTS.to(bits.device)).sum(1, dtype=torch.uint8)  # (ceil(n / 8),)
        if flag:
            means = torch.zeros_like(means)
        block = self.block_size or 0
        return Encoded(self.name, x.dtype, tuple(x.shape), codes, means.view(-1), block, flag)

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(encoded)
        device = encoded.codes.device
        if encoded.nonfinite:
            return self._into(self._nan(encoded, device), out)
        n = encoded.numel
        bits = (encoded.codes.view(-1, 1) >> _SHIFTS.to(device)) & 1  # (ceil(n / 8), 8)
        means = encoded.scales.to(device, torch.float32).view(-1, 2)  # (G, 2)
        length = encoded.block_size or max(n, 1)
        bits = F.pad(bits.view(-1)[:n], (0, -n % length)).view(-1, length).bool()  # (G, L)
        values = torch.where(bits, means[:, :1], means[:, 1:]).view(-1)[:n]
        return self._into(values.to(encoded.dtype).view(encoded.shape), out)


def _group_means(values: torch.Tensor, mask: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """Mean of `values` where `mask`, per group of `length` consecutive values (the last
    padded with `pad` zeros); 0 for a group with none. values, mask (n,) -> (G,)."""
    total = F.pad(torch.where(mask, values, 0.0), (0, pad)).view(-1, length).sum(1)
    count = F.pad(mask.to(torch.int32), (0, pad)).view(-1, length).sum(1)
    return total / count.clamp(min=1)
