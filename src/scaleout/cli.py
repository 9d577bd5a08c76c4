"""The `scaleout` command: parse, validate, build, run, clean up.

    scaleout train CONFIG [--out DIR] [--resume] [--overwrite] [--set key=value ...]
    scaleout scale RUN_DIR --replicas N
    scaleout info CONFIG [--set key=value ...]
    scaleout report RUN_DIR
    scaleout calibrate [CONFIG ...] [--out FILE] [--set key=value ...]
    scaleout simulate CONFIG [--machines 1,2,...] [--link 1gbit] [--sweep key=v1,v2] ...

A user error (bad config, missing data, corrupted checkpoint) prints one line per problem
and exits with status 2; Ctrl-C during training saves a checkpoint and exits with 130, SIGTERM
the same within `run.stop_grace_s` with 143.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scaleout import __version__
from scaleout.errors import UserError
from scaleout.interrupt import Terminated, exit_status

# Tables keep their rows on one line in logs and pipes, where rich would assume 80 columns.
out = Console(soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True, highlight=False)

DEMO_CONFIG = Path("configs/mnist_downpour.toml")
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = exit_status(signal.SIGINT)  # 130


def _train(args: argparse.Namespace) -> int:
    import json

    from scaleout.api import fit

    overrides = list(args.set)
    if args.out is not None:
        overrides.append(f"run.out_dir={json.dumps(str(args.out))}")
    if args.address is not None:
        overrides.append(f"run.address={json.dumps(args.address)}")
    result = fit(args.config, overrides=overrides, resume=args.resume, overwrite=args.overwrite)
    assert result.run_dir is not None
    _print_summary(result.summary, result.run_dir)
    return exit_status(result.stopped_by) if result.stopped_by is not None else 0


def _scale(args: argparse.Namespace) -> int:
    from scaleout.strategies.downpour.scaling import request_scale

    request_scale(args.run_dir, args.replicas)
    out.print(
        f"asked the run in {args.run_dir} to go on with {args.replicas} replicas; its "
        "console and metrics.jsonl say when each joins or leaves"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from scaleout.api import load_config
    from scaleout.info import describe_model, human

    config = load_config(args.config, args.set)
    info = describe_model(config)
    table = Table(title=f"{config.run.name}: model {info.kind}, input {info.input_shape}")
    for column in ("layer", "type", "shapes", "parameters", "forward FLOPs / example"):
        table.add_column(column, justify="right" if column[0] in "pf" else "left")
    for layer in info.layers:
        shapes = ", ".join("x".join(map(str, s)) for s in layer.shapes)
        table.add_row(layer.name, layer.kind, shapes, f"{layer.params:,}", f"{layer.flops:,}")
    table.add_section()
    table.add_row("total", "", "", f"{info.params:,}", f"{info.forward_flops:,}")
    out.print(table)
    out.print(f"parameters: {info.params:,} ({human(info.params)})")
    for name, size in info.memory.items():
        out.print(f"memory for {name}: {human(size, 'B')}")
    out.print(
        f"memory for training ({config.train.optimizer}, fp32): "
        f"{human(sum(info.memory.values()), 'B')}"
    )
    out.print(
        f"FLOPs per example: forward {human(info.forward_flops)}, "
        f"training ~{human(info.train_flops)} (3x forward)"
    )
    for note in info.notes:
        out.print(note)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from scaleout.reports import selectivity_report

    report = selectivity_report(args.run_dir)
    out.print_json(json.dumps(report, default=str))
    return 0


def _report(args: argparse.Namespace) -> int:
    from scaleout.rundir import RunDir

    run = RunDir(args.run_dir)
    if not run.metrics.is_file():
        raise UserError(f"{args.run_dir}: no {run.metrics.name} here; give a run directory")
    _print_summary(run.finish(), run.path)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from scaleout.api import load_config
    from scaleout.sim.calibrate import calibrate

    configs = [load_config(path, list(args.set)) for path in args.configs or [DEMO_CONFIG]]
    calibration = calibrate(configs, say=lambda line: err.print(f"measuring {line}"))
    path = calibration.save(args.out)
    out.print(f"wrote {path}")
    if "contended" in calibration.notes:
        err.print(f"warning: {calibration.notes['contended']}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from scaleout.sim.simulate import Request, parse_machines, simulate, write

    request = Request(
        config=args.config,
        machines=parse_machines(args.machines),
        link=args.link,
        latency_s=args.latency,
        cores_per_machine=args.cores_per_machine,
        calibration=args.calibration,
        hardware=args.hardware,
        sweep=list(args.sweep),
        overrides=list(args.set),
        steps=args.steps,
        one_box=args.one_box,
    )
    rows = simulate(request, progress=lambda line: err.print(f"simulating {line}"))
    keys = [item.partition("=")[0] for item in request.sweep]
    table = Table(title=f"simulate {args.config} over {args.link}")
    columns = [*keys, "machines", "examples/s", "steady", "step ms", "bottleneck", "utilisation"]
    for column in [*columns, "wire MB", "staleness"]:
        left = column in ("bottleneck", "utilisation")
        table.add_column(column, justify="left" if left else "right")
    for row in rows:
        busy = ", ".join(f"{k} {100 * v:.0f}%" for k, v in row["utilisation"].items())
        stale = row.get("staleness_mean")
        table.add_row(
            *(str(row[k]) for k in keys),
            str(row["machines"]),
            f"{row['examples_per_s']:,.0f}",
            "" if row["steady_examples_per_s"] is None else f"{row['steady_examples_per_s']:,.0f}",
            f"{1000 * row['step_s']:.2f}",
            row["bottleneck"],
            busy,
            f"{row['wire_bytes'] / 1e6:,.0f}",
            "" if stale is None else f"{stale:.2f} (max {row['staleness_max']})",
        )
    out.print(table)
    json_path, png_path = write(rows, request, args.out)
    out.print(f"wrote {json_path} and {png_path}")
    return 0


def _print_summary(summary: dict, run_dir: Path) -> None:
    table = Table(title=f"run {run_dir}", show_header=False)
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{100 * value:.2f}%" if "accuracy" in key else f"{value:,.4g}"
        table.add_row(key.replace("_", " "), str(value))
    out.print(table)
    for name in ("metrics.jsonl", "metrics.png", "checkpoints"):
        if (run_dir / name).exists():
            out.print(f"  {run_dir / name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scaleout", description="Train deep networks across many workers."
    )
    parser.add_argument("--version", action="version", version=f"scaleout {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    train = verbs.add_parser("train", help="train a run from a TOML config")
    train.add_argument("config", type=Path, help="run config (TOML)")
    train.add_argument("--out", type=Path, help="parent directory of the run (run.out_dir)")
    train.add_argument("--address", help="Ray cluster to join: auto or host:port (run.address)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    train.add_argument(
        "--overwrite", action="store_true", help="start again in a run directory that holds a run"
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.lr=0.01 (repeatable)",
    )
    train.set_defaults(handler=_train)

    scale = verbs.add_parser("scale", help="change a running Downpour run's replica count")
    scale.add_argument("run_dir", type=Path, help="the run's directory, e.g. runs/mnist_downpour")
    scale.add_argument(
        "--replicas", type=int, required=True, help="how many replicas it goes on with"
    )
    scale.set_defaults(handler=_scale)

    info = verbs.add_parser("info", help="parameters, memory and FLOPs of a config's model")
    info.add_argument("config", type=Path, help="run config (TOML)")
    info.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value (repeatable)",
    )
    info.set_defaults(handler=_info)

    report = verbs.add_parser("report", help="re-draw a run's plot and print its summary")
    report.add_argument("run_dir", type=Path, help="a run directory, e.g. runs/mnist_single")
    report.set_defaults(handler=_report)

    evaluate = verbs.add_parser("eval", help="evaluate a trained run")
    evaluate.add_argument(
        "what",
        choices=["selectivity"],
        help="selectivity: best single-neuron face detector (Le et al. 2012)",
    )
    evaluate.add_argument("run_dir", type=Path, help="a sparse_autoencoder run directory")
    evaluate.set_defaults(handler=_eval)

    calibrate = verbs.add_parser(
        "calibrate", help="measure this machine's costs for `scaleout simulate`"
    )
    calibrate.add_argument(
        "configs", nargs="*", type=Path, help=f"configs whose models to time ({DEMO_CONFIG})"
    )
    calibrate.add_argument(
        "--out", type=Path, default=Path("results/calibration.json"), help="where to write it"
    )
    calibrate.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="as `scaleout train`, for every config (e.g. model.sizes=[784,256,10])",
    )
    calibrate.set_defaults(handler=_calibrate)

    simulate = verbs.add_parser(
        "simulate", help="predict a config's speed on 1..1000 machines (calibrated simulation)"
    )
    simulate.add_argument("config", type=Path, help="run config (TOML)")
    simulate.add_argument("--machines", default="1", help="machine counts, e.g. 1,2,4,8")
    simulate.add_argument(
        "--link",
        default="1gbit",
        help="100mbit, 1gbit, 10gbit, ib56, a rate (250mbit), or calibrated (the link "
        "stored in the calibration file)",
    )
    simulate.add_argument("--latency", type=float, help="one-way link latency in seconds")
    simulate.add_argument("--cores-per-machine", type=float, help="default: this machine's")
    simulate.add_argument(
        "--calibration",
        type=Path,
        default=Path("results/calibration.json"),
        help="from `scaleout calibrate` (default results/calibration.json)",
    )
    simulate.add_argument("--hardware", type=Path, help="another machine's calibration file")
    simulate.add_argument(
        "--sweep", action="append", default=[], metavar="KEY=V1,V2", help="repeatable"
    )
    simulate.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="as `scaleout train`"
    )
    simulate.add_argument("--steps", type=int, help="steps to simulate (default: the run's)")
    simulate.add_argument(
        "--one-box",
        action="store_true",
        help="the machines are testnet hosts of one machine: own links, its cores shared",
    )
    simulate.add_argument(
        "--out", type=Path, default=Path("results/sim"), help="writes simulate.json and .png"
    )
    simulate.set_defaults(handler=_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UserError as error:
        for line in str(error).splitlines():
            err.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERRUPTED
    except Terminated as stop:
        err.print(str(stop))
        return exit_status(signal.SIGTERM)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
