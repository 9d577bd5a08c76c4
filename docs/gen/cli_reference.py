"""The command-line reference, generated from the `scaleout` parser at build time.

`scaleout.cli.build_parser()` builds the argparse parser the `scaleout` command runs; this
script writes `reference/cli.md` with the help of the command and of each subcommand, as
`scaleout VERB --help` prints it (80 columns wide, whatever the terminal).
"""

from __future__ import annotations

import argparse
import os

PAGE = "reference/cli.md"
WIDTH = "80"

INTRO = """# Command line

`scaleout` is installed with the package (`pip install -e .`; `make demo` and `make test`
do it in `.venv`). Each subcommand below is a thin shell over the Python API: `scaleout
train CONFIG` is `scaleout.fit(CONFIG, overrides=...)`. Bad input (a malformed file, an
unknown key, a value out of range, a bad factory) prints one line per problem and exits
with status 2; Ctrl-C during training saves a checkpoint and exits with status 130, and
SIGTERM the same within `run.stop_grace_s` seconds with status 143.

Benchmarks are not a subcommand: they live in `benchmarks/` at the repository root and run
as `python -m benchmarks SUITE` (see [Run the benchmarks](../how-to/benchmarks.md)).

This page is generated from the parser itself when the site is built
(`docs/gen/cli_reference.py`).

"""


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{verb: its parser}, in the order the parser lists them."""
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def page_markdown() -> str:
    from scaleout.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse wraps to the terminal's width
    try:
        parser = build_parser()
        parts = [INTRO, "## scaleout\n", "```text", parser.format_help().rstrip(), "```\n"]
        for verb, sub in subcommands(parser).items():
            parts += [f"## scaleout {verb}\n", "```text", sub.format_help().rstrip(), "```\n"]
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts)


def write_page() -> None:
    import mkdocs_gen_files

    with mkdocs_gen_files.open(PAGE, "w") as out:
        out.write(page_markdown())
    mkdocs_gen_files.set_edit_path(PAGE, "gen/cli_reference.py")


if __name__ in ("__main__", "<run_path>"):
    write_page()
