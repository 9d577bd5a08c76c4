"""Property: `scaleout train CONFIG --set key=value` never shows a traceback and never hangs.

Hypothesis picks a shipped config (one per strategy), one or two keys of its run config
(walked from the `RunConfig` schema, so new keys are covered without editing this file) and
a value: one drawn from the key's own type, often outside its range (negative counts, zero,
1e15 seconds, inf, nan, unknown names), or one of a wrong type. The command runs in a
subprocess with a deadline and must exit 0 (the value was fine and the run trained) or 2
(one `error:` line per problem), with no traceback on either stream.

The runs are made tiny by overrides applied before the drawn ones; keys that set how much
work a run does (steps, sizes, counts of processes) are drawn from small values only, so a
valid draw trains in seconds (their extremes are checked one by one in test_bad_input.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from scaleout.api import load_config

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 150  # a run that takes longer hangs

TINY = [
    "data.num_train=512",
    "data.num_test=256",
    "train.steps=2",
    "train.eval_every=2",
    "train.log_every=1",
    "train.batch_size=64",
]
CONFIGS = {
    "configs/mnist_single.toml": [],
    "configs/mnist_downpour.toml": ["downpour.warmstart_steps=0"],
    "configs/mnist_sync.toml": [],
    "configs/mnist_sandblaster.toml": ["sandblaster.max_iterations=2"],
    "configs/autoencoder_model_parallel.toml": [],
}
# Keys that size the work or the number of processes: small values only (see the docstring).
SIZES = {
    "train.steps",
    "train.epochs",
    "sandblaster.max_iterations",
    "data.num_train",
    "data.num_test",
    "downpour.num_replicas",
    "downpour.num_shards",
    "sandblaster.num_replicas",
    "sandblaster.num_shards",
    "sync.num_workers",
    "model_parallel.grid",
    "train.eval_batch_size",
    "model.sizes",
    "model.num_stacks",
    "model.in_size",
    "data.patch_size",
}
# Keys that cannot be drawn here: where the run writes (the test sets it), the cluster to
# join (an address that answers is another test's), the device (no GPU here).
FIXED = {"run.out_dir", "run.name", "run.address", "run.device", "train.strategy"}

WRONG = st.sampled_from(["abc", [1, "x"], {"a": 1}, -1, 3.5, True, "", [[1, 2], [3]]])


def leaves(section: BaseModel, prefix: str = "") -> list[tuple[str, Any]]:
    """(key path, annotation) of every leaf of a config, through its sub-sections."""
    found = []
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            found += leaves(value, path + ".")
        elif path not in FIXED:
            found.append((path, field.annotation))
    return found


def values(annotation: Any, small: bool) -> st.SearchStrategy[Any]:  # noqa: ANN401
    """Values of a field's type, often out of its range."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return values(args[0], small)
    if origin is typing.Literal:
        return st.sampled_from(args) | st.text("abcdefxyz_", max_size=8)
    if origin in (typing.Union, types.UnionType):
        arms = [values(a, small) for a in args if a is not type(None)]
        return st.one_of(arms) if arms else st.nothing()
    if origin is list:
        return st.lists(values(args[0] if args else int, small), max_size=4)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        extremes = [] if small else [0, 2**31, 10**12]
        return st.integers(-2, 4) | st.sampled_from([0, 1, *extremes])
    if annotation is float:
        edges = [0.0, 1e-12, 1.0, 1e15, math.inf, -math.inf, math.nan]
        return st.floats(-10, 10) | st.sampled_from(edges)
    if annotation is str or annotation is Path:
        return st.text("abcxyz_:./", max_size=12)
    return WRONG


def toml(value: Any) -> str:  # noqa: ANN401
    """A value as `--set` reads it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"
    raise AssertionError(f"cannot write {value!r} as TOML")


def relevant(config: Any) -> set[str]:  # noqa: ANN401 - a RunConfig
    """The sections a run of `config` reads: the core ones and its strategy's (a Downpour
    replica may be a model-parallel grid)."""
    strategy = config.train.strategy
    extra = {"model_parallel"} if strategy == "downpour" else set()
    return {"run", "data", "loader", "model", "train", "compress", strategy} | extra


@st.composite
def commands(draw: st.DrawFn) -> tuple[str, list[str]]:
    config = draw(st.sampled_from(sorted(CONFIGS)))
    loaded = load_config(REPO / config, TINY + CONFIGS[config])
    keys = [(k, a) for k, a in leaves(loaded) if k.split(".")[0] in relevant(loaded)]
    overrides = []
    for key, annotation in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=2)):
        value = draw(values(annotation, small=key in SIZES) | WRONG)
        overrides.append(f"{key}={toml(value)}")
    return config, overrides


def run_train(config: str, overrides: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "scaleout.cli", "train", config, "--out", str(out)]
    args += ["--overwrite"]
    for override in TINY + CONFIGS[config] + overrides:
        args += ["--set", override]
    env = {**os.environ, "NO_COLOR": "1"}
    try:
        return subprocess.run(
            args, cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {DEADLINE_S} s: {' '.join(args[3:])}")


def check(config: str, overrides: list[str], out: Path) -> None:
    done = run_train(config, overrides, out)
    shown = f"scaleout train {config} " + " ".join(f"--set {o}" for o in overrides)
    both = done.stdout + done.stderr
    assert "Traceback" not in both, f"{shown}\n{both[-3000:]}"
    assert done.returncode in (0, 2), f"{shown}: exit {done.returncode}\n{both[-3000:]}"
    if done.returncode == 2:
        assert "error:" in done.stderr, f"{shown}: exit 2 without an error line\n{both[-2000:]}"


_SETTINGS = dict(
    deadline=None,
    derandomize=True,  # the default suite checks the same draws every time
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@settings(max_examples=2, **_SETTINGS)  # (the slow suite draws 40)
@given(drawn=commands())
def test_set_never_tracebacks(drawn: tuple[str, list[str]], tmp_path: Path) -> None:
    check(*drawn, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 40 draws of about 7 s each; one draw may take up to DEADLINE_S
@settings(max_examples=40, **{**_SETTINGS, "derandomize": False})
@given(drawn=commands())
def test_set_never_tracebacks_many(drawn: tuple[str, list[str]], tmp_path: Path) -> None:
    check(*drawn, tmp_path)
