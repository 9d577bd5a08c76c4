"""`calibration.json`: what one machine's costs are, as `scaleout calibrate` measured them.

The simulator takes every cost from here, never from a constant in its code. A file of the
same schema can describe a machine we do not have (`--hardware FILE`: the papers' 16-core
servers, a GTX 680, InfiniBand): there `flops_per_s` prices a model's FLOPs where no
measured `models` entry fits it.

Units: seconds, bytes, bytes per second; codec costs in nanoseconds per value.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from scaleout.errors import ConfigError

DEFAULT_CALIBRATION = Path("results/calibration.json")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelCost(_Model):
    """One model's compute on this machine, alone (nothing else running)."""

    num_parameters: PositiveInt
    forward_flops: int = 0  # per example
    batch_size: PositiveInt
    # threads -> seconds per example of a training step: next minibatch, forward, backward
    train_s: dict[int, PositiveFloat]
    # processes -> seconds per example of one 1-thread process while that many step at once
    # (they share memory bandwidth and caches: the slow-down beyond sharing cores)
    concurrent_s: dict[int, PositiveFloat] = {}
    # a layer-wise model's phases: seconds per example of a 1-thread step of each (phase k
    # runs the frozen stacks below it); empty: one phase, or not measured
    phase_s: list[PositiveFloat] = []
    # per phase, the share of its step that does not shrink with the work (as
    # `fixed_fraction`); empty: one phase, or not measured (`fixed_fraction` stands)
    phase_fixed_fraction: list[Annotated[float, Field(ge=0, lt=1)]] = []
    eval_s: PositiveFloat  # seconds per test example (forward only)
    # a layer-wise model's phases: seconds per test example of an evaluation of each (its
    # objective through the frozen stacks below); empty: one phase, or not measured
    phase_eval_s: list[PositiveFloat] = []
    load_s: float = 0.0  # seconds per example of the loader alone (within train_s)
    optimizer_s: float = 0.0  # seconds per step of the config's optimizer on the whole model
    # seconds to zero a gradient buffer of the model's size right after a step (a Downpour
    # replica's after each push: cold from memory); None: not measured, the back-to-back
    # `Calibration.zero_bytes_per_s` stands
    zero_s: float | None = Field(default=None, ge=0)
    # the share of a 1-thread step that is backward (the rest: loading, forward, the loss);
    # None: not measured (a hardware file), `scaleout.sim.sync.BACKWARD_FRACTION` stands
    backward_fraction: float | None = Field(default=None, gt=0, lt=1)
    train_size: int = 0  # examples in the training and test sets
    test_size: int = 0
    # the share of a step of `batch_size` that does not shrink with the batch (Python,
    # autograd's graph, the loader's whole batch): a worker of sync steps on a slice
    fixed_fraction: float = Field(default=0.0, ge=0, lt=1)
    # trainable tensors' sizes in registration order (DDP's buckets); empty: unknown
    parameter_numels: list[PositiveInt] = []
    # seconds per step DDP adds besides the all-reduce (hooks, bucket copies); None: not
    # measured (a model calibrated for another strategy)
    ddp_s: float | None = Field(default=None, ge=0)
    # seconds per step FSDP2 adds to a sync worker besides its collectives (hooks, flat
    # buffer copies, DTensor's dispatch; `measure_compute.measure_fsdp`); None: not
    # measured, the copies are priced at `Calibration.flatten_bytes_per_s`
    fsdp_s: float | None = Field(default=None, ge=0)
    # how much more CPU a 1-thread step takes while another process makes calls to a
    # parameter-server shard (`measure_beside_calls`: their copies share the caches); 1:
    # not measured (a model calibrated for another strategy)
    beside_calls: float = Field(default=1.0, ge=1)
    # wall seconds a computing 1-thread step loses each time a call between other processes
    # starts on its machine, beyond sharing the cores (`measure_beside.call_wait_s`: their
    # threads wake up on a computing thread's core); 0: not measured
    call_wait_s: float = Field(default=0.0, ge=0)
    # the same with every core computing (`measure_beside.call_wait_busy_s`: the call's
    # hops then take computing threads' cores, there is no idle one); None: not measured
    # (one core, an older calibration), `call_wait_s` stands
    call_wait_busy_s: float | None = Field(default=None, ge=0)

    def step_s(self, batch: int, threads: int) -> float:
        """Seconds of one training step of `batch` examples at `threads` threads."""
        whole = self.batch_size * _at_threads(self.train_s, threads)
        return whole * (self.fixed_fraction + (1 - self.fixed_fraction) * batch / self.batch_size)

    def slowdown(self, processes: float) -> float:
        """How much slower each of `processes` stepping at once runs than one alone (>= 1),
        cores aside: measured up to the machine's cores, constant beyond."""
        if processes <= 1 or len(self.concurrent_s) < 2:
            return 1.0
        counts = sorted(self.concurrent_s)
        base = self.concurrent_s[counts[0]]
        ratios = [self.concurrent_s[c] / base for c in counts]
        return max(1.0, interpolate(counts, ratios, processes))


class CodecCost(_Model):
    """ns per value by message size (values), encode and decode."""

    sizes: list[PositiveInt]
    encode_ns: list[float]
    decode_ns: list[float]

    def seconds(self, numel: int, which: str) -> float:
        ns = self.encode_ns if which == "encode" else self.decode_ns
        return numel * interpolate(self.sizes, ns, numel) * 1e-9


class MessageCost(_Model):
    """A call between two processes of this machine that moves `n` bytes: it takes
    `fixed_s + n / bytes_per_s` on a quiet machine (Ray's object store; gloo for
    collectives) and keeps `cpu_fixed_s + n / cpu_bytes_per_s` seconds of cores busy in all
    processes together (the caller, the callee, Ray's own), `caller_share` of them in the
    caller's. A call keeps more than one core busy at once (serialising on one side while
    the other copies), so on a loaded machine it takes longer than `seconds`; the simulator
    prices it as work of that parallelism. Without the CPU fields, CPU = wall."""

    fixed_s: float = Field(ge=0)
    bytes_per_s: PositiveFloat
    cpu_fixed_s: float | None = Field(default=None, ge=0)
    cpu_bytes_per_s: PositiveFloat | None = None
    caller_share: float = Field(default=0.5, ge=0, le=1)
    # The measured calls (bytes ascending; the configs' own shard sizes among them): between
    # them costs are interpolated, beyond them the fitted lines above hold. Copies are not
    # linear in size (a smaller slice can take longer than a larger one), so the sizes a run
    # sends are measured as they are.
    measured_bytes: list[PositiveInt] = []
    measured_s: list[PositiveFloat] = []
    measured_core_s: list[PositiveFloat] = []
    measured_caller_core_s: list[float] = []
    # wall seconds until the caller goes on (a push returns once its payload is in the
    # object store; the shard applies it afterwards); none: the caller waits its CPU share
    measured_caller_s: list[PositiveFloat] = []

    @model_validator(mode="after")
    def _same_lengths(self) -> MessageCost:
        points = self.measured_bytes
        if points != sorted(points):
            raise ValueError("measured_bytes must be ascending")
        names = ("measured_s", "measured_core_s", "measured_caller_core_s", "measured_caller_s")
        for name in names:
            if getattr(self, name) and len(getattr(self, name)) != len(points):
                raise ValueError(f"{name} needs one value per measured_bytes")
        return self

    def _measured(self, values: list[float], nbytes: float) -> float | None:
        points = self.measured_bytes
        if not values or not points or not points[0] <= nbytes <= points[-1]:
            return None
        return interpolate(points, values, nbytes)

    def seconds(self, nbytes: float) -> float:
        """Wall seconds of one call on a quiet machine."""
        measured = self._measured(self.measured_s, nbytes)
        return measured if measured is not None else self.fixed_s + nbytes / self.bytes_per_s

    def cpu_s(self, nbytes: float) -> float:
        """Core-seconds of one call, all processes together."""
        measured = self._measured(self.measured_core_s, nbytes)
        if measured is not None:
            return measured
        if self.cpu_fixed_s is None or self.cpu_bytes_per_s is None:
            return self.seconds(nbytes)
        return self.cpu_fixed_s + nbytes / self.cpu_bytes_per_s

    def caller_fraction(self, nbytes: float) -> float:
        """The share of a call's core-seconds spent in the caller's process."""
        measured = self._measured(self.measured_caller_core_s, nbytes)
        if measured is None:
            return self.caller_share
        return min(1.0, measured / max(self.cpu_s(nbytes), 1e-12))

    def sides(self, nbytes: float) -> tuple[tuple[float, float], tuple[float, float]]:
        """((wall, core-seconds) of the caller's side, the same of the callee's side): the
        caller's side is what it waits for, the callee's is served in the callee's queue."""
        wall, cores = self.seconds(nbytes), self.cpu_s(nbytes)
        fraction = self.caller_fraction(nbytes)
        caller_wall = self._measured(self.measured_caller_s, nbytes)
        if caller_wall is None:
            caller_wall = fraction * wall
        caller_wall = min(caller_wall, wall)
        caller = (caller_wall, fraction * cores)
        return caller, (wall - caller_wall, (1 - fraction) * cores)


class LockstepCost(_Model):
    """What a collective of two processes of this machine costs after the ranks computed
    for a while, beyond its back-to-back price (`measure_lockstep`: the faster rank waits
    for the slower, gloo's threads wake up); or a replica's pull and push through a shard
    after its compute (`measure_shard_calls_after_compute`: Ray's threads in the caller,
    the raylet and the shard wake up, their caches cold), with the core-seconds that adds.
    `extra_s[i][j]` (and `extra_core_s[i][j]`): at `measured_bytes[i]` after `gaps_s[j]`
    seconds of compute. `hop_wait_s[i]`: what one call of such a pair at
    `measured_bytes[i]` (a pull's or a push's side) waits, beyond the share of the cores
    processor sharing gives it, when other work keeps every core of its machine busy: each
    of its hops between processes (caller, raylet, shard) waits for a core to be handed
    over. A call waits that much times the busy fraction of the cores (`Machine.call`)."""

    measured_bytes: list[PositiveInt]
    gaps_s: list[PositiveFloat]
    extra_s: list[list[float]]
    extra_core_s: list[list[float]] = []  # empty: waiting only, no cores (a collective)
    hop_wait_s: list[float] = []  # empty: not measured (a collective, a hardware file)
    _lines: list[tuple[float, float]] = PrivateAttr(default_factory=list)
    _core_lines: list[tuple[float, float]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _shape(self) -> LockstepCost:
        if self.gaps_s != sorted(self.gaps_s) or self.measured_bytes != sorted(self.measured_bytes):
            raise ValueError("measured_bytes and gaps_s must be ascending")
        for name in ("extra_s", "extra_core_s"):
            table = getattr(self, name)
            if name == "extra_core_s" and not table:
                continue
            if len(table) != len(self.measured_bytes) or any(
                len(row) != len(self.gaps_s) for row in table
            ):
                raise ValueError(f"{name} needs one row per measured_bytes, one value per gap")
        if self.hop_wait_s and len(self.hop_wait_s) != len(self.measured_bytes):
            raise ValueError("hop_wait_s needs one value per measured_bytes (or none)")
        if any(value < 0 for value in self.hop_wait_s):
            raise ValueError("hop_wait_s must be >= 0 seconds")
        if len(set(self.gaps_s)) < 2:
            raise ValueError("gaps_s needs two distinct gaps at least (a line is fitted)")
        # per measured size, the least-squares (slope, intercept) through its gaps
        fit = lambda table: [statistics.linear_regression(self.gaps_s, row) for row in table]  # noqa: E731
        self._lines, self._core_lines = fit(self.extra_s), fit(self.extra_core_s)
        return self

    def extra(self, gap_s: float, nbytes: float) -> float:
        """Extra seconds of a collective of `nbytes` after `gap_s` seconds of compute: per
        measured size the least-squares line through its gaps (single points are noisy: a
        mean holds the rare long stall), at least 0, constant beyond the longest gap and
        falling to 0 below the shortest (back to back costs nothing extra); between sizes
        in log(bytes), constant beyond them."""
        return self._at(self._lines, gap_s, nbytes)

    def extra_core(self, gap_s: float, nbytes: float) -> float:
        """The core-seconds those extra seconds keep busy (as `extra`; 0 when not measured)."""
        return self._at(self._core_lines, gap_s, nbytes) if self._core_lines else 0.0

    def hop_wait(self, nbytes: float) -> float:
        """`hop_wait_s` at `nbytes` (between sizes in log(bytes), constant beyond them; 0
        when not measured)."""
        if not self.hop_wait_s:
            return 0.0
        return interpolate(self.measured_bytes, self.hop_wait_s, max(nbytes, 1.0))

    def _at(self, lines: list[tuple[float, float]], gap_s: float, nbytes: float) -> float:
        if gap_s <= 0:
            return 0.0
        at = min(max(gap_s, self.gaps_s[0]), self.gaps_s[-1])
        per_size = [max(intercept + slope * at, 0.0) for slope, intercept in lines]
        extra = interpolate(self.measured_bytes, per_size, max(nbytes, 1.0))
        return extra * min(gap_s / self.gaps_s[0], 1.0)


class LinkCost(_Model):
    """A network link measured between two testnet hosts (or quoted for a paper's)."""

    bytes_per_s: PositiveFloat
    latency_s: float = Field(default=0.0, ge=0)


class Calibration(_Model):
    host: str = "?"
    date: str = ""
    cores: PositiveInt
    flops_per_s: PositiveFloat | None = None  # a core's effective FLOP/s on dense layers
    # a hardware file's data loading, seconds per example, for the models it prices by FLOPs
    load_s: float = Field(default=0.0, ge=0)
    models: dict[str, ModelCost] = {}
    apply_ns: dict[str, float] = {}  # optimizer -> ns per value of a shard's update
    codecs: dict[str, CodecCost] = {}
    pull: MessageCost  # a shard's slice to a replica (fp32), per shard call
    push: MessageCost  # a replica's gradient slice into the object store, per shard call
    allreduce: MessageCost | None = None  # gloo, two processes: per byte of the tensor
    # FSDP's all-gather and reduce-scatter, gloo, two processes: per byte of the whole
    # (gathered) tensor; None: priced as ring steps of `allreduce`
    allgather: MessageCost | None = None
    reduce_scatter: MessageCost | None = None
    # sync "average" mode's `average_tensors` between two processes: per byte of the tensors
    average: MessageCost | None = None
    # a model-parallel exchange between two processes of one machine, by bytes each sends
    # the other (gloo all-to-all with the cutting and placing around it; a hardware file:
    # a copy between two GPUs of one server)
    exchange: MessageCost | None = None
    # a lock-step collective after compute, beyond `allreduce` / `exchange`, by kind
    # ("allreduce", "exchange"), and a replica's pull + push after its compute beyond
    # `pull` and `push` ("shard_calls"); missing: a file from before it was measured, or a
    # hardware file: nothing extra
    lockstep: dict[str, LockstepCost] = {}
    checkpoint_bytes_per_s: PositiveFloat = 200e6
    # flatten a list of tensors, scale it and copy it back (sync "average" mode's work
    # around its all-reduce, one process alone), bytes of the tensors per second
    flatten_bytes_per_s: PositiveFloat = 1e9
    # A replica's push beyond its calls (`ReplicaClient.push`): collecting the previous,
    # applied push's answers (`collect_s + shards * collect_shard_s`: a `ray.get` per shard
    # and the push's record) and zeroing its gradient buffer (bytes per second). Zero and
    # None: a file from before they were measured, or a hardware file: nothing priced.
    collect_s: float = Field(default=0.0, ge=0)
    collect_shard_s: float = Field(default=0.0, ge=0)
    zero_bytes_per_s: PositiveFloat | None = None
    # cores that Ray's own processes (raylet, GCS, workers' heartbeats) keep busy when idle
    idle_cores: float = Field(default=0.0, ge=0)
    link: LinkCost | None = None  # testnet hosts, when they were given
    # a pull's and a push's cost beyond `pull` / `push` with the shard on another machine
    # (Ray moves the object between the nodes' stores): wall time beyond the link's transfer
    # of the payload, and core-seconds; measured between two testnet hosts
    # (`scaleout.sim.measure_crossing`); None: nothing beyond
    pull_across: MessageCost | None = None
    push_across: MessageCost | None = None
    notes: dict[str, Any] = {}

    # --- reading and writing -------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | str) -> Calibration:
        path = Path(path)
        if not path.exists():
            raise ConfigError(
                f"{path} does not exist: run `scaleout calibrate` first (it writes "
                f"{DEFAULT_CALIBRATION}), or give --calibration FILE"
            )
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (json.JSONDecodeError, ValidationError) as err:
            first = str(err).splitlines()[0:3]
            raise ConfigError(f"{path} is not a calibration file: {' '.join(first)}") from None

    def save(self, path: Path | str) -> Path:
        """Write atomically (a temporary file renamed over the target)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(path)
        return path

    # --- costs -----------------------------------------------------------------------------

    def model_cost(self, key: str, num_parameters: int, forward_flops: int) -> ModelCost:
        """The measured cost of model `key`; otherwise priced from its FLOPs by the
        nearest measured model (or `flops_per_s`): three forward passes per training step."""
        if key in self.models:
            return self.models[key]
        rate = self._flop_rate()
        if rate is None or forward_flops <= 0:
            raise ConfigError(
                "this config's model is not in the calibration and has no FLOP estimate: "
                "run `scaleout calibrate CONFIG` with it"
            )
        per_example = 3 * forward_flops / rate
        return ModelCost(
            num_parameters=num_parameters,
            forward_flops=forward_flops,
            batch_size=1,
            train_s={1: per_example + self.load_s},  # a step's cost includes its loading
            eval_s=per_example / 3,
            load_s=self.load_s,
        )

    def _flop_rate(self) -> float | None:
        """FLOP/s of one thread: the file's, else the measured models' best."""
        if self.flops_per_s is not None:
            return self.flops_per_s
        rates = [
            3 * m.forward_flops / m.train_s[1]
            for m in self.models.values()
            if m.forward_flops and 1 in m.train_s
        ]
        return max(rates) if rates else None

    def codec_s(self, codec: str, numel: int, which: str) -> float:
        """Seconds to encode or decode `numel` values with `codec` (fp32 travels as is)."""
        if codec == "fp32" or numel == 0:
            return 0.0
        if codec not in self.codecs:
            raise ConfigError(
                f"compress.codec = {codec!r} is not in the calibration: run `scaleout "
                "calibrate` (it measures every codec)"
            )
        return self.codecs[codec].seconds(numel, which)

    def collect_push_s(self, shards: int) -> float:
        """A replica's seconds to collect one applied push's answers from `shards` shards."""
        return self.collect_s + shards * self.collect_shard_s

    def zero_s(self, numel: int) -> float:
        """Seconds to zero a gradient buffer of `numel` fp32 values (0: not measured)."""
        return 0.0 if self.zero_bytes_per_s is None else 4 * numel / self.zero_bytes_per_s

    def apply_s(self, optimizer: str, numel: int) -> float:
        if optimizer not in self.apply_ns:
            raise ConfigError(
                f"train.optimizer = {optimizer!r} is not in the calibration: run `scaleout "
                "calibrate` again"
            )
        return numel * self.apply_ns[optimizer] * 1e-9


def _at_threads(table: dict[int, float], threads: int) -> float:
    """Seconds per example at `threads`: measured, or the nearest fewer threads' scaled by
    perfect speed-up beyond what was measured (so more threads never cost more)."""
    if threads in table:
        return table[threads]
    below = [t for t in table if t <= threads]
    base = max(below) if below else min(table)
    return table[base] * base / threads if below else table[base]


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear in log(x) between measured sizes; constant beyond both ends."""
    if not xs:
        raise ValueError("no measured sizes to interpolate")
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1 = math.log(xs[i - 1]), math.log(xs[i])
    t = (math.log(x) - x0) / (x1 - x0)
    return ys[i - 1] + t * (ys[i] - ys[i - 1])
