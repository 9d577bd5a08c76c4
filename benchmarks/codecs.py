"""Suite `codecs`: everything the 8-bit paper measures, in one run and one figure.

Runs the five parts, each also a suite of its own (`python -m benchmarks codecs_errors`, ...):

- `codecs_errors`:   Table 1, approximation error of every 8-bit type, paper vs ours;
- `codecs_speed`:    ns per number to encode and decode (section 4.2), beside a copy and
                     bitsandbytes;
- `codecs_transfer`: Figure 6, transfer time raw vs 8-bit between two emulated hosts;
- `codecs_allreduce`: a DDP gradient bucket averaged over the two hosts, raw vs 8-bit vs
                     the hook's own choice on the link;
- `codecs_training`: Figures 3 and 4, MNIST test error with every codec, data and model
                     parallel.

About 25 minutes on a 2-core machine; the environment variables
`SCALEOUT_BENCH_CODECS_SAMPLES`, `_REPS`, `_EPOCHS` and `_SEEDS` shorten the parts.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks import (
    SuiteResult,
    codecs_allreduce,
    codecs_errors,
    codecs_speed,
    codecs_training,
    codecs_transfer,
    register_suite,
)


@register_suite("codecs", "8-bit paper: errors, speed, transfer, all-reduce and training")
def run() -> SuiteResult:
    timings = {}
    start = time.perf_counter()
    errors = codecs_errors.measure()
    timings["errors"] = time.perf_counter() - start
    start = time.perf_counter()
    speed_rows, speed_notes = codecs_speed.measure()
    timings["speed"] = time.perf_counter() - start
    start = time.perf_counter()
    transfer_rows, transfer_notes, transfer = codecs_transfer.measure()
    timings["transfer"] = time.perf_counter() - start
    start = time.perf_counter()
    allreduce_rows, allreduce_notes, allreduce = codecs_allreduce.measure()
    timings["allreduce"] = time.perf_counter() - start
    start = time.perf_counter()
    training_rows, training_notes, training = codecs_training.measure()
    timings["training"] = time.perf_counter() - start

    error_part = codecs_errors.suite_result(errors)
    rows = error_part.rows + speed_rows + transfer_rows + allreduce_rows + training_rows
    spent = ", ".join(f"{part} {seconds / 60:.1f} min" for part, seconds in timings.items())
    notes = [
        *error_part.notes,
        *speed_notes,
        *transfer_notes,
        *allreduce_notes,
        *training_notes,
        f"time per part: {spent}.",
    ]

    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 4, figsize=(26, 11))
        codecs_errors.plot(errors, axes[0, 0], axes[0, 1])
        codecs_speed.plot(speed_rows, axes[0, 2])
        if transfer:
            codecs_transfer.plot(transfer, axes[1, 0])
        else:
            axes[1, 0].text(0.5, 0.5, "transfer skipped (see notes)", ha="center")
        if allreduce:
            codecs_allreduce.plot(allreduce, axes[1, 1])
        else:
            axes[1, 1].text(0.5, 0.5, "all-reduce skipped (see notes)", ha="center")
        codecs_training.plot(training, axes[1, 2])
        axes[0, 3].axis("off")
        axes[1, 3].axis("off")
        axes[0, 3].text(0, 1, _summary(rows), va="top", family="monospace", fontsize=7)
        fig.suptitle("8-bit approximation (Dettmers 2015): paper vs scaleout")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)

    return SuiteResult(rows, plot=draw, notes=notes)


def _summary(rows: list) -> str:
    """The rows with targets: how many are met, and the ones missed (first 40)."""
    judged = [row for row in rows if row.meets is not None]
    missed = [row for row in judged if not row.meets]
    lines = [f"targets met: {len(judged) - len(missed)} of {len(judged)}", "missed:"]
    lines += [f"  {row.name}: {row.value:.3g} (target {row.target:.3g})" for row in missed[:40]]
    return "\n".join(lines)
