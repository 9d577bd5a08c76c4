"""Run configs for the tests, written from dicts: one base (a CPU run writing under the
test's directory) with each test's own tables merged over it, instead of TOML templates
copied from file to file. Tests of TOML parsing itself keep their TOML text."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any


def config_file(directory: Path, name: str = "run", **sections: dict[str, Any]) -> Path:
    """`directory/<name>.toml`: a run named `name`, on the CPU, writing under
    `directory/runs`, with `sections` (one dict per table: `train={"steps": 4}`) merged over
    that base table by table; returns its path, for `scaleout train` or `prepare`."""
    raw: dict[str, dict[str, Any]] = {
        "run": {"name": name, "device": "cpu", "out_dir": str(Path(directory) / "runs")}
    }
    for table, keys in sections.items():
        raw[table] = {**raw.get(table, {}), **keys}
    text = "".join(f"[{table}]\n{_keys(keys)}" for table, keys in raw.items())
    if tomllib.loads(text) != _plain(raw):  # the writer below is small: check it round-trips
        raise ValueError(f"{raw!r} does not round-trip through TOML:\n{text}")
    path = Path(directory) / f"{name}.toml"
    path.write_text(text)
    return path


def _keys(table: dict[str, Any]) -> str:
    return "".join(f"{key} = {_value(value)}\n" for key, value in table.items())


def _value(value: Any) -> str:  # noqa: ANN401
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # JSON's escapes are TOML's basic-string escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"{value!r}: no TOML value for {type(value).__name__}")


def _plain(value: Any) -> Any:  # noqa: ANN401
    """`value` as TOML reads it back: paths as text, tuples as lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value
