"""Where the receptive fields and blocks of a `LocallyConnected2d` lie: counts, shapes and the
pixel windows a range of block positions reads and writes (used to partition a layer over H
and W), with no tensors beyond the coverage mask.

Placement is "valid": fields start at 0, s, 2s, ... while they fit, so there are
(size - field) // step + 1 positions per axis and input pixels no field reaches are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LocalGeometry", "pair"]


def pair(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    """(height, width) from one positive int or a pair of them (a layer's `in_size`)."""
    values = (value, value) if isinstance(value, int) else tuple(value)
    if len(values) != 2 or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return values  # type: ignore[return-value]


@dataclass(frozen=True)
class LocalGeometry:
    """Where the receptive fields and blocks of a `LocallyConnected2d` lie.

    Block position (r, c) reads input pixels [r*step, r*step + field) x [c*step, c*step +
    field) of every channel and writes output pixels [r*bh, (r+1)*bh) x [c*bw, (c+1)*bw) of
    every map.
    """

    in_channels: int
    in_height: int
    in_width: int
    field: int
    step: int
    block_height: int
    block_width: int
    depth: int

    def __post_init__(self) -> None:
        for name in ("in_channels", "in_height", "in_width", "field", "step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("block_height", "block_width", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"block {name} must be >= 1, got {getattr(self, name)}")
        if self.field > min(self.in_height, self.in_width):
            raise ValueError(
                f"field = {self.field} does not fit the {self.in_height}x{self.in_width} input; "
                f"use a field of at most {min(self.in_height, self.in_width)}"
            )

    @property
    def positions_h(self) -> int:
        return (self.in_height - self.field) // self.step + 1

    @property
    def positions_w(self) -> int:
        return (self.in_width - self.field) // self.step + 1

    @property
    def num_positions(self) -> int:
        return self.positions_h * self.positions_w

    @property
    def block_size(self) -> int:
        """K: neurons per block, the rows of each block's weight matrix."""
        return self.block_height * self.block_width * self.depth

    @property
    def field_size(self) -> int:
        """F: inputs per receptive field, the columns of each block's weight matrix."""
        return self.field * self.field * self.in_channels

    @property
    def out_height(self) -> int:
        return self.positions_h * self.block_height

    @property
    def out_width(self) -> int:
        return self.positions_w * self.block_width

    @property
    def in_shape(self) -> tuple[int, int, int]:
        return (self.in_channels, self.in_height, self.in_width)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.depth, self.out_height, self.out_width)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.positions_h, self.positions_w, self.block_size, self.field_size)

    @property
    def num_weights(self) -> int:
        return self.num_positions * self.block_size * self.field_size

    def matmul_flops(self, batch: int) -> int:
        """FLOPs of one of W x, W^T y, delta x^T on a minibatch (a multiply-add is 2)."""
        return 2 * batch * self.num_weights

    def input_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        """Input pixel rows and columns read by the blocks at `block_rows` x `block_cols`."""
        return (
            self._span(block_rows, self.positions_h, "block_rows"),
            self._span(block_cols, self.positions_w, "block_cols"),
        )

    def output_window(self, block_rows: range, block_cols: range) -> tuple[range, range]:
        """Output pixel rows and columns written by the blocks at `block_rows` x `block_cols`."""
        rows = self._check(block_rows, self.positions_h, "block_rows")
        cols = self._check(block_cols, self.positions_w, "block_cols")
        return (
            range(rows.start * self.block_height, rows.stop * self.block_height),
            range(cols.start * self.block_width, cols.stop * self.block_width),
        )

    def blocks_reading(self, in_rows: range, in_cols: range) -> tuple[range, range]:
        """Block positions whose fields overlap input pixels `in_rows` x `in_cols`."""
        return (
            self._readers(in_rows, self.positions_h),
            self._readers(in_cols, self.positions_w),
        )

    def sub(self, block_rows: range, block_cols: range) -> LocalGeometry:
        """The geometry of blocks `block_rows` x `block_cols` alone, on their input window:
        `weight[rows.start:rows.stop, cols.start:cols.stop]` applied to that window."""
        rows, cols = self.input_window(block_rows, block_cols)
        return LocalGeometry(
            self.in_channels,
            len(rows),
            len(cols),
            self.field,
            self.step,
            self.block_height,
            self.block_width,
            self.depth,
        )

    def coverage(self, device: torch.device | str | None = None) -> Tensor:
        """(H, W) bool mask of input pixels some field reads."""
        rows = torch.zeros(self.in_height, dtype=torch.bool, device=device)
        cols = torch.zeros(self.in_width, dtype=torch.bool, device=device)
        for r in range(self.positions_h):
            rows[r * self.step : r * self.step + self.field] = True
        for c in range(self.positions_w):
            cols[c * self.step : c * self.step + self.field] = True
        return rows[:, None] & cols[None, :]

    def _check(self, blocks: range, count: int, name: str) -> range:
        if blocks.step != 1 or not 0 <= blocks.start < blocks.stop <= count:
            raise ValueError(f"{name} must be a non-empty range within 0..{count}, got {blocks}")
        return blocks

    def _span(self, blocks: range, count: int, name: str) -> range:
        blocks = self._check(blocks, count, name)
        return range(blocks.start * self.step, (blocks.stop - 1) * self.step + self.field)

    def _readers(self, pixels: range, count: int) -> range:
        first = max(0, -(-(pixels.start - self.field + 1) // self.step))
        last = min(count, (pixels.stop - 1) // self.step + 1)
        return range(first, max(first, last))
