"""Suite `codecs_errors`: the 8-bit paper's Table 1 (approximation error of the data types).

25M samples (fixed seed) of U(0,1), N(0,1), N(0,10^2) and N(0,0.2^2), passed through every
8-bit codec with the 2015 kernel's rounding ("paper") and with round-to-nearest; mean
squared error, mean absolute error and mean relative error (over x != 0) beside the paper.
The paper's "mean absolute error" column is numerically the mean squared error (notes
section 5), so it is quoted beside our MSE. Dynamic tree and linear types are normalised
by the sample's absmax; the static types use exponent offset 10^1, 10^2 for N(0,10^2), as
the paper's caption says.

Targets: with "paper" rounding every cell within 10% of the paper (deviation rows); with
"nearest" every cell at or below the paper's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from benchmarks import Row, SuiteResult, register_suite
from scaleout.compress import get

NUM_SAMPLES = int(os.environ.get("SCALEOUT_BENCH_CODECS_SAMPLES", 25_000_000))
DISTRIBUTIONS = {  # name -> (sampler, exponent offset for the static types)
    "U(0,1)": (lambda n, g: torch.rand(n, generator=g), 1),
    "N(0,1)": (lambda n, g: torch.randn(n, generator=g), 1),
    "N(0,10^2)": (lambda n, g: 10 * torch.randn(n, generator=g), 2),
    "N(0,0.2^2)": (lambda n, g: 0.2 * torch.randn(n, generator=g), 1),
}
# Paper Table 1: (data type, distribution) -> ("mean absolute error" = MSE, relative error %).
PAPER = {
    ("dynamic8", "U(0,1)"): (0.00004, 1.39),
    ("linear8", "U(0,1)"): (0.0024, 2.16),
    ("mantissa8", "U(0,1)"): (0.0017, 7.22),
    ("static8", "U(0,1)"): (0.0007, 4.82),
    ("dynamic8", "N(0,1)"): (0.0005, 2.46),
    ("linear8", "N(0,1)"): (0.0004, 6.47),
    ("mantissa8", "N(0,1)"): (0.0104, 6.89),
    ("static8", "N(0,1)"): (0.0093, 6.3),
    ("dynamic8", "N(0,10^2)"): (0.049, 2.49),
    ("linear8", "N(0,10^2)"): (0.041, 6.44),
    ("mantissa8", "N(0,10^2)"): (1.066, 7.19),
    ("static8", "N(0,10^2)"): (0.926, 6.28),
    ("dynamic8", "N(0,0.2^2)"): (0.000018, 2.45),
    ("linear8", "N(0,0.2^2)"): (0.000015, 6.15),
    ("mantissa8", "N(0,0.2^2)"): (0.00055, 8.26),
    ("static8", "N(0,0.2^2)"): (0.00022, 6.58),
}
CODECS = [  # (codec, rounding)
    *[(name, rounding) for name in ("dynamic8", "linear8", "mantissa8", "static8")
      for rounding in ("paper", "nearest")],
    ("dynamic8_bnb", "nearest"),
]  # fmt: skip


def errors(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """(MSE, MAE, mean relative error in % over x != 0), accumulated in float64 chunks."""
    sq = ab = rel = 0.0
    nonzero = 0
    for xs, ys in zip(x.split(1 << 22), y.split(1 << 22), strict=True):
        d = xs.double() - ys.double()
        sq += float((d * d).sum())
        ab += float(d.abs().sum())
        mask = xs != 0
        rel += float((d.abs()[mask] / xs.double().abs()[mask]).sum())
        nonzero += int(mask.sum())
    return sq / x.numel(), ab / x.numel(), 100 * rel / max(nonzero, 1)


def measure() -> dict[tuple[str, str, str], tuple[float, float, float]]:
    """(codec, rounding, distribution) -> (MSE, MAE, MRE %)."""
    results = {}
    for index, (dist, (sample, offset)) in enumerate(DISTRIBUTIONS.items()):
        x = sample(NUM_SAMPLES, torch.Generator().manual_seed(1000 + index))
        for name, rounding in CODECS:
            options = {"exponent_offset": offset} if name in ("static8", "mantissa8") else {}
            if name != "dynamic8_bnb":
                options["rounding"] = rounding
            y = get(name, **options).roundtrip(x)
            results[name, rounding, dist] = errors(x, y)
    return results


def rows(results: dict) -> list[Row]:
    out = []
    for (name, rounding, dist), (mse, mae, mre) in results.items():
        paper_mse, paper_mre = PAPER.get((name, dist), (None, None))
        nearest = rounding == "nearest" and paper_mse is not None
        label = f"error {name} {rounding} {dist}"
        out.append(
            Row(f"{label} MSE", mse, "MSE", "lower", paper_mse, paper_mse if nearest else None)
        )
        out.append(Row(f"{label} MAE", mae, "MAE", "lower"))
        out.append(
            Row(f"{label} MRE", mre, "%", "lower", paper_mre, paper_mre if nearest else None)
        )
        if rounding == "paper":
            for metric, ours, theirs in (("MSE", mse, paper_mse), ("MRE", mre, paper_mre)):
                deviation = 100 * abs(ours / theirs - 1)
                out.append(
                    Row(f"{label} {metric} off the paper", deviation, "% off", "lower", target=10)
                )
    return out


NOTES = [
    f"{NUM_SAMPLES:,} samples per distribution, seeds 1000-1003; MSE accumulated in float64.",
    "The paper's 'mean absolute error' column is numerically the MSE (notes section 5): it is "
    "quoted as `paper` beside our MSE; our MAE has no paper value.",
    "'paper' rounding = the 2015 kernel's (toward zero on alternate cells, notes section 3); "
    "only the dynamic tree's kernel is public, the other types use the same search on their "
    "own tables (static8: the smallest code stands for zero).",
    "Linear U(0,1) MSE 0.0024 in the paper cannot be reproduced (1.3e-5 with the kernel's "
    "rounding, 5e-6 with nearest): probably a misprint (notes section 5).",
    "Normalised types' MSE grows with the sample's absmax (about 5.5 sigma at 25M samples).",
]


def plot(results: dict, ax_mre, ax_mse) -> None:  # noqa: ANN001 - matplotlib axes
    """Grouped bars per (distribution, type): paper, ours with paper rounding, nearest."""
    cells = list(PAPER)
    xs = range(len(cells))
    for offset, (label, values) in enumerate(
        [
            ("paper", [PAPER[c] for c in cells]),
            ("ours, paper rounding", [results[c[0], "paper", c[1]][::2] for c in cells]),
            ("ours, nearest", [results[c[0], "nearest", c[1]][::2] for c in cells]),
        ]
    ):
        positions = [x + (offset - 1) * 0.27 for x in xs]
        ax_mse.bar(positions, [v[0] for v in values], width=0.27, label=label)
        ax_mre.bar(positions, [v[1] for v in values], width=0.27, label=label)
    names = [f"{c[0]}\n{c[1]}" for c in cells]
    for ax, title in ((ax_mse, "MSE (paper: 'mean absolute error')"), (ax_mre, "relative error %")):
        ax.set_xticks(list(xs), names, fontsize=6, rotation=90)
        ax.set_title(f"Table 1: {title}")
    ax_mse.set_yscale("log")
    ax_mre.legend(fontsize=7)


def suite_result(results: dict) -> SuiteResult:
    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_mre, ax_mse) = plt.subplots(1, 2, figsize=(14, 5))
        plot(results, ax_mre, ax_mse)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    return SuiteResult(rows(results), plot=draw, notes=NOTES)


@register_suite("codecs_errors", "8-bit paper Table 1: approximation error of every 8-bit type")
def run() -> SuiteResult:
    return suite_result(measure())
