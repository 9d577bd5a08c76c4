"""DistributedArray exchange on real processes (gloo): buffers and gradients equal the same
sums computed on global arrays in one process, bit for bit, for partitions of locally connected
layers over 1x2, 2x1, 2x2 and 3x1 grids (fields wider than a worker's part) and for arbitrary
overlapping windows, over both transports and over sub-groups."""

import os
import random
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaleout.comm import free_port
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

WORLD = 4
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


def random_windows(world: int, seed: int) -> tuple[list[Window], list[Window]]:
    """Overlapping output windows (summed), some empty, and arbitrary input windows."""
    rng = random.Random(seed)

    def window() -> Window:
        r0, c0 = rng.randrange(0, 12), rng.randrange(0, 10)
        return Window(range(r0, r0 + rng.randrange(0, 8)), range(c0, c0 + rng.randrange(1, 8)))

    return [window() for _ in range(world)], [window() for _ in range(world)]


def reference(
    outputs: list[Window], inputs: list[Window], seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every worker's local array, loss weights, expected buffer and expected local gradient,
    from global (N, C, H, W) arrays summed in rank order."""
    gen = torch.Generator().manual_seed(seed)
    locals_ = [torch.randn(BATCH, CHANNELS, *w.shape, generator=gen) for w in outputs]
    weights = [torch.randn(BATCH, CHANNELS, *w.shape, generator=gen) for w in inputs]
    height = max(w.rows.stop for w in outputs + inputs)
    width = max(w.cols.stop for w in outputs + inputs)
    values = torch.zeros(BATCH, CHANNELS, height, width)
    for w, local in zip(outputs, locals_, strict=True):
        values[(..., *w.slices)] += local
    grads = torch.zeros_like(values)  # d(sum_i <buffer_i, weights_i>) / d values
    for w, weight in zip(inputs, weights, strict=True):
        grads[(..., *w.slices)] += weight
    buffers = [values[(..., *w.slices)] for w in inputs]
    local_grads = [grads[(..., *w.slices)] for w in outputs]
    return locals_, weights, buffers, local_grads


# Mismatches are collected, not raised, so every worker goes through all its collectives and
# the workers report together at the end (a raise would leave the others hanging).
FAILURES: list[str] = []


def expect(condition: bool, what: str) -> None:
    if not condition:
        FAILURES.append(f"rank {dist.get_rank()}: {what}")


def hwcn(x: torch.Tensor) -> torch.Tensor:
    """`x` (N, C, H, W) stored in (H, W, C, N) order, as the locally connected layers do."""
    return x.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)


def check(name: str, outputs: list[Window], inputs: list[Window], group, transport: str) -> None:
    """Over p2p the local arrays are in (H, W, C, N) order, and buffers must keep it."""
    rank = dist.get_rank(group)
    seed = zlib.crc32(name.encode())  # the same in every process (unlike hash)
    locals_, weights, buffers, local_grads = reference(outputs, inputs, seed)
    array = DistributedArray(outputs, inputs, group=group, transport=transport)
    layout = hwcn if transport == "p2p" else torch.clone
    local = layout(locals_[rank]).requires_grad_(True)
    buffer = array(local)
    expect(torch.equal(buffer, buffers[rank]), f"{name} {transport}: buffer")
    # (a view of `local` when identity; an empty `local` has no layout to keep)
    if buffer.numel() > 1 and local.numel() > 1 and not array.plan.is_identity:
        expect(layout(buffer).stride() == buffer.stride(), f"{name} {transport}: layout")
    (buffer * weights[rank]).sum().backward()
    expect(torch.equal(local.grad, local_grads[rank]), f"{name} {transport}: gradient")


def compressed_reference(
    outputs: list[Window], inputs: list[Window], seed: int, codec: Codec, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Worker `rank`'s local array, loss weights, buffer and local gradient when every piece
    that crosses to another worker is replaced by its codec round trip (where the codec
    encodes a piece of its size: `Codec.encodes`)."""
    locals_, weights, _, _ = reference(outputs, inputs, seed)

    def sent(piece: torch.Tensor, remote: bool) -> torch.Tensor:
        if not remote or not codec.encodes(piece.numel()):
            return piece
        return codec.roundtrip(piece.reshape(-1)).view(piece.shape)

    buffer = torch.zeros(BATCH, CHANNELS, *inputs[rank].shape)
    for j, out in enumerate(outputs):  # buffer_rank gets out_j ∩ in_rank from j
        piece = out.intersect(inputs[rank])
        if not piece.is_empty:
            value = locals_[j][(..., *piece.relative_to(out))]
            buffer[(..., *piece.relative_to(inputs[rank]))] += sent(value, j != rank)
    grad = torch.zeros(BATCH, CHANNELS, *outputs[rank].shape)
    for i, inp in enumerate(inputs):  # worker i's loss weights over in_i ∩ out_rank come back
        piece = inp.intersect(outputs[rank])
        if not piece.is_empty:
            value = weights[i][(..., *piece.relative_to(inp))]
            grad[(..., *piece.relative_to(outputs[rank]))] += sent(value, i != rank)
    return locals_[rank], weights[rank], buffer, grad


def check_compressed(name: str, outputs: list[Window], inputs: list[Window], codec: Codec) -> None:
    rank = dist.get_rank()
    local, weight, expected, expected_grad = compressed_reference(
        outputs, inputs, zlib.crc32(name.encode()), codec, rank
    )
    array = DistributedArray(outputs, inputs, codec=codec)
    local = local.clone().requires_grad_(True)
    buffer = array(local)
    expect(torch.equal(buffer, expected), f"{name} {codec.name}: buffer")
    (buffer * weight).sum().backward()
    expect(torch.equal(local.grad, expected_grad), f"{name} {codec.name}: gradient")


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


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        groups = {size: dist.new_group(list(range(size))) for size in (2, 3)}
        for transport in ("all_to_all", "p2p"):
            for name, outputs, inputs in grid_cases():
                size = len(outputs)
                group = None if size == WORLD else groups[size]
                if rank < size:
                    check(name, outputs, inputs, group, transport)
            for seed in range(6):
                check(f"random{seed}", *random_windows(WORLD, seed), None, transport)
        # 8-bit exchange: what crosses the wire is the codec's round trip, the rest exact
        for codec in (get("dynamic8", block_size=64), get("linear8"), get("fp16"), mixed()):
            _, outputs, inputs = grid_cases()[2]  # 2 x 2
            check_compressed("grid 2x2", outputs, inputs, codec)
            check_compressed("random 0", *random_windows(WORLD, 0), codec)
        # sub-group with ranks not starting at 0: ranks 2, 3 of the world are 0, 1 of it
        upper = dist.new_group([2, 3])
        if rank >= 2:
            outputs = [Window(range(0, 4), range(0, 5)), Window(range(4, 9), range(0, 5))]
            inputs = [Window(range(0, 7), range(0, 5)), Window(range(2, 9), range(1, 4))]
            for transport in ("all_to_all", "p2p"):
                check("upper", outputs, inputs, upper, transport)
        gathered: list[list[str] | None] = [None] * WORLD
        dist.all_gather_object(gathered, FAILURES)
        failures = [f for part in gathered for f in part or []]
        assert not failures, "\n".join(failures)
    finally:
        dist.destroy_process_group()


def test_exchange_and_gradients_equal_global_reference_on_processes() -> None:
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD, join=True)


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
