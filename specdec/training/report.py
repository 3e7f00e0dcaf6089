"""Plots of an EAGLE-3 training run: loss and per-TTT-step accuracy against the step, from the run's
train_log.jsonl (one JSON object per logged step: loss, loss_j, acc_j, lr, tok_s) and, dashed, its
held-out rows' eval_log.jsonl beside it when there is one (eval_loss, eval_acc_j)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training_log(log: str | Path, png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read(Path(log))
    eval_log = Path(log).with_name("eval_log.jsonl")
    held_out = _read(eval_log) if eval_log.is_file() else []
    steps = [r["step"] for r in rows]
    eval_steps = [r["step"] for r in held_out]
    ttt = sorted(int(k.split("_")[1]) for k in rows[0] if k.startswith("acc_"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(steps, [r["loss"] for r in rows], color="black", label="training batches")
    if held_out:
        left.plot(eval_steps, [r["eval_loss"] for r in held_out], color="black", linestyle="--", marker=".",
                  label="held-out rows")
        left.legend(fontsize=7)
    left.set_xlabel("step")
    left.set_ylabel("loss (soft cross-entropy, weighted over TTT steps)")
    left.grid(alpha=0.3)
    for j in ttt:
        right.plot(steps, [r[f"acc_{j}"] for r in rows], label=f"TTT step {j}", color=f"C{j}")
        if held_out:
            right.plot(eval_steps, [r[f"eval_acc_{j}"] for r in held_out], color=f"C{j}", linestyle="--", marker=".")
    right.set_xlabel("step")
    if held_out:
        right.plot([], [], color="gray", linestyle="--", marker=".", label="held-out rows")
    right.set_ylabel("accuracy: head argmax = target argmax")
    right.set_ylim(0, 1)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
