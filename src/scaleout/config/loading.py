"""Reading a TOML config and applying `--set key.path=value` overrides to its raw tables."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scaleout.errors import ConfigError

_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The tables of a TOML file; a missing or malformed file is a `ConfigError` naming it."""
    source = Path(path)
    try:
        return tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a text file, expected TOML") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: invalid TOML: {err}") from None


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in raw tables; the value is parsed as TOML, else kept as text."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise ConfigError(f"--set {override!r}: expected key.path=value, e.g. train.lr=0.01")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {part} is not a table")
        node = child
    node[leaf] = value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply every override in order; returns `raw` (changed in place)."""
    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides = {overrides!r}: give a list of key.path=value strings, e.g. "
            '["train.lr=0.01"]'
        )
    for override in overrides:
        if not isinstance(override, str):
            raise ConfigError(f"override {override!r}: expected a key.path=value string")
        apply_override(raw, override)
    return raw
