"""Window arithmetic for model parallelism over a 2-D grid of workers (COTS HPC section 4.2,
DistBelief section 3): which part of an (N, C, H, W) activation each worker computes and which
part it must read. Pure functions on integer ranges; no processes, no tensors.

A grid of `grid = (px, py)` workers splits H in `px` parts (grid axis 0) and W in `py` parts
(grid axis 1); worker (a, b) has rank a * py + b. For a `LocallyConnected2d` the unit of
partitioning is the block position (its neurons share one receptive field), so worker (a, b)
owns block rows `split_even(P_h, px)[a]` and block columns `split_even(P_w, py)[b]`:

- its **output window** out_i is the output pixels those blocks write, and the output windows
  of all workers tile the global output exactly once;
- its **input window** in_i is the union of the receptive fields of those blocks, a
  rectangle because the fields of a rectangle of blocks are.

A worker needs the values of in_i that other workers own: worker i sends out_i ∩ in_j to
every j where that is non-empty (`intersections`), which is any worker, not only a grid
neighbour, when fields are wider than a worker's part. Layers whose output pixel is the unit
(pooling, contrast normalisation) are split the same way over output pixels
(`partition_pixels`) with the layer's own `input_window`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scaleout.nn.local import LocalGeometry

__all__ = [
    "Window",
    "WorkerWindows",
    "grid_coords",
    "intersections",
    "partition_local",
    "partition_pixels",
    "split_even",
]


def _overlap(a: range, b: range) -> range:
    start, stop = max(a.start, b.start), min(a.stop, b.stop)
    return range(start, max(start, stop))


@dataclass(frozen=True)
class Window:
    """A rectangle of pixels [rows] x [cols] of an (N, C, H, W) array (global coordinates)."""

    rows: range
    cols: range

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            span = getattr(self, name)
            if span.step != 1 or span.start < 0 or span.stop < span.start:
                raise ValueError(f"Window {name} must be a range with step 1 from >= 0, got {span}")

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.rows), len(self.cols))

    @property
    def num_pixels(self) -> int:
        return len(self.rows) * len(self.cols)

    @property
    def is_empty(self) -> bool:
        return self.num_pixels == 0

    def intersect(self, other: Window) -> Window:
        """The pixels in both windows (possibly empty)."""
        return Window(_overlap(self.rows, other.rows), _overlap(self.cols, other.cols))

    def contains(self, other: Window) -> bool:
        """Whether every pixel of `other` lies in this window (an empty one always does)."""
        if other.is_empty:
            return True
        return (
            self.rows.start <= other.rows.start
            and other.rows.stop <= self.rows.stop
            and self.cols.start <= other.cols.start
            and other.cols.stop <= self.cols.stop
        )

    @property
    def slices(self) -> tuple[slice, slice]:
        """Slices (H, W) selecting this window in the global array: `t[(..., *w.slices)]`."""
        return (slice(self.rows.start, self.rows.stop), slice(self.cols.start, self.cols.stop))

    def relative_to(self, origin: Window) -> tuple[slice, slice]:
        """Slices (H, W) selecting this window inside a buffer that holds `origin`."""
        assert origin.contains(self), f"{self} does not lie in {origin}"
        return (
            slice(self.rows.start - origin.rows.start, self.rows.stop - origin.rows.start),
            slice(self.cols.start - origin.cols.start, self.cols.stop - origin.cols.start),
        )


@dataclass(frozen=True)
class WorkerWindows:
    """What one worker of the grid computes and reads for one layer."""

    rank: int
    coords: tuple[int, int]  # (grid axis 0, grid axis 1)
    units: Window  # block positions (local layers) or output pixels (pixel-wise layers)
    output: Window  # out_i: output pixels this worker writes
    input: Window  # in_i: input pixels its neurons read


def split_even(count: int, parts: int, name: str = "count") -> list[range]:
    """`count` items in `parts` contiguous ranges whose sizes differ by at most one (the first
    `count % parts` ranges get the extra item)."""
    if parts < 1:
        raise ValueError(f"number of parts must be >= 1, got {parts}")
    if count < parts:
        raise ValueError(
            f"cannot split {count} {name} over {parts} workers: each needs at least one; "
            f"use a grid of at most {count} along this axis"
        )
    base, extra = divmod(count, parts)
    starts = [k * base + min(k, extra) for k in range(parts + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(parts)]


def _check_grid(grid: Sequence[int]) -> tuple[int, int]:
    if len(grid) != 2 or not all(isinstance(g, int) and g >= 1 for g in grid):
        raise ValueError(f"grid must be two positive ints [px, py], got {list(grid)!r}")
    return int(grid[0]), int(grid[1])


def grid_coords(rank: int, grid: Sequence[int]) -> tuple[int, int]:
    """(a, b) of `rank` in a px x py grid (rank = a * py + b)."""
    px, py = _check_grid(grid)
    if not 0 <= rank < px * py:
        raise ValueError(f"rank {rank} is outside a {px}x{py} grid")
    return divmod(rank, py)


def partition_local(geometry: LocalGeometry, grid: Sequence[int]) -> list[WorkerWindows]:
    """Windows of every worker (index = rank) for a locally connected layer: blocks split as
    evenly as possible over the grid, outputs the pixels they write, inputs their fields."""
    px, py = _check_grid(grid)
    block_rows = split_even(geometry.positions_h, px, "block rows")
    block_cols = split_even(geometry.positions_w, py, "block columns")
    windows = []
    for rank in range(px * py):
        a, b = divmod(rank, py)
        rows, cols = block_rows[a], block_cols[b]
        windows.append(
            WorkerWindows(
                rank,
                (a, b),
                Window(rows, cols),
                Window(*geometry.output_window(rows, cols)),
                Window(*geometry.input_window(rows, cols)),
            )
        )
    return windows


InputWindowFn = Callable[[range, range, tuple[int, int]], tuple[range, range]]


def partition_pixels(
    out_size: tuple[int, int],
    in_size: tuple[int, int],
    input_window: InputWindowFn,
    grid: Sequence[int],
) -> list[WorkerWindows]:
    """Windows for a layer whose unit is the output pixel (L2 pooling, contrast
    normalisation): output pixels split evenly; `input_window(rows, cols, in_size)` is the
    layer's own map from output pixels to the input pixels they read."""
    px, py = _check_grid(grid)
    out_rows = split_even(out_size[0], px, "output rows")
    out_cols = split_even(out_size[1], py, "output columns")
    windows = []
    for rank in range(px * py):
        a, b = divmod(rank, py)
        rows, cols = out_rows[a], out_cols[b]
        windows.append(
            WorkerWindows(
                rank,
                (a, b),
                Window(rows, cols),
                Window(rows, cols),
                Window(*input_window(rows, cols, in_size)),
            )
        )
    return windows


def intersections(
    sources: Sequence[Window], targets: Sequence[Window]
) -> dict[tuple[int, int], Window]:
    """{(i, j): sources[i] ∩ targets[j]} for every non-empty intersection, i and j ranks.

    With sources = output windows and targets = input windows, entry (i, j) is what worker i
    sends to j, and, read from j's side, what j receives from i: the same window, so sender
    and receiver agree on every message's shape without communicating.
    """
    pieces = {}
    for i, source in enumerate(sources):
        for j, target in enumerate(targets):
            piece = source.intersect(target)
            if not piece.is_empty:
                pieces[(i, j)] = piece
    return pieces
