"""A/B pairs of `scripts/profile_cycle.py` records as bars: each cycle's GPU ms, before and after, one panel per pair
(the two runs of a pair share a machine; pairs may not), with the ms and kernels per cycle on each bar. The axis
starts at 80% of the shortest cycle, so that changes of a few percent show: read the numbers.

    python scripts/plot_profile_ab.py out.png "title" BEFORE.json AFTER.json [BEFORE.json AFTER.json ...]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(path: Path) -> str:
    """The package a record measured, from its file name (profile-cycle-<device>-<model>-<package>-<what>.json)."""
    return path.stem.split("-")[4]


def main() -> None:
    out, title, *paths = sys.argv[1:]
    if not paths or len(paths) % 2:
        sys.exit("give pairs of records: BEFORE.json AFTER.json ...")
    pairs = [(Path(a), Path(b)) for a, b in zip(paths[::2], paths[1::2])]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.8), sharey=True, squeeze=False)
    lowest = float("inf")
    for ax, pair in zip(axes[0], pairs):
        records = [json.loads(p.read_text()) for p in pair]
        methods = [r["method"] for r in records[0]["rows"] if any(s["method"] == r["method"] for s in records[1]["rows"])]
        for i, (path, record) in enumerate(zip(pair, records)):
            rows = {r["method"]: r for r in record["rows"]}
            xs = [m + 0.38 * i for m in range(len(methods))]
            ms = [rows[m]["cycle_gpu_ms"] for m in methods]
            bars = ax.bar(xs, ms, width=0.36, label=label(path))
            for bar, m in zip(bars, methods):
                ax.annotate(f"{bar.get_height():.3f}\n{rows[m]['kernels']['per_replay']:.0f} kernels",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
            lowest = min(lowest, *ms)
        ax.set_xticks([m + 0.19 for m in range(len(methods))], methods)
        ax.set_title(f"{label(pair[0])} → {label(pair[1])}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    axes[0][0].set_ylabel("cycle GPU ms")
    axes[0][0].set_ylim(bottom=0.8 * lowest, top=1.08 * max(ax.get_ylim()[1] for ax in axes[0]))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
