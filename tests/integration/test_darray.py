"""DistributedArray exchange on real processes (gloo): buffers and gradients equal the same
sums computed on global arrays in one process, bit for bit, for partitions of locally connected
layers over 1x2, 2x1, 2x2 and 3x1 grids (fields wider than a worker's part) and for arbitrary
overlapping windows, over both transports and over sub-groups."""

import os
import random
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaleout.comm import free_port
from scaleout.comm.darray import DistributedArray
from scaleout.comm.windows import (
    Window,
)
from scaleout.compress import Codec, get
from tests.unit.test_darray import BATCH, CHANNELS, grid_cases, mixed

WORLD = 4


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
