"""The generated configuration reference names every key of every section, with a doc, and
the CLI reference every verb: the pages are built from the code, so they cannot drift."""

import importlib.util
import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from scaleout.api import RunConfig
from scaleout.cli import build_parser

GEN = Path(__file__).resolve().parents[2] / "docs" / "gen"


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, GEN / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sections(annotation: object) -> list[type[BaseModel]]:
    """Every pydantic model a field's annotation can hold (unions, Annotated, Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += [m for m in _sections(arg) if m not in found]
    return found


def _expected_keys() -> set[tuple[str, str]]:
    keys = set()
    for table, field in RunConfig.model_fields.items():
        members = _sections(field.annotation)
        assert members, f"[{table}] is not a section"
        for member in members:
            keys |= {(table, key) for key in member.model_fields}
    return keys


def _page_rows(page: str) -> dict[tuple[str, str], str]:
    """(table, key) -> its "what it does" cell, read from the page's tables."""
    rows, table = {}, None
    for line in page.splitlines():
        heading = re.match(r"^## \[(\w+)\]", line)
        if heading:
            table = heading.group(1)
            continue
        cell = re.match(r"^\| `([^`]+)` \|", line)
        if cell and table is not None:
            rows[(table, cell.group(1))] = line.rstrip("|").rsplit("|", 1)[-1].strip()
    return rows


def test_config_reference_names_every_key_of_every_section_with_a_doc():
    reference = _load("config_reference")
    expected = _expected_keys()
    assert set(reference.documented_keys()) == expected
    rows = _page_rows(reference.page_markdown())
    assert set(rows) == expected
    undocumented = sorted(f"{t}.{k}" for (t, k), doc in rows.items() if not doc)
    assert not undocumented, f"keys without a doc in their section's source: {undocumented}"


def test_cli_reference_shows_every_verb():
    page = _load("cli_reference").page_markdown()
    verbs = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for verb in verbs:
        assert f"scaleout {verb}" in page
