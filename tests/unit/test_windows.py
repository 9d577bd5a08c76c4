"""Window arithmetic of model parallelism, property-tested against pixel-by-pixel references:
outputs tile the global output once, every neuron's field lies in its worker's input window,
and the pieces exchanged are the same from the sender's and the receiver's side."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scaleout.comm.windows import (
    Window,
    grid_coords,
    intersections,
    partition_local,
    partition_pixels,
    split_even,
)
from scaleout.nn.local import L2Pool2d, LocalContrastNorm2d, LocalGeometry


@st.composite
def layer_and_grid(draw: st.DrawFn) -> tuple[LocalGeometry, tuple[int, int]]:
    field = draw(st.integers(1, 7))
    step = draw(st.integers(1, 4))
    height = draw(st.integers(field, 30))
    width = draw(st.integers(field, 30))
    geometry = LocalGeometry(
        in_channels=draw(st.integers(1, 3)),
        in_height=height,
        in_width=width,
        field=field,
        step=step,
        block_height=draw(st.integers(1, 3)),
        block_width=draw(st.integers(1, 3)),
        depth=draw(st.integers(1, 2)),
    )
    px = draw(st.integers(1, min(4, geometry.positions_h)))
    py = draw(st.integers(1, min(4, geometry.positions_w)))
    return geometry, (px, py)


def mask(window: Window, shape: tuple[int, int]) -> np.ndarray:
    out = np.zeros(shape, dtype=np.int64)
    out[window.rows.start : window.rows.stop, window.cols.start : window.cols.stop] = 1
    return out


@given(st.integers(1, 200), st.integers(1, 12))
def test_split_even_is_contiguous_and_balanced(count: int, parts: int) -> None:
    if parts > count:
        with pytest.raises(ValueError, match="at most"):
            split_even(count, parts)
        return
    ranges = split_even(count, parts)
    assert [i for r in ranges for i in r] == list(range(count))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@settings(max_examples=150, deadline=None)
@given(layer_and_grid())
def test_outputs_tile_the_global_output_exactly_once(case) -> None:
    geometry, grid = case
    workers = partition_local(geometry, grid)
    assert len(workers) == grid[0] * grid[1]
    shape = (geometry.out_height, geometry.out_width)
    count = sum(mask(w.output, shape) for w in workers)
    assert (count == 1).all()
    for w in workers:
        assert grid_coords(w.rank, grid) == w.coords
    # block counts per worker differ by at most one along each axis
    heights = {len(w.units.rows) for w in workers}
    widths = {len(w.units.cols) for w in workers}
    assert max(heights) - min(heights) <= 1 and max(widths) - min(widths) <= 1


@settings(max_examples=150, deadline=None)
@given(layer_and_grid())
def test_every_neuron_reads_inside_its_workers_input_window(case) -> None:
    geometry, grid = case
    workers = partition_local(geometry, grid)
    g = geometry
    shape = (g.in_height, g.in_width)
    needed = [np.zeros(shape, dtype=bool) for _ in workers]
    for y in range(g.out_height):
        for x in range(g.out_width):
            owner = [w for w in workers if y in w.output.rows and x in w.output.cols]
            assert len(owner) == 1
            r, c = y // g.block_height, x // g.block_width  # the neuron's block position
            field = needed[owner[0].rank]
            field[r * g.step : r * g.step + g.field, c * g.step : c * g.step + g.field] = True
    for w, need in zip(workers, needed, strict=True):
        # in_i holds every input its neurons read and is the smallest rectangle that does
        # (it has gaps only where step > field leaves pixels no field reads)
        window = mask(w.input, shape).astype(bool)
        assert not (need & ~window).any()
        rows, cols = np.flatnonzero(need.any(axis=1)), np.flatnonzero(need.any(axis=0))
        assert w.input == Window(range(rows[0], rows[-1] + 1), range(cols[0], cols[-1] + 1))


windows_1d = st.tuples(st.integers(0, 20), st.integers(0, 12)).map(lambda t: range(t[0], sum(t)))
windows = st.builds(Window, windows_1d, windows_1d)


@given(st.lists(windows, min_size=1, max_size=6), st.lists(windows, min_size=1, max_size=6))
def test_intersections_agree_between_sender_and_receiver(outs, ins) -> None:
    sends = intersections(outs, ins)
    receives = intersections(ins, outs)  # from the receiver's side: in_j ∩ out_i
    assert set(receives) == {(j, i) for i, j in sends}
    shape = (40, 40)
    for (i, j), piece in sends.items():
        assert piece == receives[(j, i)]
        assert outs[i].contains(piece) and ins[j].contains(piece)
        assert (mask(piece, shape) == mask(outs[i], shape) * mask(ins[j], shape)).all()
    # every (i, j) left out has an empty intersection
    for i, out in enumerate(outs):
        for j, inp in enumerate(ins):
            if (i, j) not in sends:
                assert (mask(out, shape) * mask(inp, shape)).sum() == 0


@settings(max_examples=60, deadline=None)
@given(layer_and_grid())
def test_each_input_pixel_is_received_once_when_outputs_tile(case) -> None:
    """Consumer layer after a producer: the pieces a worker receives cover its input window
    exactly once, so the local buffer is a consistent copy of in_i."""
    geometry, grid = case
    consumer = partition_local(geometry, grid)
    shape = (geometry.in_height, geometry.in_width)
    # the producer owns row bands of the consumer's input (a different split than its own)
    bands = split_even(shape[0], min(3, shape[0]))
    producer = [Window(rows, range(0, shape[1])) for rows in bands]
    sends = intersections(producer, [w.input for w in consumer])
    for w in consumer:
        received = sum(mask(p, shape) for (_, j), p in sends.items() if j == w.rank)
        assert (received == mask(w.input, shape)).all()


@pytest.mark.parametrize("layer", [L2Pool2d(size=3, stride=2, padding=1), LocalContrastNorm2d(5)])
def test_pixel_layers_partition_their_outputs(layer) -> None:
    in_size = (13, 11)
    out_size = (layer.out_size(13), layer.out_size(11)) if isinstance(layer, L2Pool2d) else in_size
    workers = partition_pixels(out_size, in_size, layer.input_window, (3, 2))
    count = sum(mask(w.output, out_size) for w in workers)
    assert (count == 1).all()
    for w in workers:
        assert w.input == Window(*layer.input_window(w.output.rows, w.output.cols, in_size))


def test_grid_errors_name_the_fix() -> None:
    geometry = LocalGeometry(1, 8, 8, 4, 4, 1, 1, 1)  # 2 x 2 block positions
    with pytest.raises(ValueError, match="at most 2"):
        partition_local(geometry, (3, 1))
    with pytest.raises(ValueError, match="grid"):
        partition_local(geometry, (0, 1))
    with pytest.raises(ValueError, match="outside"):
        grid_coords(4, (2, 2))
