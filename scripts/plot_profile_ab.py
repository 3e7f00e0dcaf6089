"""A/B pairs of `scripts/profile_cycle.py` records (torch: each cycle's GPU ms) or `scripts/profile_jax_cycle.py` records
(JAX: each cycle's wall ms, plain decoding) as bars, before and after, one panel per pair (the two runs of a pair share
a machine; pairs may not), with the ms and kernels per cycle on each bar. Each panel's axis starts at 80% of its
shortest cycle, so that changes of a few percent show: read the numbers.

    python scripts/plot_profile_ab.py out.png "title" BEFORE.json AFTER.json [BEFORE.json AFTER.json ...]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def name_part(path: Path, index: int) -> str:
    """Part `index` of a record's file name, profile-cycle-<device>-<model>-<package>-<what>.json (0: the device),
    or profile-jax-cycle-..."""
    parts = path.stem.split("-")
    return parts[index + (3 if parts[1] == "jax" else 2)]


def label(path: Path) -> str:
    """The package a record measured."""
    return name_part(path, 2)


def cycles(record: dict) -> dict[str, tuple[float, float]]:
    """method -> (ms, kernels) per cycle."""
    if "rows" in record:
        return {r["method"]: (r["cycle_gpu_ms"], r["kernels"]["per_replay"]) for r in record["rows"]}
    return {"plain": (record["cycle_wall_ms"], record["kernels"]["per_cycle"])}


def main() -> None:
    out, title, *paths = sys.argv[1:]
    if not paths or len(paths) % 2:
        sys.exit("give pairs of records: BEFORE.json AFTER.json ...")
    pairs = [(Path(a), Path(b)) for a, b in zip(paths[::2], paths[1::2])]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.2 * len(pairs), 3.8), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        records = [cycles(json.loads(p.read_text())) for p in pair]
        methods = [m for m in records[0] if m in records[1]]
        for i, (path, rows) in enumerate(zip(pair, records)):
            xs = [m + 0.38 * i for m in range(len(methods))]
            bars = ax.bar(xs, [rows[m][0] for m in methods], width=0.36, label=label(path))
            for bar, m in zip(bars, methods):
                ax.annotate(f"{bar.get_height():.3f}\n{rows[m][1]:.0f} kernels",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_xticks([m + 0.19 for m in range(len(methods))], methods)
        ax.set_title(f"{name_part(pair[0], 1)}: {label(pair[0])} → {label(pair[1])}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        lowest = min(ms for rows in records for ms, _ in rows.values())
        ax.set_ylim(bottom=0.8 * lowest, top=1.08 * ax.get_ylim()[1])
    axes[0][0].set_ylabel("cycle ms (torch: GPU time, JAX: wall time)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
