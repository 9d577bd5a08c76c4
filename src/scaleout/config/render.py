"""Validation errors as one line per problem: `source: key.path = value: what is wrong`.

Pydantic's locations include the tags of discriminated unions (`model.mlp.sizes`); the lines
name the keys the user wrote (`model.sizes`), list the allowed keys of a table when one is
unknown, and shorten long values.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from scaleout.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

# Keys that select a member of a union of sections ([data] dataset, [model] kind).
DISCRIMINATORS = ("dataset", "kind")


def validate(model: type[M], raw: dict[str, Any], source: str) -> M:
    """`model` validated from raw tables; a `ConfigError` with one line per problem, each
    starting with `source`, otherwise."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        lines = [f"{source}: {line}" for line in describe_errors(err, raw, model)]
        raise ConfigError("\n".join(lines)) from None


def describe_errors(err: ValidationError, raw: dict[str, Any], root: type[BaseModel]) -> list[str]:
    """One line per validation error: `key.path = value: what is wrong (what is allowed)`."""
    lines = []
    for error in err.errors(include_url=False):
        keys = _key_path(error["loc"], raw)
        path = ".".join(keys) or "<top level>"
        kind = error["type"]
        if kind == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(root, keys[:-1], raw))
            where = f"[{'.'.join(keys[:-1])}]" if len(keys) > 1 else "the top level"
            lines.append(f"{path}: unknown key (allowed in {where}: {allowed})")
        elif kind == "missing":
            lines.append(f"{path}: missing required key")
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            tag = error["ctx"]["discriminator"].strip("'")
            expected = error["ctx"].get("expected_tags", "")
            value = error["input"].get(tag) if isinstance(error["input"], dict) else None
            shown = "missing" if value is None else show(value)
            lines.append(f"{path}.{tag} = {shown}: expected one of {expected}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"{path} = {show(error['input'])}: {message}")
    return lines


def _key_path(loc: tuple[int | str, ...], raw: dict[str, Any]) -> list[str]:
    """The user's key path: pydantic's location less the union tags it inserts (a tag is a
    step of the location that is the table's `kind` / `dataset`, or not a key of it)."""
    keys: list[str] = []
    node: Any = raw
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and isinstance(part, str):
            is_tag = any(node.get(tag) == part for tag in DISCRIMINATORS)
            if is_tag or (part not in node and not last):
                continue  # a discriminated-union tag, not a key the user wrote
        keys.append(f"[{part}]" if isinstance(part, int) else str(part))
        node = node.get(part) if isinstance(node, dict) else None
    return _join_indices(keys)


def _join_indices(keys: list[str]) -> list[str]:
    joined: list[str] = []
    for key in keys:
        if key.startswith("[") and joined:
            joined[-1] += key
        else:
            joined.append(key)
    return joined


def _allowed_keys(root: type[BaseModel], section: list[str], raw: dict[str, Any]) -> list[str]:
    """Field names of the model that holds `section` (a key path) under `root`."""
    model: type[BaseModel] = root
    node: Any = raw
    for key in section:
        field = model.model_fields.get(key)
        if field is None:
            break
        node = node.get(key, {}) if isinstance(node, dict) else {}
        model = member_for(field.annotation, node) or model
    return list(model.model_fields)


def models_in(annotation: Any) -> list[type[BaseModel]]:  # noqa: ANN401
    """The section classes an annotation admits (through Optional, unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += models_in(arg)
    return found


def member_for(annotation: Any, node: Any) -> type[BaseModel] | None:  # noqa: ANN401
    """The union member a raw table selects: by its tag (`kind`, `dataset`), or the member
    with a `factory` key when the table names a factory."""
    models = models_in(annotation)
    if not models:
        return None
    if isinstance(node, dict):
        for model in models:
            for tag in DISCRIMINATORS:
                field = model.model_fields.get(tag)
                if field is not None and node.get(tag) in typing.get_args(field.annotation):
                    return model
        if "factory" in node:
            return next((m for m in models if "factory" in m.model_fields), models[0])
    return models[0]


def show(value: Any) -> str:  # noqa: ANN401
    """A value as the user wrote it, cut to 60 characters."""
    text = repr(str(value)) if isinstance(value, Path) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
