"""Plots of an EAGLE-3 training run: loss and per-TTT-step accuracy against the step, from the run's
train_log.jsonl (one JSON object per logged step: loss, loss_j, acc_j, lr, tok_s)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training_log(log: str | Path, png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    ttt = sorted(int(k.split("_")[1]) for k in rows[0] if k.startswith("acc_"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(steps, [r["loss"] for r in rows], color="black", label="weighted loss")
    left.set_xlabel("step")
    left.set_ylabel("loss (soft cross-entropy, weighted over TTT steps)")
    left.grid(alpha=0.3)
    for j in ttt:
        right.plot(steps, [r[f"acc_{j}"] for r in rows], label=f"TTT step {j}", color=f"C{j}")
    right.set_xlabel("step")
    right.set_ylabel("accuracy: head argmax = target argmax")
    right.set_ylim(0, 1)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
