"""DistributedArray exchange on real processes (gloo): buffers and gradients equal the same
sums computed on global arrays in one process, bit for bit, for partitions of locally connected
layers over 1x2, 2x1, 2x2 and 3x1 grids (fields wider than a worker's part) and for arbitrary
overlapping windows, over both transports and over sub-groups."""

import pytest
import torch

from scaleout.comm.darray import DistributedArray, ExchangePlan, exchange
from scaleout.comm.windows import (
    Window,
    intersections,
    partition_local,
    partition_pixels,
    split_even,
)
from scaleout.compress import Codec, OnLink, get
from scaleout.compress.payload import pack
from scaleout.compress.transfer import CodecSpeed, LinkSpeed
from scaleout.nn.local import LocalGeometry

BATCH, CHANNELS = 3, 2


def grid_cases() -> list[tuple[str, list[Window], list[Window]]]:
    """(name, outputs, inputs): a producer split evenly over the grid's pixels feeding a
    locally connected layer whose fields (7 wide, step 2) span more than one worker's part."""
    geometry = LocalGeometry(
        CHANNELS, 15, 13, field=7, step=2, block_height=1, block_width=2, depth=1
    )
    size = (geometry.in_height, geometry.in_width)
    cases = []
    for grid in [(1, 2), (2, 1), (2, 2), (3, 1), (1, 4)]:
        producer = partition_pixels(size, size, lambda r, c, _: (r, c), grid)
        consumer = partition_local(geometry, grid)
        cases.append((f"grid{grid}", [w.output for w in producer], [w.input for w in consumer]))
    return cases


def mixed() -> OnLink:
    """dynamic8 on a link where the 2x2 grid's pieces of 24-108 values go raw (a call's
    fixed cost outweighs the bytes saved) and those of 126-144 go 8-bit: one exchange
    carries both, in one byte buffer, and the ends agree on which is which."""
    return OnLink(get("dynamic8", block_size=64), LinkSpeed(1e6, 0.0), CodecSpeed(1e-4, 0, 1e-4, 0))


def test_a_link_sends_small_pieces_raw_and_large_ones_8bit() -> None:
    codec, (_, outputs, inputs) = mixed(), grid_cases()[2]
    sizes = {BATCH * CHANNELS * p.num_pixels for p in intersections(outputs, inputs).values()}
    assert {n for n in sizes if codec.encodes(n)} == {n for n in sizes if n >= 126}
    assert min(sizes) < 126 < max(sizes)
    array = DistributedArray(outputs, inputs, rank=0, codec=codec)
    sent = array.bytes_sent(BATCH, CHANNELS)
    pieces = [p for j, p in array.plan.sends if j != 0]
    raw = [4 * BATCH * CHANNELS * p.num_pixels for p in pieces]
    encoded = [pack(codec.encode(torch.zeros(n // 4))).numel() for n in raw]
    assert sent == sum(e if codec.encodes(n // 4) else n for n, e in zip(raw, encoded, strict=True))


def test_single_worker_exchange_is_a_local_copy_without_a_group() -> None:
    """One worker owning the whole array: no collective, buffer = its input window."""
    whole = Window(range(0, 6), range(0, 5))
    inner = Window(range(1, 5), range(2, 5))
    array = DistributedArray([whole], [inner], rank=0)
    assert not array.plan.collective
    local = torch.randn(2, 3, 6, 5, requires_grad=True)
    buffer = array(local)
    assert torch.equal(buffer, local[..., 1:5, 2:5])
    buffer.sum().backward()
    expected = torch.zeros(2, 3, 6, 5)
    expected[..., 1:5, 2:5] = 1
    assert torch.equal(local.grad, expected)


def test_exchange_keeps_the_memory_layout_and_zeroes_what_nobody_owns() -> None:
    """An input window reaching past the output: the unowned border is zero (the buffer is
    not a tiling, so it is zeroed first), in the local array's (H, W, C, N) order; an input
    window inside the output window is a view of the local array."""
    owned = Window(range(0, 4), range(0, 5))
    wider = Window(range(0, 6), range(1, 5))
    plan = ExchangePlan.build(0, [owned], [wider])
    assert not plan.receives_tile and not plan.is_identity
    local = torch.randn(3, 2, 4, 5).permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)
    buffer = exchange(local, plan)
    expected = torch.zeros(3, 2, 6, 4)
    expected[..., :4, :] = local[..., 1:5]
    assert torch.equal(buffer, expected)
    assert buffer.permute(2, 3, 1, 0).is_contiguous()
    inner = ExchangePlan.build(0, [owned], [Window(range(1, 3), range(0, 5))])
    assert inner.receives_tile and inner.is_identity
    assert exchange(local, inner).data_ptr() == local[..., 1:3, :].data_ptr()


def test_plan_pieces_and_bytes() -> None:
    rows = split_even(10, 2)
    outputs = [Window(r, range(0, 4)) for r in rows]
    inputs = [Window(range(0, 7), range(0, 4)), Window(range(3, 10), range(0, 4))]
    plan = ExchangePlan.build(0, outputs, inputs)
    assert plan.sends == (
        (0, Window(range(0, 5), range(0, 4))),
        (1, Window(range(3, 5), range(0, 4))),
    )
    assert plan.receives == (
        (0, Window(range(0, 5), range(0, 4))),
        (1, Window(range(5, 7), range(0, 4))),
    )
    assert plan.bytes_sent(batch=3, channels=2) == 2 * 4 * 3 * 2 * 4
    back = plan.transposed()
    assert back.sends == plan.receives and back.output == plan.input


def test_errors_name_the_argument() -> None:
    w = Window(range(0, 2), range(0, 2))
    with pytest.raises(ValueError, match="one output and one input"):
        ExchangePlan.build(0, [w, w], [w])
    with pytest.raises(ValueError, match="transport"):
        DistributedArray([w], [w], rank=0, transport="carrier-pigeon")  # type: ignore[arg-type]
    plan = ExchangePlan.build(0, [w], [w])
    with pytest.raises(ValueError, match="local array"):
        exchange(torch.zeros(1, 1, 3, 2), plan)


@pytest.mark.parametrize("codec", [None, get("dynamic8", block_size=64), get("static8")])
def test_bytes_sent_match_the_payloads(codec: Codec | None) -> None:
    """Bytes per exchange are those of the pieces (packed codes, when compressed), and the
    backward sends back, over all workers, exactly what the forward sent."""
    _, outputs, inputs = grid_cases()[2]
    arrays = [DistributedArray(outputs, inputs, rank=r, codec=codec) for r in range(4)]
    for r, array in enumerate(arrays):
        expected = 0
        for j, inp in enumerate(inputs):
            piece = outputs[r].intersect(inp)
            if j == r or piece.is_empty:
                continue
            values = torch.randn(BATCH, CHANNELS, *piece.shape)
            expected += values.numel() * 4 if codec is None else pack(codec.encode(values)).numel()
        assert array.bytes_sent(BATCH, CHANNELS) == expected
    forward = sum(a.bytes_sent(BATCH, CHANNELS) for a in arrays)
    backward = sum(a.bytes_sent(BATCH, CHANNELS, backward=True) for a in arrays)
    assert forward == backward > 0
