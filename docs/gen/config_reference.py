"""The configuration reference, generated from the config sections at build time.

Every table of a run config is a pydantic model (`scaleout.config.Section`); the whole run is
`scaleout.api.RunConfig`, composed from the components' sections and the strategy registry.
This module walks `RunConfig` and writes one table per section: each key with its type, its
default and its documentation. A key's documentation is, in this order of preference, its
pydantic `Field(description=...)`, the docstring string right after it, or the source
comments that document it: the comment block right above the key and the comment at the end
of its line(s), read from the class that defines the key (or, where that class has none,
from the base class it overrides). Unions (`[model]` by `kind`, `[data]` by `dataset`) get
one table per member.

`mkdocs build` runs this file (mkdocs-gen-files) and it writes `reference/config.md`.
Imported, it writes nothing: `documented_keys()` lists what the page documents.
"""

from __future__ import annotations

import ast
import html
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Sequence
from enum import Enum
from pathlib import Path, PurePath
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PAGE = "reference/config.md"


class Table(NamedTuple):
    """One documented section: the TOML table it is, a label for a member of a union
    (`kind = "mlp"`), and the pydantic model that defines its keys."""

    name: str
    variant: str | None
    model: type[BaseModel]

    @property
    def title(self) -> str:
        return f"[{self.name}]" if self.variant is None else f"[{self.name}] {self.variant}"


def run_config() -> type[BaseModel]:
    """The model of a whole run config."""
    from scaleout.api import RunConfig

    return RunConfig


def tables(root: type[BaseModel] | None = None) -> list[Table]:
    """Every section of `root` (default: `RunConfig`) in its order: a section per field, or
    one per member where the field is a union of sections."""
    root = root or run_config()
    found: list[Table] = []
    for name, field in root.model_fields.items():
        members = _section_models(field.annotation)
        if len(members) == 1:
            found.append(Table(name, None, members[0]))
            continue
        for member in members:
            found.append(Table(name, _variant(member, members), member))
    return found


def documented_keys() -> list[tuple[str, str]]:
    """The (section, key) pairs that `reference/config.md` documents, in page order, each
    once: `section` is the TOML table (`"run"`, `"train"`, `"downpour"`, ...; `"model"` and
    `"data"` for every member of their unions, with the discriminator `kind` / `dataset`
    among the keys) and `key` a field name of its model."""
    pairs: list[tuple[str, str]] = []
    for table in tables():
        for key in table.model.model_fields:
            if (table.name, key) not in pairs:
                pairs.append((table.name, key))
    return pairs


def key_doc(model: type[BaseModel], key: str) -> str:
    """The documentation of `key` of `model` (see the module's docstring); "" if none."""
    field = model.model_fields[key]
    if field.description:
        return " ".join(field.description.split())
    for cls in model.__mro__:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            continue
        if key not in cls.__dict__.get("__annotations__", {}):
            continue
        doc = _source_docs(cls).get(key, "")
        if doc:
            return doc
    return ""


# --- reading the source -------------------------------------------------------------------


_SOURCE_DOCS: dict[type, dict[str, str]] = {}
_PRAGMA = re.compile(r"^(type:|noqa\b|pragma:|fmt:|ruff:|pyright:|mypy:)")
_TRAILING_PRAGMA = re.compile(r"\s+#\s*(type:|noqa\b|pragma:|fmt:|ruff:|pyright:|mypy:).*$")


def _source_docs(cls: type) -> dict[str, str]:
    """{key: its comments or docstring} for the annotated keys in `cls`'s own body."""
    if cls in _SOURCE_DOCS:
        return _SOURCE_DOCS[cls]
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        _SOURCE_DOCS[cls] = {}
        return {}
    lines = source.splitlines()
    full_line: dict[int, str] = {}  # line number -> a comment that is the whole line
    trailing: dict[int, str] = {}  # line number -> a comment after code
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        row, col = token.start
        text = _TRAILING_PRAGMA.sub("", token.string.lstrip("#").strip())
        if not text or _PRAGMA.match(text):
            continue  # a directive for type checkers or linters, not for readers
        if lines[row - 1][:col].strip():
            trailing[row] = text
        else:
            full_line[row] = text
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in full_line:
            above.insert(0, full_line[row])
            row -= 1
        parts = above + [
            trailing[r] for r in range(node.lineno, node.end_lineno + 1) if r in trailing
        ]
        after = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            parts.append(inspect.cleandoc(after.value.value))
        docs[node.target.id] = " ".join(" ".join(parts).split())
    _SOURCE_DOCS[cls] = docs
    return docs


# --- types and defaults as a reader writes them ---------------------------------------------


def _section_models(annotation: Any) -> list[type[BaseModel]]:  # noqa: ANN401
    """The section models an annotation holds: itself, or a union's members (None left out)."""
    found: list[type[BaseModel]] = []
    for arg in _flatten(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            found.append(arg)
    return found


def _flatten(annotation: Any) -> list[Any]:  # noqa: ANN401
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [leaf for arg in typing.get_args(annotation) for leaf in _flatten(arg)]
    return [annotation]


def _variant(member: type[BaseModel], members: list[type[BaseModel]]) -> str:
    """`kind = "mlp"`: the discriminator's values that select `member`."""
    for tag in ("kind", "dataset"):
        field = member.model_fields.get(tag)
        if field is not None and typing.get_origin(field.annotation) is typing.Literal:
            values = " or ".join(f'"{v}"' for v in typing.get_args(field.annotation))
            return f"{tag} = {values}"
    return member.__name__


_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
_NAMES = {str: "string", int: "int", float: "float", bool: "bool", Path: "path", Any: "any"}


def type_text(annotation: Any, metadata: Sequence[Any] = ()) -> str:  # noqa: ANN401
    """A type as a reader writes it: `int ≥ 1`, `"fp32", "bf16" or "fp16"`, `list of int`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        inner_meta = list(annotation.__metadata__)
        return type_text(args[0], [*inner_meta, *metadata])
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        text = " or ".join(dict.fromkeys(parts))
        return f"{text} (or unset)" if type(None) in args else text
    if origin is typing.Literal:
        text = ", ".join(_toml(v) for v in args)
        return _constrained(f"one of {text}" if len(args) > 1 else text, metadata)
    if origin is list:
        return _constrained(f"list of {type_text(args[0])}", metadata)
    if origin is tuple:
        return _constrained(f"[{', '.join(type_text(a) for a in args)}]", metadata)
    if origin is dict:
        return _constrained(f"table of {type_text(args[0])} → {type_text(args[1])}", metadata)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(_toml(m.value) for m in annotation)
    name = _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return _constrained(name, metadata)


def _constrained(text: str, metadata: Sequence[Any]) -> str:
    items: list[Any] = []
    for item in metadata:
        items.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    lengths = {
        attr: getattr(item, attr)
        for item in items
        for attr in ("min_length", "max_length")
        if getattr(item, attr, None) is not None
    }
    others = [i for i in items if not any(hasattr(i, a) for a in ("min_length", "max_length"))]
    bounds = _bounds(others)
    if lengths:
        bounds += _bounds([types.SimpleNamespace(**lengths)])
    return f"{text} {', '.join(bounds)}" if bounds else text


def _bounds(items: list[Any]) -> list[str]:
    found = []
    for item in items:
        for attr, sign in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{sign} {_number(value)}")
        low, high = getattr(item, "min_length", None), getattr(item, "max_length", None)
        if low is not None and low == high:
            found.append(f"exactly {low} long")
        elif low is not None:
            found.append(f"at least {low} long")
        elif high is not None:
            found.append(f"at most {high} long")
        if getattr(item, "pattern", None) is not None:
            found.append(f"matching `{item.pattern}`")
    return found


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _toml(value: Any) -> str:  # noqa: ANN401
    """A value as TOML writes it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | PurePath):
        return f'"{value}"'
    if isinstance(value, Enum):
        return _toml(value.value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return _number(value) if abs(value) >= 1e-3 or value == 0 else f"{value:g}"
    return str(value)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return _toml(field.default_factory())  # type: ignore[call-arg]
    return _toml(field.default)


# --- the page ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Markdown for a table cell: `|`, `<`, `>` and `&` escaped outside code spans (a code
    span in a table keeps its `|` as it is)."""
    pieces = re.split(r"(`[^`]*`)", text)
    out = [
        p if p.startswith("`") else html.escape(p, quote=False).replace("|", "\\|") for p in pieces
    ]
    return "".join(out)


def section_markdown(table: Table) -> str:
    model = table.model
    lines = [f"## {table.title}", ""]
    doc = inspect.getdoc(model) if model.__doc__ else None
    inherited = next(
        (c.__doc__ for c in model.__mro__[1:] if isinstance(c, type) and c.__doc__), None
    )
    if doc and model.__doc__ != inherited:
        lines += [" ".join(doc.split("\n\n")[0].split()), ""]
        for paragraph in doc.split("\n\n")[1:]:
            lines += [" ".join(paragraph.split()), ""]
    lines += [f"Defined by `{model.__module__}.{model.__qualname__}`.", ""]
    lines += ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    for key, field in model.model_fields.items():
        kind = type_text(field.annotation, list(field.metadata))
        lines.append(
            f"| `{key}` | {_cell(kind)} | `{default_text(field)}` | {_cell(key_doc(model, key))} |"
        )
    return "\n".join(lines) + "\n"


INTRO = """# Configuration

A run is one TOML file (or, for `scaleout.fit`, a dict of the same tables, or a
`scaleout.RunConfig`). Every key has a default, so a file holds only what it changes.
Unknown keys, wrong types and values out of range are errors, one line per problem, before
anything starts. `--set key.path=value` (and `overrides=[...]` in `scaleout.fit`) changes
any key; the value is read as TOML, and kept as text where it is not TOML:
`--set model.sizes=[784,10]`, `--set train.optimizer=adagrad`. In the descriptions below,
"None" means the key left out (unset).

This page is generated from the sections themselves when the site is built
(`docs/gen/config_reference.py`): the type and default of each key are the model's, and
"what it does" is the comment that documents the key in the source. A key with an empty
description has none there yet.

Sections: {toc}.

"""


def page_markdown() -> str:
    found = tables()
    seen: list[str] = []
    for table in found:
        if table.name not in seen:
            seen.append(table.name)
    toc = ", ".join(f"`[{name}]`" for name in seen)
    return INTRO.replace("{toc}", toc) + "\n".join(section_markdown(t) for t in found)


def write_page() -> None:
    import mkdocs_gen_files

    with mkdocs_gen_files.open(PAGE, "w") as out:
        out.write(page_markdown())
    mkdocs_gen_files.set_edit_path(PAGE, "gen/config_reference.py")


if __name__ in ("__main__", "<run_path>"):
    write_page()
