"""`python -m scaleout` is the `scaleout` command."""

from scaleout.cli import entry

entry()
