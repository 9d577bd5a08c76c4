"""A `Job`: everything a strategy and each of its workers is given.

The driver builds one job from the run config and the user's factories; strategies hand it
to every worker (a Ray actor receives a copy), and each worker builds its own data and model
from it. The job is typed: workers never re-validate a dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from scaleout.compress.config import CompressSection
from scaleout.config import Section
from scaleout.data.config import LoaderSection, check_datasets
from scaleout.errors import ConfigError, FactoryError
from scaleout.factories import call_factory, callable_name, load_callable
from scaleout.nn.config import check_module
from scaleout.nn.layerwise import LayerwiseModel
from scaleout.nn.optim import OptimizerFactory, OptimizerSpec
from scaleout.parallel import can_parallelize
from scaleout.train.config import RunSection, TrainSection
from scaleout.train.outputs import cross_entropy, logits_of
from scaleout.train.user_metrics import MetricsFn, MetricSource, check_metrics

S = TypeVar("S", bound=Section)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModelSource(Protocol):
    """What builds the model in every worker: a `[model]` section or a user's function."""

    @property
    def name(self) -> str: ...
    @property
    def hint(self) -> str: ...
    def build(self) -> nn.Module: ...


class DataSource(Protocol):
    """What builds the (train, test) data sets in every worker."""

    @property
    def name(self) -> str: ...
    def build(self, seed: int) -> tuple[Dataset, Dataset]: ...


@dataclass(frozen=True)
class CallableModel:
    """`scaleout.fit(model=fn)`: a zero-argument function returning an `nn.Module`."""

    fn: Callable[[], nn.Module]

    @property
    def name(self) -> str:
        return callable_name(self.fn)

    @property
    def hint(self) -> str:
        return f"check the model that {self.name} builds against the data"

    def build(self) -> nn.Module:
        return check_module(call_factory(self.fn, self.name, "model"), self.name)


@dataclass(frozen=True)
class CallableData:
    """`scaleout.fit(data=fn)`: a zero-argument function returning (train, test)."""

    fn: Callable[[], tuple[Dataset, Dataset]]

    @property
    def name(self) -> str:
        return callable_name(self.fn)

    def build(self, seed: int) -> tuple[Dataset, Dataset]:
        return check_datasets(call_factory(self.fn, self.name, "data"), self.name)


@dataclass(frozen=True)
class Probe:
    """What the driver learns of the job before any worker starts: the training set's size,
    and whether the model trains layer-wise (greedily, phase by phase) and in how many."""

    train_size: int
    layerwise: bool = False
    num_phases: int = 1
    partitionable: bool = False  # `scaleout.parallel.parallelize` can split it over a grid
    num_parameters: int = 0  # trainable values
    module_classes: frozenset[str] = frozenset()  # the class names of the model's modules


@dataclass
class Job:
    run: RunSection
    train: TrainSection
    loader: LoaderSection
    compress: CompressSection
    model: ModelSource
    data: DataSource
    loss: LossFn | None = None  # None: `train.loss`, else cross-entropy
    optimizer: OptimizerFactory | None = None  # fit(optimizer=fn); None: `train.optimizer`
    metrics: MetricsFn | None = None  # fit(metrics=fn); None: `train.metrics`
    sections: dict[str, Section] = field(default_factory=dict)  # each strategy's own section
    record: dict[str, Any] = field(default_factory=dict)  # the config as JSON, for checkpoints
    probe: Probe | None = None  # set by `probe_job` on the driver

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir

    def section(self, name: str, kind: type[S]) -> S:
        """The `[name]` section, of type `kind`."""
        value = self.sections[name]
        assert isinstance(value, kind), f"[{name}] is a {type(value).__name__}, not {kind}"
        return value

    def build_data(self) -> tuple[Dataset, Dataset]:
        return self.data.build(self.run.seed)

    def build_model(self, train_set: Dataset) -> nn.Module:
        """The model, checked with one training example (in eval mode, no gradients)."""
        return check_fits(self.model.build(), train_set, self.model.name, self.model.hint)

    def loss_fn(self) -> LossFn:
        """The training loss: the function given to `scaleout.fit`, `train.loss`, or
        cross-entropy of the output's logits (`scaleout.train.outputs`)."""
        if self.loss is not None:
            return self.loss
        if self.train.loss is not None:
            return load_callable(self.train.loss, "train.loss")
        return cross_entropy

    def metrics_source(self) -> MetricSource | None:
        """The user's test metrics and the name messages give them (None: none)."""
        if self.metrics is not None:
            return self.metrics, callable_name(self.metrics)
        if self.train.metrics is not None:
            return load_callable(self.train.metrics, "train.metrics"), self.train.metrics
        return None

    def optimizer_options(self, **changes: Any) -> OptimizerSpec:  # noqa: ANN401
        """What builds the optimizer (a name, or the user's factory) from `[train]`,
        with `changes` (e.g. a shard's `lr` and `schedule`)."""
        train = self.train
        spec = OptimizerSpec(
            optimizer=self.optimizer if self.optimizer is not None else train.optimizer,
            lr=train.lr,
            momentum=train.momentum,
            weight_decay=train.weight_decay,
            warmup_steps=train.warmup_steps,
            betas=train.betas,
            eps=train.eps,
        )
        return dataclasses.replace(spec, **changes)


def check_fits(model: nn.Module, train_set: Dataset, name: str, hint: str) -> nn.Module:
    """Run one example through `model`: a model that does not fit the data is a one-line
    `ConfigError` (the shapes and `hint`), not a traceback from inside a worker."""
    x = train_set[0][0]
    x = torch.as_tensor(x).unsqueeze(0)  # (1, *example shape)
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise ConfigError(
            f"model ({name}) does not accept the data's examples of shape "
            f"{tuple(x.shape[1:])} ({prod(x.shape[1:])} values): {str(err).splitlines()[0]}; "
            f"{hint}"
        ) from None
    num_classes = getattr(train_set, "num_classes", 0)
    try:
        logits: torch.Tensor | None = logits_of(out)
    except ValueError:
        logits = None  # a user's loss reads it
    if num_classes and logits is not None and logits.dim() == 2 and logits.shape[-1] < num_classes:
        raise ConfigError(
            f"model ({name}) has {logits.shape[-1]} outputs but the data has {num_classes} "
            f"classes; {hint}"
        )
    return model.train()


def probe_job(job: Job) -> Probe:
    """Build the job's data and model once on the driver, before any worker starts: a
    factory that cannot be imported, raises or returns the wrong type fails here, as one
    line. The model is built on PyTorch's meta device (shapes, no memory) when it can be."""
    train_set, test_set = job.build_data()
    try:
        with torch.device("meta"):
            model = job.model.build()
    except (FactoryError, RuntimeError, NotImplementedError, TypeError):
        model = job.model.build()  # a factory that needs real tensors (e.g. loads weights)
    layerwise = isinstance(model, LayerwiseModel)
    num_phases = model.num_phases if layerwise else 1
    partitionable = can_parallelize(model)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    classes = frozenset(type(m).__name__ for m in model.modules())
    job.probe = Probe(len(train_set), layerwise, num_phases, partitionable, count, classes)  # type: ignore[arg-type]
    _probe_metrics(job, layerwise, train_set, test_set)
    return job.probe


def _probe_metrics(job: Job, layerwise: bool, train_set: Dataset, test_set: Dataset) -> None:
    """The user's metrics on one batch of two test examples through the real model: a
    function that raises or returns anything but numbers fails here, as one line."""
    source = job.metrics_source()
    if source is None:
        return
    if layerwise:
        raise ConfigError(
            f"train.metrics = {source[1]!r}: model ({job.model.name}) trains layer-wise and "
            "has no outputs to measure; leave train.metrics out"
        )
    model = job.build_model(train_set)
    examples = [test_set[i] for i in range(min(2, len(test_set)))]  # type: ignore[arg-type]
    x, y = default_collate(examples)[:2]
    check_metrics(source[0], source[1], model, x, y)
