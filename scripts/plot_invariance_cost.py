"""What invariance costs a plain decode cycle, by decode width: `scripts/profile_cycle.py` records of one model at
several widths (`--no-invariant` gives the forward of 1 row; `--k 4` an invariant width of 8, `--k 8` of 16), one
panel per model, each cycle's GPU ms as a bar with its cost over the 1-row cycle where that record is given.

    python scripts/plot_invariance_cost.py out.png "title" RECORD.json [RECORD.json ...]
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    out, title, *paths = sys.argv[1:]
    if not paths:
        sys.exit(__doc__)
    by_model: dict[str, dict[int, float]] = defaultdict(dict)
    for path in paths:
        record = json.loads(Path(path).read_text())
        plain = next(r for r in record["rows"] if r["method"] == "plain")
        rows = record["width"] if record.get("invariant", True) else plain["k"] + 1  # a plain step's forward
        by_model[Path(record["model"]).stem][rows] = plain["cycle_gpu_ms"]
    fig, axes = plt.subplots(1, len(by_model), figsize=(3.6 * len(by_model), 3.8), squeeze=False)
    for ax, (model, cycles) in zip(axes[0], by_model.items()):
        widths = sorted(cycles)
        bars = ax.bar([str(w) for w in widths], [cycles[w] for w in widths], color="tab:blue")
        one = cycles.get(1)
        ax.bar_label(bars, labels=[f"{cycles[w]:.3f}" + (f"\n+{cycles[w] / one - 1:.1%}" if one and w > 1 else "")
                                   for w in widths])
        ax.set(title=model, xlabel="rows per decode forward", ylabel="plain cycle, GPU ms",
               ylim=(0.8 * min(cycles.values()), 1.08 * max(cycles.values())))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
