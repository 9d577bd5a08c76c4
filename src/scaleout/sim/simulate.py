"""`scaleout simulate CONFIG`: one simulated run per (machines, swept values), as rows.

    scaleout simulate configs/mnist_downpour.toml --machines 1,10,100,1000 \\
        --sweep downpour.num_shards=1,4,16,64 --link 1gbit --out results/sim

Each row is a `Result` with the swept keys beside it; `DIR/simulate.json` holds them all and
`DIR/simulate.png` plots examples/s against machines, one line per swept setting.
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaleout.errors import ConfigError
from scaleout.sim.calibration import DEFAULT_CALIBRATION, Calibration
from scaleout.sim.engine import Link
from scaleout.sim.result import Result
from scaleout.sim.setting import Setting, parse_link

# strategy -> "module:class" of its simulation (each takes (config, setting), runs to a Result)
SIMULATIONS = {
    "downpour": "scaleout.sim.downpour:DownpourSim",
    "sync": "scaleout.sim.sync:SyncSim",
    "sandblaster": "scaleout.sim.sandblaster:SandblasterSim",
    "model_parallel": "scaleout.sim.model_parallel:ModelParallelSim",
}


@dataclass
class Request:
    """What `scaleout simulate` was asked (the CLI's arguments, validated)."""

    config: Path
    machines: list[int] = field(default_factory=lambda: [1])
    link: str = "1gbit"
    latency_s: float | None = None
    cores_per_machine: float | None = None
    calibration: Path = DEFAULT_CALIBRATION
    hardware: Path | None = None  # another machine's calibration: replaces `calibration`
    sweep: list[str] = field(default_factory=list)  # "key=v1,v2"
    overrides: list[str] = field(default_factory=list)  # "key=value", as `scaleout train`
    steps: int | None = None
    one_box: bool = False  # the machines are testnet hosts of one machine, sharing its cores


def parse_machines(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"--machines {text!r}: give whole numbers >= 1, e.g. 1,2,4")
    return values


def parse_sweep(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`key=v1,v2` -> (key, [v1, v2]) per item."""
    out = []
    for item in items:
        key, sep, values = item.partition("=")
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not choices:
            raise ConfigError(f"--sweep {item!r}: give key=v1,v2,... e.g. downpour.num_shards=1,4")
        out.append((key.strip(), choices))
    return out


def simulation_for(strategy: str, pipelined: bool = False) -> Callable[..., Any]:
    """The simulation of `strategy`; of pipeline stages when `pipelined` (under
    "model_parallel" and "sync")."""
    if pipelined and strategy in ("model_parallel", "sync"):
        from scaleout.sim.pipeline import PipelineSim

        return PipelineSim
    if pipelined:
        raise ConfigError(
            f'train.strategy = "{strategy}" with model_parallel.stages has no simulation yet: '
            'simulate the pipeline under "model_parallel" or "sync", or 1 stage'
        )
    if strategy not in SIMULATIONS:
        raise ConfigError(
            f"train.strategy = {strategy!r} has no simulation yet: simulate one of "
            f"{', '.join(SIMULATIONS)}"
        )
    module, _, name = SIMULATIONS[strategy].partition(":")
    return getattr(importlib.import_module(module), name)


def link_of(text: str, calibration: Calibration) -> tuple[float, float]:
    """`--link`: a named link or rate, or "calibrated" (the calibration's measured link)."""
    if text.strip().lower() != "calibrated":
        return parse_link(text)
    if calibration.link is None:
        raise ConfigError(
            "--link calibrated: this calibration measured no link; run `scaleout calibrate "
            "--testnet 1gbit` (root), or give --link 1gbit"
        )
    return calibration.link.bytes_per_s, calibration.link.latency_s


def simulate(
    request: Request, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Every (swept setting, machines) of the request, as JSON rows."""
    from scaleout.api import load_config

    calibration = Calibration.load(request.hardware or request.calibration)
    bandwidth, latency = link_of(request.link, calibration)
    link = Link(bandwidth, request.latency_s if request.latency_s is not None else latency)
    sweep = parse_sweep(request.sweep)
    keys = [key for key, _ in sweep]
    rows = []
    for values in itertools.product(*(choices for _, choices in sweep)):
        swept = [f"{k}={v}" for k, v in zip(keys, values, strict=True)]
        config = load_config(request.config, [*request.overrides, *swept])
        simulation = simulation_for(config.train.strategy, config.model_parallel.stages > 1)
        for machines in request.machines:
            if progress is not None:
                progress(f"{' '.join(swept) or 'as configured'}: {machines} machines")
            setting = Setting(
                calibration,
                machines=machines,
                cores=request.cores_per_machine,
                link=link,
                steps=request.steps,
                one_box=request.one_box,
            )
            result: Result = simulation(config, setting).run()
            row = {**dict(zip(keys, values, strict=True)), **result.row()}
            row["link"] = request.link
            rows.append(row)
    return rows


def write(rows: list[dict[str, Any]], request: Request, out: Path) -> tuple[Path, Path]:
    """`out/simulate.json` and `out/simulate.png` (examples/s against machines)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "simulate.json"
    document = {
        "config": str(request.config),
        "link": request.link,
        "calibration": str(request.hardware or request.calibration),
        "sweep": request.sweep,
        "overrides": request.overrides,
        "rows": rows,
    }
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2, default=str))
    tmp.replace(json_path)
    return json_path, plot(rows, [k for k, _ in parse_sweep(request.sweep)], out)


def plot(rows: list[dict[str, Any]], keys: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        label = ", ".join(f"{k.split('.')[-1]}={row[k]}" for k in keys) or "as configured"
        groups.setdefault(label, []).append(row)
    for label, group in groups.items():
        group.sort(key=lambda r: r["machines"])
        ax.plot(
            [r["machines"] for r in group],
            [r["steady_examples_per_s"] or r["examples_per_s"] for r in group],
            marker="o",
            label=label,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("machines")
    ax.set_ylabel("examples/s, steady (simulated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "simulate.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
