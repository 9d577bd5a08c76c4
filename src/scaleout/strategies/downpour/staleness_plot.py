"""`staleness.png` in a Downpour run's directory: how stale each replica's pushes were, and
what the staleness rule and bound did to them, from `pushes.jsonl`.

Left: a histogram of push staleness per replica (the most over the push's shards: the one a
bound holds). Middle: the factor the shards' staleness rule put on each push's step (1:
untouched; `downpour.staleness_rule`). Right: the seconds each push window waited for the
bound (`downpour.max_staleness`) before its fetch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaleout.metrics import read_metrics

STALENESS_PLOT = "staleness.png"


def plot_staleness(pushes: Path, out: Path) -> Path | None:
    """Draw `out` from the push records in `pushes`; None when there are none."""
    records = [r for r in read_metrics(pushes) if r.get("staleness_max") is not None]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_replica: dict[Any, list[dict[str, Any]]] = {}
    for record in records:
        by_replica.setdefault(record.get("replica", 0), []).append(record)
    fig, (stale_ax, rule_ax, wait_ax) = plt.subplots(1, 3, figsize=(14, 3.8))
    top = max(int(r["staleness_max"]) for r in records)
    bins = [b - 0.5 for b in range(top + 2)]
    for replica, mine in sorted(by_replica.items(), key=lambda item: str(item[0])):
        label = f"replica {replica}"
        stale_ax.hist([r["staleness_max"] for r in mine], bins=bins, alpha=0.6, label=label)
        scales = [r["rule_scale"] for r in mine if r.get("rule_scale") is not None]
        rule_ax.hist(scales, bins=20, range=(0.0, 1.0), alpha=0.6, label=label)
        waits = [1000 * r.get("wait_s", 0.0) for r in mine]
        wait_ax.hist(waits, bins=20, alpha=0.6, label=label)
    stale_ax.set_xticks(range(0, top + 1, max(1, (top + 1) // 10)))  # whole updates
    stale_ax.set_xlabel("staleness (shard updates since the fetch)")
    rule_ax.set_xlabel("factor on the step by the staleness rule (1: untouched)")
    wait_ax.set_xlabel("wait for the staleness bound (ms)")
    stale_ax.set_ylabel("pushes")
    for ax in (stale_ax, rule_ax, wait_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{len(records)} pushes")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
