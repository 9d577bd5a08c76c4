"""The Python API: `scaleout.fit`, and the run config it takes.

    import scaleout

    result = scaleout.fit(
        "configs/mnist_downpour.toml",   # a TOML path, a dict of sections, or a RunConfig
        model=build_model,               # optional: () -> nn.Module; overrides [model]
        data=build_data,                 # optional: () -> (train, test) Datasets; overrides [data]
        loss=None,                       # optional: (output, target) -> scalar; cross-entropy
        metrics=None,                    # optional: (output, target) -> {name: batch mean}
        optimizer=None,                  # optional: (params) -> torch.optim.Optimizer
        overrides=["train.lr=0.001"],    # exactly as `scaleout train --set`
    )
    result.best_test_accuracy, result.final_test_accuracy, result.steps, result.run_dir

A run config is one table per component: `[run]`, `[data]`, `[loader]`, `[model]`,
`[train]`, `[compress]` and one per strategy (`[downpour]`, `[sandblaster]`, `[sync]`,
`[model_parallel]`); each section is defined beside the component that owns it and every
key has a default, so a dict config holds only what it changes. The factories run in every
worker: each Ray actor builds its own model and data (a function from the user's `__main__`
travels by value).
"""

from __future__ import annotations

import copy
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, create_model

from scaleout.compress import CompressSection
from scaleout.config import Section, apply_overrides, read_toml, validate
from scaleout.data.config import DATA_SECTIONS, LoaderSection
from scaleout.errors import ConfigError, DataError
from scaleout.factories import callable_name
from scaleout.metrics import check_tensorboard
from scaleout.nn.config import MODEL_SECTIONS
from scaleout.nn.optim import OptimizerFactory
from scaleout.progress import console
from scaleout.rundir import RunDir
from scaleout.runtime import session
from scaleout.strategies import STRATEGIES
from scaleout.train.config import RunSection, TrainSection
from scaleout.train.driver import Driver, TrainResult
from scaleout.train.job import CallableData, CallableModel, Job, LossFn, probe_job
from scaleout.train.protocol import Strategy
from scaleout.train.step import check_step_options
from scaleout.train.user_metrics import MetricsFn

__all__ = ["Run", "RunConfig", "TrainResult", "config_from_dict", "fit", "load_config", "prepare"]

# A `[model]` / `[data]` table that names a factory selects the factory section.
_TAGS = {"model": "kind", "data": "dataset"}


def _tag_factory(table: Any, tag: str) -> Any:  # noqa: ANN401
    if isinstance(table, dict) and "factory" in table and tag not in table:
        return {tag: "factory", **table}
    return table


def _table(value: Any) -> Any:  # noqa: ANN401
    if value is not None and not isinstance(value, dict | Section):
        raise ValueError("must be a table, e.g. [data] with its keys below")
    return value


# (`config_from_dict` tags a table that names a factory before validation, so that error
# messages and config.json show the tag the union selects by.)
ModelSection = Annotated[
    Annotated[Union[MODEL_SECTIONS], Field(discriminator="kind")] | None,  # type: ignore[valid-type]  # noqa: UP007
    BeforeValidator(_table),
]
DataSection = Annotated[
    Annotated[Union[DATA_SECTIONS], Field(discriminator="dataset")] | None,  # type: ignore[valid-type]  # noqa: UP007
    BeforeValidator(_table),
]
StrategyName = Literal[tuple(STRATEGIES)]  # type: ignore[valid-type]


class TrainConfig(TrainSection):
    strategy: StrategyName = "single"  # type: ignore[valid-type]


class _Core(Section):
    """The sections every run has; the strategies' sections are added from the registry."""

    run: RunSection = Field(default_factory=RunSection)
    data: DataSection = None
    loader: LoaderSection = Field(default_factory=LoaderSection)
    model: ModelSection = None
    train: TrainConfig = Field(default_factory=TrainConfig)
    compress: CompressSection = Field(default_factory=CompressSection)

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir


RunConfig = create_model(  # type: ignore[call-overload]
    "RunConfig",
    __base__=_Core,
    __doc__="A whole run: one section per component (see `scaleout.api`).",
    **{
        name: (spec.section, Field(default_factory=spec.section))
        for name, spec in STRATEGIES.items()
        if spec.section is not None
    },
)


# --- loading ---------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> Any:  # noqa: ANN401
    """Read, override (`--set key.path=value`) and validate a run config file (a
    `RunConfig`); a `ConfigError` with one line per problem otherwise."""
    raw = apply_overrides(read_toml(path), overrides)
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Any:  # noqa: ANN401
    """Validate raw tables as a `RunConfig`; errors name `source` and the key path. The data
    files the config names are checked too, so a run fails before it builds anything."""
    raw = dict(raw)
    for key, tag in _TAGS.items():  # a table naming a factory is the factory section
        if raw.get(key) is None:
            raw.pop(key, None)
        else:
            raw[key] = _tag_factory(raw[key], tag)
    config = validate(RunConfig, raw, source)
    if config.data is not None:
        try:
            config.data.check()
        except DataError as err:
            raise ConfigError(f"{source}: {err}") from None
    return config


def _as_config(config: Any, overrides: list[str] | tuple[str, ...]) -> Any:  # noqa: ANN401
    if isinstance(config, RunConfig):
        if not overrides:
            return config
        return config_from_dict(apply_overrides(config.model_dump(mode="json"), overrides))
    if isinstance(config, dict):
        return config_from_dict(apply_overrides(copy.deepcopy(config), overrides))
    if isinstance(config, str | os.PathLike):
        return load_config(config, overrides)
    raise ConfigError(
        f"config = {type(config).__name__}: give a TOML path, a dict of sections or a RunConfig"
    )


# --- a job from a config and the user's factories -------------------------------------------


def build_job(
    config: Any,  # noqa: ANN401 - a RunConfig
    model: Any = None,  # noqa: ANN401 - () -> nn.Module
    data: Any = None,  # noqa: ANN401 - () -> (train, test)
    loss: LossFn | None = None,
    source: str = "config",
    metrics: MetricsFn | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Job:
    """The job a run trains: its sections, and the model, data, loss, metrics and optimizer
    it names or is given. `config.json` records the factories' names."""
    given_fns = (("model", model), ("data", data), ("loss", loss), ("metrics", metrics))
    for name, given in (*given_fns, ("optimizer", optimizer)):
        if given is not None and not callable(given):
            raise ConfigError(f"{name} = {given!r}: give a function (or leave it out)")
    record = config.model_dump(mode="json")
    if model is not None:
        model_source: Any = CallableModel(model)
        record["model"] = {"kind": "factory", "factory": model_source.name}
    elif config.model is not None:
        model_source = config.model
    else:
        raise ConfigError(
            f"{source}: [model] is missing: set model.kind (a model of the registry) or "
            "model.factory = 'package.module:function', or pass model= to scaleout.fit"
        )
    if data is not None:
        data_source: Any = CallableData(data)
        record["data"] = {"dataset": "factory", "factory": data_source.name}
    elif config.data is not None:
        data_source = config.data
    else:
        raise ConfigError(
            f"{source}: [data] is missing: set data.dataset or data.factory = "
            "'package.module:function', or pass data= to scaleout.fit"
        )
    for key, given in (("loss", loss), ("metrics", metrics), ("optimizer", optimizer)):
        if given is not None:
            record["train"][key] = callable_name(given)
    sections = {name: getattr(config, name) for name, spec in STRATEGIES.items() if spec.section}
    # Absolute on the driver: actors on other nodes (shards, replicas) write where the driver
    # reads, not into whatever directory their node's `ray start` ran in.
    run = config.run.model_copy(update={"out_dir": config.run.out_dir.absolute()})
    return Job(
        run=run,
        train=config.train,
        loader=config.loader,
        compress=config.compress,
        model=model_source,
        data=data_source,
        loss=loss,
        optimizer=optimizer,
        metrics=metrics,
        sections=sections,
        record=record,
    )


@dataclass
class Run:
    """A run ready to train: its job, its strategy (not started yet) and its directory.
    `scaleout.fit` is `prepare(...).train()`; holding the `Run` lets a caller look at the
    strategy while it trains (tests inject faults this way)."""

    job: Job
    strategy: Strategy
    run_dir: RunDir
    resume: bool
    uses_ray: bool

    def train(self) -> TrainResult:
        try:
            with session(self.job.run.address) if self.uses_ray else nullcontext():
                return Driver(self.strategy, self.job, self.run_dir, self.resume).run_training()
        finally:
            self.close()  # after the session: no actor of this run writes the directory now

    def close(self) -> None:
        """Give the run directory back: release its lock and, if training never started,
        put back the previous run that `overwrite` set aside. `train()` ends with this; a
        `Run` that is not trained is closed when garbage-collected, or call it."""
        self.run_dir.close()


def prepare(
    config: Any,  # noqa: ANN401 - a TOML path, a dict of sections, or a RunConfig
    model: Any = None,  # noqa: ANN401 - () -> nn.Module
    data: Any = None,  # noqa: ANN401 - () -> (train Dataset, test Dataset)
    loss: LossFn | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    resume: bool = False,
    overwrite: bool = False,
    metrics: MetricsFn | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Run:
    """Everything `fit` does before training: validate the config, run the factories once
    (a bad one fails here, as one line), check the strategy's options, and prepare the run
    directory: lock it for this run and, with `overwrite`, set the earlier run aside (it is
    deleted once training starts, put back if it never does)."""
    run_config = _as_config(config, overrides)
    source = str(config) if isinstance(config, str | os.PathLike) else "config"
    job = build_job(run_config, model, data, loss, source, metrics, optimizer)
    spec = STRATEGIES[run_config.train.strategy]
    if job.run.tensorboard:
        check_tensorboard()
    probe_job(job)
    strategy = spec.create(job)
    plan = strategy.plan()
    check_step_options(job, plan.phase_steps or plan.total_steps)
    run_dir = RunDir.prepare(
        job.run_dir, job.record, run_config.train.keep_checkpoints, resume, overwrite
    )
    if run_dir.recovered:
        console.print(
            f"put back the previous run in {run_dir.path}: an --overwrite killed before it "
            "started training had set it aside"
        )
    console.print(f"{job.run.name}: strategy {spec.name}, writing {run_dir.path}")
    return Run(job, strategy, run_dir, resume, spec.uses_ray)


def fit(
    config: Any,  # noqa: ANN401 - a TOML path, a dict of sections, or a RunConfig
    model: Any = None,  # noqa: ANN401 - () -> nn.Module
    data: Any = None,  # noqa: ANN401 - () -> (train Dataset, test Dataset)
    loss: LossFn | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    resume: bool = False,
    overwrite: bool = False,
    metrics: MetricsFn | None = None,
    optimizer: OptimizerFactory | None = None,
) -> TrainResult:
    """Train as `config` says, with the user's `model`, `data`, `loss`, test `metrics`
    (`fn(output, target) -> {name: batch mean}`, logged as `test_<name>`) and `optimizer`
    (`fn(params) -> torch.optim.Optimizer`) when given.

    `resume` continues the run in `run.out_dir / run.name` from its last checkpoint;
    `overwrite` starts it again there (a directory that holds a run needs one of the two).
    Raises a `UserError` (one line per problem) for bad input; Ctrl-C stops at the end of
    the current chunk with a checkpoint (`result.interrupted`), and so does SIGTERM
    (`result.stopped_by`) within `run.stop_grace_s`.
    """
    run = prepare(
        config,
        model,
        data,
        loss,
        overrides,
        resume=resume,
        overwrite=overwrite,
        metrics=metrics,
        optimizer=optimizer,
    )
    return run.train()
