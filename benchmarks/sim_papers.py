"""`python -m benchmarks sim_papers`: the papers' scaling figures, predicted by the simulator from
their hardware (`configs/hardware/*.json`) and our configs of their models, beside the
numbers their text quotes. Only simulation runs (about a minute).

- COTS HPC: "a single mini-batch update (mini-batch size of 96 images) for the 3rd stack
  of [the 11 billion parameter] network takes less than 0.6 seconds" on 64 GTX 680s
  (16 servers of 4, FDR InfiniBand): `autoencoder_11b.toml` (13.2B parameters with our
  border rules) on an 8 x 8 grid; and the shape of figures 5/6 (time per minibatch against
  GPUs for the 1.8B and 11B networks; the figures' values are not in the text).
- DistBelief figure 3: the 1.7B-parameter locally connected model gains "more than 12x
  using 81 machines": `autoencoder_1.8b.toml` (1.54B) on 1 to 81 16-core machines over
  1 Gbit Ethernet, one partition per machine. The speech model's 2.2x at 8 machines is a
  fully connected network, which `scaleout.parallel` does not partition: not simulated.
- Dettmers: "for messages which are larger than 250k parameters per layer, a 2x speedup
  in transfer speed" with 8-bit (dynamic tree) over 32-bit between two GPUs on PCIe 3.0
  x8 (~8 GB/s): compress + transfer + decompress (`scaleout.sim.wire`).
- Ding et al.'s table 1: AlexNet (`alexnet_sync.toml`, weights and momentum averaged after
  every step) on one or two Titan Blacks, with and without parallel loading, seconds per
  20 iterations of 256. The hardware file's compute and loading costs are fitted to the
  two 1-GPU columns (cuda-convnet), so the 2-GPU columns and the speed-ups are predictions.

Rows hold the quoted figure beside the prediction; where the paper quotes a bound, the
row's target is the bound, and the notes say which costs the paper's text leaves open
(each hardware file's `notes`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks import Row, SuiteResult, register_suite
from benchmarks.papers import DING_TABLE_1

HARDWARE = Path(__file__).resolve().parents[1] / "configs" / "hardware"
CONFIGS = HARDWARE.parent
COTS_GPUS = (1, 4, 16, 36, 64)  # square grids; 4 GPUs per server
DISTBELIEF_MACHINES = (1, 4, 9, 16, 36, 81)
DETTMERS_SIZES = (10_000, 100_000, 250_000, 1_000_000, 4_000_000, 16_000_000)
QUOTED = {"cots_stack3_s": 0.6, "distbelief_81x": 12.0, "dettmers_8bit_x": 2.0}
DING_ITERATIONS = 20
WITHIN = 25.0  # per cent


def _grid_run(config: str, grid: int, machines: int, hardware: str, link: str, *more: str) -> dict:
    from scaleout.api import load_config
    from scaleout.sim.calibration import Calibration
    from scaleout.sim.engine import Link
    from scaleout.sim.model_parallel import ModelParallelSim
    from scaleout.sim.setting import Setting, parse_link

    overrides = [
        'train.strategy="model_parallel"',
        f"model_parallel.grid=[{grid},{grid}]",
        *more,
    ]
    cfg = load_config(CONFIGS / config, overrides)
    setting = Setting(
        Calibration.load(HARDWARE / hardware),
        machines=machines,
        link=Link(*parse_link(link)),
        steps=1,
    )
    return ModelParallelSim(cfg, setting).run().row()


def cots() -> dict[str, list[Any]]:
    """Seconds per minibatch of each stack, per GPU count, for the 1.8B and 11B networks."""
    out: dict[str, list[Any]] = {}
    for name in ("autoencoder_1.8b.toml", "autoencoder_11b.toml"):
        rows = []
        for gpus in COTS_GPUS:
            side = math.isqrt(gpus)
            row = _grid_run(name, side, max(1, gpus // 4), "cots_hpc.json", "ib56")
            rows.append((gpus, row["stack_step_s"], row["bottleneck"]))
        out[name] = rows
    return out


def distbelief() -> list[tuple[int, float, str]]:
    """(machines, seconds per minibatch averaged over the stacks, bottleneck)."""
    rows = []
    for machines in DISTBELIEF_MACHINES:
        side = math.isqrt(machines)
        row = _grid_run(
            "autoencoder_1.8b.toml",
            side,
            machines,
            "distbelief.json",
            "1gbit",
            "run.num_threads=16",
        )
        rows.append((machines, row["step_s"], row["bottleneck"]))
    return rows


def dettmers() -> list[tuple[int, float, float]]:
    """(values, fp32 seconds, 8-bit seconds) of one message between the two GPUs."""
    from scaleout.sim.calibration import Calibration
    from scaleout.sim.engine import Link
    from scaleout.sim.wire import transfer_s

    cal = Calibration.load(HARDWARE / "dettmers_pcie.json")
    assert cal.link is not None
    link = Link(cal.link.bytes_per_s, cal.link.latency_s)
    return [
        (n, transfer_s(cal, link, n), transfer_s(cal, link, n, "dynamic8")) for n in DETTMERS_SIZES
    ]


def ding() -> dict[tuple[int, bool], float]:
    """Seconds per 20 iterations of 256 by (GPUs, parallel loading): one GPU is one
    machine of the hardware file, two are two joined by its PCIe link."""
    from scaleout.api import load_config
    from scaleout.sim.calibration import Calibration
    from scaleout.sim.engine import Link
    from scaleout.sim.setting import Setting
    from scaleout.sim.sync import SyncSim

    cal = Calibration.load(HARDWARE / "ding_titan.json")
    assert cal.link is not None
    link = Link(cal.link.bytes_per_s, cal.link.latency_s)

    def training_s(cfg: Any, gpus: int, steps: int) -> float:  # noqa: ANN401
        result = SyncSim(cfg, Setting(cal, machines=gpus, link=link, steps=steps)).run()
        assert result.steady_examples_per_s is not None
        return steps * cfg.train.batch_size / result.steady_examples_per_s

    out = {}
    for gpus, loading in DING_TABLE_1:
        overrides = [f"sync.num_workers={gpus}", f"loader.workers={int(loading)}"]
        cfg = load_config(CONFIGS / "alexnet_sync.toml", overrides)
        # 20 iterations after 20 others: without the first batch's load, which no
        # training hides
        twice = training_s(cfg, gpus, 2 * DING_ITERATIONS)
        out[(gpus, loading)] = twice - training_s(cfg, gpus, DING_ITERATIONS)
    return out


def _ding_ratios(table: dict[tuple[int, bool], float]) -> dict[str, float]:
    """The table's speed-ups that the 1-GPU fit does not fix."""
    return {
        "2 GPUs vs 1, parallel loading": table[(1, True)] / table[(2, True)],
        "2 GPUs vs 1, no parallel loading": table[(1, False)] / table[(2, False)],
        "parallel loading on 2 GPUs": table[(2, False)] / table[(2, True)],
    }


def _plot(cots_rows: dict, db_rows: list, dt_rows: list, ding_rows: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(12, 8.6))
    axes = grid.ravel()
    ax = axes[0]
    for name, rows in cots_rows.items():
        gpus = [g for g, _, _ in rows]
        ax.plot(gpus, [s[-1] for _, s, _ in rows], marker="o", label=f"{name}: stack 3")
    ax.axhline(QUOTED["cots_stack3_s"], color="k", ls="--", label="paper: 11B stack 3 < 0.6 s")
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="s per minibatch of 96")
    ax.set_title("COTS HPC (fig. 5's axes), predicted")
    ax.legend(fontsize=7)
    ax = axes[1]
    base = db_rows[0][1]
    ax.plot(
        [m for m, _, _ in db_rows],
        [base / s for _, s, _ in db_rows],
        marker="o",
        label="1.54B LC model, predicted",
    )
    ax.plot([81], [QUOTED["distbelief_81x"]], "k*", ms=12, label="paper: > 12x at 81")
    ax.set(xlabel="machines", ylabel="speed-up over 1 machine")
    ax.set_title("DistBelief figure 3")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot(
        [n for n, _, _ in dt_rows],
        [a / b for _, a, b in dt_rows],
        marker="o",
        label="8-bit vs fp32, predicted",
    )
    ax.axhline(QUOTED["dettmers_8bit_x"], color="k", ls="--", label="paper: ~2x above 250k")
    ax.axvline(250_000, color="grey", ls=":")
    ax.set(xscale="log", xlabel="values per message", ylabel="transfer speed-up")
    ax.set_title("Dettmers: PCIe 3.0 x8")
    ax.legend(fontsize=7)
    ax = axes[3]
    cells = list(DING_TABLE_1)
    xs = range(len(cells))
    ax.bar([x - 0.2 for x in xs], [DING_TABLE_1[c] for c in cells], 0.4, label="paper")
    ax.bar([x + 0.2 for x in xs], [ding_rows[c] for c in cells], 0.4, label="predicted")
    labels = [f"{g} GPU{'s' if g > 1 else ''}, {'' if p else 'no '}par. loading" for g, p in cells]
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="s per 20 iterations of 256")
    ax.set_title("Ding et al. table 1 (1-GPU columns fitted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@register_suite("sim_papers", "the papers' scaling figures, predicted from their hardware")
def run() -> SuiteResult:
    cots_rows, db_rows, dt_rows, ding_rows = cots(), distbelief(), dettmers(), ding()
    rows: list[Row] = []
    stack3 = cots_rows["autoencoder_11b.toml"][-1][1][-1]
    rows.append(
        Row(
            f"COTS HPC 11B (ours 13.2B) stack 3, 96 images, 64 GPUs: {stack3:.3f} s predicted, "
            "paper < 0.6 s (a bound)",
            stack3,
            "s",
            "lower",
            paper=QUOTED["cots_stack3_s"],
            target=QUOTED["cots_stack3_s"],
        )
    )
    speedup = db_rows[0][1] / db_rows[-1][1]
    rows.append(
        Row(
            f"DistBelief 1.7B LC model (ours 1.54B) at 81 machines: {speedup:.1f}x predicted, "
            "paper > 12x (a bound)",
            speedup,
            "x",
            "higher",
            paper=QUOTED["distbelief_81x"],
            target=QUOTED["distbelief_81x"],
        )
    )
    for n, raw, coded in dt_rows:
        if n < 250_000:
            continue
        ratio = raw / coded
        error = 100 * (ratio / QUOTED["dettmers_8bit_x"] - 1)
        rows.append(
            Row(
                f"Dettmers 8-bit transfer at {n:,} values: {ratio:.2f}x predicted vs ~2x, "
                f"error {error:+.0f}%",
                abs(error),
                "% error",
                "lower",
                target=WITHIN,
            )
        )
    predicted = _ding_ratios(ding_rows)
    for name, paper in _ding_ratios(DING_TABLE_1).items():
        error = 100 * (predicted[name] / paper - 1)
        rows.append(
            Row(
                f"Ding table 1, {name}: {predicted[name]:.2f}x predicted vs {paper:.2f}x, "
                f"error {error:+.0f}%",
                abs(error),
                "% error",
                "lower",
                target=WITHIN,
            )
        )
    notes = [
        "Ding et al. table 1, s per 20 iterations predicted vs paper: "
        + ", ".join(
            f"{g} GPU(s) {'with' if p else 'without'} parallel loading {ding_rows[(g, p)]:.2f}"
            f" vs {DING_TABLE_1[(g, p)]:.2f}"
            for g, p in DING_TABLE_1
        ),
        "Ding et al.: the table's 2-GPU columns imply 0.35 s per iteration for exchanging "
        "and averaging weights and momentum (1.1695 - 0.819 s with parallel loading, "
        "1.446 - 1.088 s without: half of the 1-GPU step, and the loading); the hardware "
        "file prices it at PCIe 3.0 x16's 12 GB/s, about 0.05 s. The paper does not give "
        "the exchange's cost; with it pinned at 0.35 s both 2-GPU columns would be within 1%.",
        "COTS HPC, s per minibatch of 96 by stack, predicted: "
        + "; ".join(
            f"{name} at {g} GPUs: {', '.join(f'{s:.3f}' for s in stacks)} ({b})"
            for name, rows_ in cots_rows.items()
            for g, stacks, b in rows_
        ),
        "DistBelief 1.54B, s per minibatch (mean of the stacks) by machines: "
        + ", ".join(f"{m}: {s:.3f} ({b})" for m, s, b in db_rows),
        "Dettmers, us per message fp32 / 8-bit: "
        + ", ".join(f"{n:,}: {a * 1e6:.0f} / {b * 1e6:.0f}" for n, a, b in dt_rows),
        "Not simulated: DistBelief's speech model (2.2x at 8 machines) is fully connected, "
        "and scaleout.parallel partitions locally connected networks only.",
        "What the papers leave open is in each configs/hardware/*.json's notes.",
    ]
    return SuiteResult(
        rows, plot=lambda out: _plot(cots_rows, db_rows, dt_rows, ding_rows, out), notes=notes
    )
