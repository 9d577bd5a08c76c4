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
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

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
    eval_s: PositiveFloat  # seconds per test example (forward only)
    load_s: float = 0.0  # seconds per example of the loader alone (within train_s)
    optimizer_s: float = 0.0  # seconds per step of the config's optimizer on the whole model
    train_size: int = 0  # examples in the training and test sets
    test_size: int = 0

    def step_s(self, batch: int, threads: int) -> float:
        """Seconds of one training step of `batch` examples at `threads` threads."""
        return batch * _at_threads(self.train_s, threads)

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
    """A call between two processes of this machine that moves `n` bytes:
    `fixed_s + n / bytes_per_s` (Ray's object store; gloo for collectives)."""

    fixed_s: float = Field(ge=0)
    bytes_per_s: PositiveFloat

    def seconds(self, nbytes: float) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s


class LinkCost(_Model):
    """A network link measured between two testnet hosts (or quoted for a paper's)."""

    bytes_per_s: PositiveFloat
    latency_s: float = Field(default=0.0, ge=0)


class Calibration(_Model):
    host: str = "?"
    date: str = ""
    cores: PositiveInt
    flops_per_s: PositiveFloat | None = None  # a core's effective FLOP/s on dense layers
    models: dict[str, ModelCost] = {}
    apply_ns: dict[str, float] = {}  # optimizer -> ns per value of a shard's update
    codecs: dict[str, CodecCost] = {}
    pull: MessageCost  # a shard's slice to a replica (fp32), per shard call
    push: MessageCost  # a replica's gradient slice into the object store, per shard call
    allreduce: MessageCost | None = None  # gloo, two processes: per byte of the tensor
    checkpoint_bytes_per_s: PositiveFloat = 200e6
    link: LinkCost | None = None  # testnet hosts, when they were given
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
            train_s={1: per_example},
            eval_s=per_example / 3,
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


def interpolate(xs: list[int], ys: list[float], x: float) -> float:
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
