"""Sync's mode "fsdp" as a simulation: FSDP2's step over the library's own plan of units.

The units are what `scaleout.parallel.fsdp.shard` makes of the config's model (built on
PyTorch's meta device): each block of `sync.fsdp_blocks` (or each child that holds
parameters), then the root with the rest; `fsdp.exchange_numels` gives the values a rank
sends in each unit's all-gather and keeps from its reduce-scatter, padding included. A
unit's share of the step's compute is its share of the model's forward FLOPs
(`scaleout.info.describe_model`), else of its parameters.

One step, as FSDP2 runs it on one process group (one collective at a time, in the order
they are issued):

- forward: the root is all-gathered (and kept until backward ends), then each block: the
  next block's all-gather is issued as a block starts computing (prefetch one ahead), and
  a block computes once its own has ended; the root's own layers compute last;
- backward: the root's layers first, then the blocks in reverse: each block was resharded
  after forward and is all-gathered again (the next one prefetched as a block starts), and
  its gradient is reduce-scattered as soon as its backward ends; the root's last;
- the optimizer steps 1/N of the parameters on each worker.

An all-gather and a reduce-scatter are rings of N - 1 steps of the rank's values (`fp32`).
FSDP's own work around them (hooks, copies into and out of its flat buffers, DTensor's
dispatch) is the calibrated `ModelCost.fsdp_s`, shared by the units' values; without it,
the copies are priced as `average_tensors`' flattening over the unit's whole values. An
evaluation runs on every worker (each gathers every unit per test batch); a checkpoint
gathers every unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from scaleout.compress.payload import layout
from scaleout.parallel import fsdp
from scaleout.sim.engine import Process
from scaleout.sim.setting import compute_shares

if TYPE_CHECKING:
    from scaleout.sim.sync import SyncSim


@dataclass(frozen=True)
class Unit:
    """One sharded module: `name` ("" the root), the values a rank sends in its all-gather
    (and keeps from its reduce-scatter), and its share of the step's compute."""

    name: str
    numel: int
    share: float


def fsdp_units(config: Any, workers: int) -> list[Unit]:  # noqa: ANN401 - a RunConfig
    """The units of `config`'s model sharded over `workers` ranks, in forward order."""
    from scaleout.info import describe_model

    with torch.device("meta"):
        model = config.model.build()
    plan = fsdp.exchange_numels(model, config.sync.fsdp_blocks, workers)
    layers = describe_model(config).layers
    names = [name for name, _ in plan]

    def unit_of(layer: str) -> str:
        return next((n for n in names[:-1] if layer == n or layer.startswith(f"{n}.")), "")

    flops = dict.fromkeys(names, 0)
    for layer in layers:
        flops[unit_of(layer.name)] += layer.flops
    shares = compute_shares([flops[name] for name in names], [numel for _, numel in plan])
    return [Unit(name, numel, share) for (name, numel), share in zip(plan, shares, strict=True)]


class ShardedStep:
    """FSDP's step, evaluation and checkpoint inside a `SyncSim` of more than one worker."""

    def __init__(self, sim: SyncSim, units: list[Unit]) -> None:
        self.sim, self.env = sim, sim.env
        self.workers = range(sim.num_workers)
        self.blocks, self.root = units[:-1], units[-1]
        self.units = units

    def _coded(self, unit: Unit) -> bool:
        """Whether the unit's payloads go through the `[compress]` codec
        (`scaleout.compress.fsdp`: on a link, where that is faster for the shard's size)."""
        sim = self.sim
        if sim.codec == "fp32":
            return False
        return sim.on_link is None or sim.on_link.encodes(unit.numel)

    def _packed(self, unit: Unit) -> int:
        codes, scales = layout(self.sim.codec, unit.numel, self.sim.block_size)
        return codes + 4 * scales + 1  # `pack`: codes, scales, a flag byte

    def _ring(self, unit: Unit, kind: str) -> Process:
        """A unit's all-gather or reduce-scatter (`kind`): two workers of one machine take
        the calibrated collective of the whole values; otherwise a ring of the rank's. A
        coded unit moves its payloads as a ring (the reduce-scatter's all-to-all sends
        the same bytes)."""
        sim = self.sim
        if unit.numel == 0:  # a root that holds nothing: FSDP runs no collective for it
            return
        if self._coded(unit):
            yield from sim._allgather(self._packed(unit))
            return
        measured = sim.cal.allgather if kind == "allgather" else sim.cal.reduce_scatter
        if measured is None or sim.num_workers != 2 or len(set(sim.where)) != 1:
            yield from sim._allgather(4 * unit.numel)
            return
        whole = 4 * unit.numel * 2
        yield from sim.clock.wake(whole)
        machine = sim.cluster.machines[sim.where[0]]
        yield from machine.call(measured.seconds(whole), measured.cpu_s(whole))
        sim.clock.ended()

    def _local(self, worker: int, unit: Unit) -> Process:
        """FSDP's work on the worker's own thread around one of the unit's collectives
        (copying the gathered values out, a gradient in); a coded unit's encodes and
        decodes too (one shard out and every rank's in; or the others' chunks both ways)."""
        sim = self.sim
        seconds = self._copy_s(unit)
        if self._coded(unit) and unit.numel:
            n = sim.num_workers
            seconds += n * sim.cal.codec_s(sim.codec, unit.numel, "encode") / 2
            seconds += n * sim.cal.codec_s(sim.codec, unit.numel, "decode")
        yield from sim.cluster.machines[sim.where[worker]].work(seconds)

    def _gather_everywhere(self, unit: Unit) -> Process:
        yield from self._ring(unit, "allgather")
        env = self.env
        yield env.all_of([env.process(self._local(w, unit)) for w in self.workers])

    def _copy_s(self, unit: Unit) -> float:
        """FSDP's local work around one of the unit's collectives: the calibrated `fsdp_s`
        shared by the units' values over their collectives (a block's three, the root's
        two), else the copies priced as `average_tensors`' flattening."""
        fsdp_s, total = self.sim.cost.fsdp_s, max(sum(u.numel for u in self.units), 1)
        if fsdp_s is not None:
            return fsdp_s * unit.numel / total / (2 if unit is self.root else 3)
        return 4 * unit.numel * self.sim.num_workers / self.sim.cal.flatten_bytes_per_s

    def step(self) -> Process:
        """One training step on every worker: forward and backward with their collectives,
        then the optimizer on each worker's shard."""
        env, sim, n = self.env, self.sim, len(self.blocks)
        events = lambda: [[env.event() for _ in self.workers] for _ in range(n)]  # noqa: E731
        forward_started, backward_started, backward_done = events(), events(), events()
        root_backward_done = [env.event() for _ in self.workers]
        root_reduced = [env.event() for _ in self.workers]
        root_gathered = env.event()
        gathered = [env.event() for _ in range(n)]  # forward
        regathered = [env.event() for _ in range(n)]  # backward

        def worker(w: int) -> Process:
            forward = yield from sim._next_slice(w)
            backward = sim.backward_s
            yield root_gathered
            yield from self._local(w, self.root)
            for i, block in enumerate(self.blocks):
                yield gathered[i]
                yield from self._local(w, block)
                forward_started[i][w].succeed()
                yield from sim._compute(w, forward * block.share)
            yield from sim._compute(w, (forward + backward) * self.root.share)
            root_backward_done[w].succeed()
            for i in reversed(range(n)):
                yield regathered[i]
                yield from self._local(w, self.blocks[i])
                backward_started[i][w].succeed()
                yield from sim._compute(w, backward * self.blocks[i].share)
                yield from self._local(w, self.blocks[i])  # the gradient copied in
                backward_done[i][w].succeed()
            yield from self._local(w, self.root)
            root_reduced[w].succeed()

        def collectives() -> Process:
            yield from self._ring(self.root, "allgather")
            root_gathered.succeed()
            for i, block in enumerate(self.blocks):
                if i > 0:  # issued as the block before starts computing
                    yield env.all_of(forward_started[i - 1])
                yield from self._ring(block, "allgather")
                gathered[i].succeed()
            if n:
                yield env.all_of(root_backward_done)
                yield from self._ring(self.blocks[-1], "allgather")
                regathered[-1].succeed()
            for i in reversed(range(n)):
                if i > 0:  # the next block's, prefetched as this one starts
                    yield env.all_of(backward_started[i])
                    yield from self._ring(self.blocks[i - 1], "allgather")
                    regathered[i - 1].succeed()
                yield env.all_of(backward_done[i])
                yield from self._ring(self.blocks[i], "reduce_scatter")
            yield env.all_of(root_reduced)
            yield from self._ring(self.root, "reduce_scatter")

        passes = [env.process(worker(w)) for w in self.workers]
        comm = env.process(collectives())
        yield env.all_of(passes)
        computed = env.now
        yield comm
        sim.exposed.append(env.now - computed)
        yield from sim._on_every_worker(sim.cost.optimizer_s / sim.num_workers)

    def gather_all(self) -> Process:
        """Every unit gathered once (a test batch's forward, a checkpoint's full state)."""
        for unit in self.units:
            yield from self._gather_everywhere(unit)

    def evaluate(self, test_size: int, eval_batch: int, eval_s: float) -> Process:
        """Every worker evaluates the whole test set, gathering every unit per batch."""
        sim, env = self.sim, self.env
        full, rest = divmod(test_size, eval_batch)
        for size in [eval_batch] * full + ([rest] if rest else []):
            yield from self.gather_all()
            yield env.all_of([env.process(sim._compute(w, size * eval_s)) for w in self.workers])
