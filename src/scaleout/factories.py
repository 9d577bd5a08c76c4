"""User factories named as "package.module:function": import, call, and report failures as
one line that names the factory.

A factory runs in every worker process (each builds its own model and data), so it is named
by import path in TOML, or passed as a function to `scaleout.fit` (Ray sends functions defined
in the user's `__main__` by value). Modules are imported relative to the current directory
too, as `python -m` would, so `examples.cnn:build_model` works from the repository root.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from scaleout.errors import ConfigError, FactoryError, UserError


def callable_name(fn: Callable[..., Any]) -> str:
    """ "module:qualified.name" of a function (what `config.json` records)."""
    module = getattr(fn, "__module__", None) or "<unknown>"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{name}"


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """The function that "package.module:function" names; `key` (e.g. `model.factory`) is
    named in every error."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name.strip() or not attribute.strip():
        raise ConfigError(f"{key} = {spec!r}: expected 'package.module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(
            f"{key} = {spec!r}: cannot import {err.name or module_name!r}; check the module name "
            "and run from the directory that holds it (or put it on PYTHONPATH)"
        ) from None
    except Exception as err:  # noqa: BLE001 - any error while importing the user's module
        raise ConfigError(
            f"{key} = {spec!r}: importing {module_name} raised {one_line(err)}"
        ) from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key} = {spec!r}: module {module_name} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(
            f"{key} = {spec!r}: {attribute} is a {type(target).__name__}, not a function"
        )
    return target


def call_factory(
    fn: Callable[..., Any], name: str, what: str, kwargs: dict[str, Any] | None = None
) -> Any:  # noqa: ANN401 - whatever the factory returns; the caller checks its type
    """`fn(**kwargs)`; an exception inside it becomes a `FactoryError` naming the factory
    (a `UserError` it raises on purpose passes through unchanged)."""
    try:
        return fn(**(kwargs or {}))
    except UserError:
        raise
    except TypeError as err:
        if kwargs and "argument" in str(err):
            raise FactoryError(
                f"{what} factory {name} does not take its kwargs {sorted(kwargs)}: {one_line(err)}"
            ) from None
        raise FactoryError(f"{what} factory {name} raised {one_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - the user's code: report it, never a traceback
        raise FactoryError(f"{what} factory {name} raised {one_line(err)}") from None


def one_line(err: BaseException) -> str:
    """`Type: first line of its message` (the type alone for an empty message)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
