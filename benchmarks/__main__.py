"""`python -m benchmarks`: run one suite, list them, or calibrate across testnet hosts.

    python -m benchmarks SUITE [--out DIR]      # writes DIR/<suite>.json and .png
    python -m benchmarks --list
    python -m benchmarks --calibrate-testnet RATE [CONFIG ...] [--out FILE]

Run from the repository root (suites read `configs/` and write `results/`). A user error
prints one line and exits with 2, as the `scaleout` command does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scaleout.errors import UserError

out = Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True, highlight=False)
DEMO_CONFIG = Path("configs/mnist_downpour.toml")


def run(suite: str, out_dir: Path) -> int:
    """Run `suite`, print its rows beside the papers' and targets, write its files."""
    from benchmarks import run_suite

    document, json_path, png_path = run_suite(suite, out_dir)
    table = Table(title=f"bench {suite}")
    for column in ("figure", "ours", "unit", "paper", "target", "meets"):
        table.add_column(column, justify="left" if column in ("figure", "unit") else "right")
    for row in document["rows"]:
        better = "<=" if row["better"] == "lower" else ">="
        table.add_row(
            row["name"],
            f"{row['value']:.4g}",
            row["unit"],
            "" if row["paper"] is None else f"{row['paper']:.4g}",
            "" if row["target"] is None else f"{better} {row['target']:.4g}",
            {True: "[green]yes", False: "[red]no", None: ""}[row["meets"]],
        )
    out.print(table)
    for note in document["notes"]:
        out.print(f"note: {note}")
    if document["contended"]:
        err.print(f"warning: {document['notes'][0]}")
    out.print(f"wrote {json_path} and {png_path}")
    return 0


def calibrate_testnet(rate: str, configs: list[Path], sets: list[str], out_file: Path) -> int:
    """`scaleout calibrate` plus a link measured between two testnet hosts at `rate`."""
    from benchmarks.testnet import measure_network
    from scaleout.api import load_config
    from scaleout.sim.calibrate import calibrate
    from scaleout.sim.measure_calls import shard_message_sizes

    loaded = [load_config(path, sets) for path in configs or [DEMO_CONFIG]]
    calibration = calibrate(loaded, say=lambda line: err.print(f"measuring {line}"))
    err.print(f"measuring a link and shard calls across two testnet hosts at {rate}")
    sizes = shard_message_sizes(loaded, calibration.models)
    network = measure_network(rate, calibration.apply_ns["sgd"], sizes)
    calibration = calibration.model_copy(update=network)
    calibration.notes["link"] = f"two testnet hosts at {rate}"
    path = calibration.save(out_file)
    out.print(f"wrote {path}")
    if "contended" in calibration.notes:
        err.print(f"warning: {calibration.notes['contended']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="Benchmark suites, side by side in one run."
    )
    parser.add_argument("suite", nargs="?", help="suite name; --list shows them")
    parser.add_argument("--list", action="store_true", help="list the suites")
    parser.add_argument(
        "--out",
        type=Path,
        help="a suite: where to write <suite>.json and .png (default results); "
        "--calibrate-testnet: the calibration file (default results/calibration.json)",
    )
    parser.add_argument(
        "--calibrate-testnet",
        metavar="RATE",
        help="`scaleout calibrate` plus a link between two testnet hosts at RATE (1gbit), "
        "which `scaleout simulate --link calibrated` uses (needs root); the positional "
        "arguments are then configs",
    )
    parser.add_argument("configs", nargs="*", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --calibrate-testnet"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.calibrate_testnet:
            configs = [Path(args.suite), *args.configs] if args.suite else args.configs
            out_file = args.out or Path("results/calibration.json")
            return calibrate_testnet(args.calibrate_testnet, configs, args.set, out_file)
        if args.configs:
            extra = " ".join(map(str, args.configs))
            raise UserError(f"one suite at a time; got {args.suite} {extra}")
        if args.list or args.suite is None:
            from benchmarks import available_suites

            for suite in available_suites().values():
                out.print(f"{suite.name:16} {suite.description}")
            return 0
        return run(args.suite, args.out or Path("results"))
    except UserError as error:
        for line in str(error).splitlines():
            err.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
