"""Plot a bench_spec.py result: tok/s per method and K, per prompt, with our plain decode and
transformers as reference lines.

    python scripts/plot_bench.py docs/results/bench_spec_h200.json docs/results/bench_spec_h200.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    record = json.load(open(src))
    rows = record["rows"]
    prompts = sorted({r["prompt"] for r in rows})
    fig, axes = plt.subplots(1, len(prompts), figsize=(6 * len(prompts), 4.5), sharey=True)
    for ax, prompt in zip(axes, prompts):
        mine = [r for r in rows if r["prompt"] == prompt]
        for (engine, method), style in {("torch", "ngram host loop"): "o--", ("torch", "ngram fused graph"): "o-",
                                        ("jax", "ngram fused loop"): "s-"}.items():
            pts = sorted((r["k"], r["tok_s"]) for r in mine if r["engine"] == engine and r["method"] == method)
            ax.plot([k for k, _ in pts], [v for _, v in pts], style, label=f"{engine} {method}")
        for (engine, method), color in {("torch", "plain"): "C0", ("jax", "plain fused loop"): "C2",
                                        ("transformers", "plain"): "grey", ("transformers", "prompt lookup 10"): "black"}.items():
            for r in mine:
                if r["engine"] == engine and r["method"] == method:
                    ax.axhline(r["tok_s"], color=color, ls=":", label=f"{engine} {method}")
        ax.set_title(f"{prompt} prompt")
        ax.set_xlabel("K (draft tokens per cycle)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens / s (batch 1, 128 new tokens)")
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Gemma 3 270M · {record['device']} · {record['dtype']} · commit {record['commit']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
