"""The codec interface and the float and 8-bit table codecs.

`codec.encode(tensor, key=None) -> Encoded` and `codec.decode(encoded, out=None) -> tensor`
(same dtype and shape as the input: float32, float16 or bfloat16; into `out`, a contiguous
tensor of as many values of that dtype, when given: the table codecs then allocate
nothing, which matters for large messages, where a new tensor's first touch of its
memory costs more than the decoding). `key` names the tensor across
calls for codecs that keep state per tensor: the cached absmax of `refresh_every > 1` here,
the residual of `ErrorFeedback`. Without a key, all tensors of one size on one device share
that state, so give a key wherever several such tensors pass through one codec.

Inf and NaN in the input raise `NonFiniteInput` (`nonfinite="raise"`, the default), or, with
`nonfinite="flag"`, produce a message marked `nonfinite` that decodes to all NaN, so every
receiver sees the overflow at once (as AMP's gradient scaler expects) instead of one sender
failing alone. The DDP hook uses "flag", so that no rank leaves a collective.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Literal

import torch

from scaleout.compress import kernels
from scaleout.compress.payload import ABSMAX_CODECS, Encoded, layout
from scaleout.compress.tables import Rounding, get_table
from scaleout.errors import UserError

NonFinite = Literal["raise", "flag"]
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NonFiniteInput(UserError):
    """A tensor with Inf or NaN given to a codec that refuses them."""


class Codec(ABC):
    """Turns a tensor into an `Encoded` message and back; see the module docstring."""

    name: str

    def __init__(self, nonfinite: NonFinite = "raise") -> None:
        if nonfinite not in ("raise", "flag"):
            raise ValueError(f"nonfinite = {nonfinite!r}: use 'raise' or 'flag'")
        self.nonfinite: NonFinite = nonfinite

    @property
    def options(self) -> dict[str, object]:
        """The options `get(self.name, **options)` rebuilds this codec from."""
        return {"nonfinite": self.nonfinite}

    @abstractmethod
    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Encoded: ...

    @abstractmethod
    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def forget(self, key: Hashable) -> None:  # noqa: B027 - stateless codecs keep nothing
        """Drop any state kept for `key` (cached scales, residuals)."""

    def encodes(self, numel: int) -> bool:
        """Whether a message of `numel` values travels encoded: always, but on a link where
        raw can be faster (`scaleout.compress.link.OnLink`)."""
        return True

    def raw(self, x: torch.Tensor, key: Hashable | None = None) -> torch.Tensor:
        """What a message of `x` that this codec lets travel raw (`encodes` False) carries:
        x itself, unless the codec keeps a residual for it (`ErrorFeedback`)."""
        return x

    def roundtrip(self, x: torch.Tensor, key: Hashable | None = None) -> torch.Tensor:
        """decode(encode(x)): what a receiver of x gets."""
        return self.decode(self.encode(x, key))

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({self.name!r}, {options})"

    # --- helpers for subclasses ------------------------------------------------------------

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec {self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in INPUT_DTYPES:
            raise ValueError(
                f"codec {self.name}: tensor dtype {x.dtype} is not supported; "
                "give float32, float16 or bfloat16 (e.g. x.float())"
            )
        if x.requires_grad:
            x = x.detach()
        return x if x.dim() == 1 else x.reshape(-1)  # a view costs about a microsecond

    def _nonfinite(self, num_bad: int, numel: int, what: str = "Inf/NaN values") -> bool:
        """True when the message must be flagged; raises under the "raise" policy."""
        if num_bad == 0:
            return False
        if self.nonfinite == "raise":
            raise NonFiniteInput(
                f"codec {self.name}: the tensor holds {num_bad} {what} among {numel}; fix "
                "the values (a diverging loss?) or build the codec with nonfinite='flag' "
                "to send them as a message that decodes to NaN"
            )
        return True

    def _check(self, encoded: Encoded) -> None:
        if encoded.codec != self.name:
            raise ValueError(
                f"codec {self.name} cannot decode a {encoded.codec} message; use "
                f"scaleout.compress.decode(encoded) or get({encoded.codec!r})"
            )

    @staticmethod
    def _nan(encoded: Encoded, device: torch.device) -> torch.Tensor:
        return torch.full(encoded.shape, float("nan"), dtype=encoded.dtype, device=device)

    @staticmethod
    def _into(values: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """`values` as decode returns them: copied into `out` (checked) when given."""
        if out is None:
            return values
        kernels.check_out(out, values.numel(), values.dtype, values.device)
        out.view(-1).copy_(values.view(-1))
        return out


class FloatCodec(Codec):
    """fp32 (identity), fp16 or bf16: a cast, sent as raw bytes."""

    def __init__(self, name: str, nonfinite: NonFinite = "raise") -> None:
        super().__init__(nonfinite)
        self.name = name
        self.wire_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            name
        ]

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Encoded:
        flat = self._flat(x)
        flag = self._nonfinite(int((~torch.isfinite(flat)).sum()), flat.numel())
        wire = flat.to(self.wire_dtype).contiguous()
        if not flag:  # a finite value too large for fp16 becomes Inf
            flag = self._nonfinite(
                int((~torch.isfinite(wire)).sum()), flat.numel(), f"values beyond {self.name}"
            )
        if wire.numel():
            codes = wire.view(torch.uint8)
        else:  # an empty tensor may have any strides; view(uint8) refuses some
            codes = torch.empty(0, dtype=torch.uint8, device=x.device)
        scales = torch.empty(0, device=x.device)
        return Encoded(self.name, x.dtype, tuple(x.shape), codes, scales, 0, flag)

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(encoded)
        device = encoded.codes.device
        if encoded.nonfinite:
            return self._into(self._nan(encoded, device), out)
        if encoded.numel == 0:
            return self._into(torch.empty(encoded.shape, dtype=encoded.dtype, device=device), out)
        codes = encoded.codes.contiguous()
        if codes.storage_offset() % self.wire_dtype.itemsize:  # a slice of a gathered buffer
            codes = codes.clone()
        wire = codes.view(self.wire_dtype)
        return self._into(wire.to(encoded.dtype).view(encoded.shape), out)


class TableCodec(Codec):
    """An 8-bit table codec (dynamic8, dynamic8_bnb, linear8: absmax-normalised, per tensor
    or per block of `block_size` values; static8, mantissa8: fixed scale 10^K with K the
    `exponent_offset`, 1 by default, 2 in the paper for N(0, 10^2)).

    `refresh_every = k` recomputes the absmax on every k-th call per key and reuses it in
    between (the paper: every 50 batches); inputs beyond a stale scale are clamped to the
    largest code. `rounding`: "nearest" or "paper" (the 2015 kernel's, to reproduce its
    table)."""

    def __init__(
        self,
        name: str,
        block_size: int | None = None,
        refresh_every: int = 1,
        rounding: Rounding = "nearest",
        exponent_offset: int | None = None,
        nonfinite: NonFinite = "raise",
    ) -> None:
        super().__init__(nonfinite)
        self.name = name
        self.table_name = name
        self.absmax = name in ABSMAX_CODECS
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size = {block_size!r}: give a positive integer or None")
        if not isinstance(refresh_every, int) or refresh_every < 1:
            raise ValueError(f"refresh_every = {refresh_every!r}: give a positive integer")
        if exponent_offset is not None and not -30 <= exponent_offset <= 30:
            raise ValueError(f"exponent_offset = {exponent_offset}: give an integer in -30..30")
        get_table(name).thresholds(rounding)  # validates rounding for this table
        self.block_size = block_size
        self.refresh_every = refresh_every
        self.rounding: Rounding = rounding
        self.exponent_offset = 1 if exponent_offset is None and not self.absmax else exponent_offset
        self._cached: dict[Hashable, tuple[int, torch.Tensor]] = {}  # key -> (calls, scales)

    @property
    def options(self) -> dict[str, object]:
        options: dict[str, object] = {"rounding": self.rounding}
        if self.absmax:
            options |= {"block_size": self.block_size, "refresh_every": self.refresh_every}
        else:
            options["exponent_offset"] = self.exponent_offset
        return options | super().options

    def encode(self, x: torch.Tensor, key: Hashable | None = None) -> Encoded:
        flat = self._flat(x)
        table = kernels.lookup(self.table_name, self.rounding, flat.device)
        block = self.block_size if self.absmax else None
        if flat.numel() == 0:
            num_scales = layout(self.name, 0, block or 0)[1]
            scales = torch.full((num_scales,), self._fixed_scale(), device=flat.device)
            codes = torch.empty(0, dtype=torch.uint8, device=flat.device)
            return Encoded(self.name, x.dtype, tuple(x.shape), codes, scales, block or 0)
        given = self._given_scales(flat, key)
        codes, scales, num_bad = kernels.encode(flat, given, table, block)
        flag = self._nonfinite(num_bad, flat.numel())
        if flag and self.absmax:
            scales = torch.zeros_like(scales)  # an absmax of Inf/NaN: keep the payload valid
        elif self.absmax and self.refresh_every > 1 and given is None:
            self._cached[self._key(flat, key)] = (0, scales)
        return Encoded(self.name, x.dtype, tuple(x.shape), codes, scales.view(-1), block or 0, flag)

    def _fixed_scale(self) -> float:
        return 0.0 if self.absmax else 10.0 ** (self.exponent_offset or 0)

    def _key(self, flat: torch.Tensor, key: Hashable | None) -> Hashable:
        return key if key is not None else (flat.numel(), str(flat.device))

    def _given_scales(self, flat: torch.Tensor, key: Hashable | None) -> torch.Tensor | None:
        """The scales to use instead of a fresh absmax, or None to compute it."""
        if not self.absmax:
            return torch.full((1, 1), self._fixed_scale(), device=flat.device)
        if self.refresh_every == 1:
            return None
        cache_key = self._key(flat, key)
        cached = self._cached.get(cache_key)
        num_blocks = layout(self.name, flat.numel(), self.block_size or 0)[1]
        if cached is None or cached[1].shape[0] != num_blocks:
            return None
        calls, scales = cached
        if calls + 1 >= self.refresh_every:
            return None
        self._cached[cache_key] = (calls + 1, scales)
        return scales

    def forget(self, key: Hashable) -> None:
        self._cached.pop(key, None)

    def reset(self) -> None:
        """Forget the cached scales."""
        self._cached.clear()

    def decode(self, encoded: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(encoded)
        device = encoded.codes.device
        if encoded.nonfinite:
            return self._into(self._nan(encoded, device), out)
        if encoded.numel == 0:
            return self._into(torch.empty(encoded.shape, dtype=encoded.dtype, device=device), out)
        table = kernels.lookup(self.table_name, "nearest", device)  # values: any rounding
        scales = encoded.scales
        if scales.dtype != torch.float32 or scales.device != device:
            scales = scales.to(device, torch.float32)
        block = encoded.block_size or None
        values = kernels.decode(encoded.codes, scales, table, block, encoded.dtype, out)
        if out is not None:
            return out
        return values if len(encoded.shape) == 1 else values.view(encoded.shape)
