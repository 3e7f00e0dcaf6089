"""The torch engine's prefill timed by prompt length, as `specdec bench` and a server see it: after the engine's
warm-up (`warm_up_prefill`, timed apart), each prompt's `prefill_row` from the host's call to the device's end.
The first call of a length is reported apart from the median of the rest (a width not warmed up captures its graph
there).

    python scripts/time_torch_prefill.py --config 270m.json --lengths 14,18,100,189,400,700 [--batch 8] [--out t.json]
    python scripts/time_torch_prefill.py --target DIR --lengths 14,100 [--no-graphs]
    python scripts/time_torch_prefill.py --records BEFORE.json AFTER.json ... --plot prefill.png

Random weights cost what real ones do (shapes, not values, set a kernel's time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specdec.evidence import git_commit, now_utc  # noqa: E402
from specdec.models.config import GemmaConfig  # noqa: E402
from specdec.models.torch_gemma import GemmaModel  # noqa: E402
from specdec.verifiers.torch_engine import TorchEngine  # noqa: E402


def timed_s(call) -> float:
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    synchronize()
    start = time.perf_counter()
    call()
    synchronize()
    return time.perf_counter() - start


def time_prefills(engine: TorchEngine, lengths: list[int], repeats: int) -> list[dict]:
    """Per prompt length: its first prefill_row and the median of `repeats` more, in ms, on the engine's last row
    (a server's rows past the first are not warmed up)."""
    rng = np.random.default_rng(0)
    row = engine.batch - 1
    rows = []
    for length in lengths:
        prompt = [engine.cfg.bos_token_id] + rng.integers(3, engine.vocab_size, length - 1).tolist()
        first = timed_s(lambda: engine.prefill_row(row, prompt))
        rest = [timed_s(lambda: engine.prefill_row(row, prompt)) for _ in range(repeats)]
        rows.append({"prompt_tokens": length, "first_ms": first * 1e3, "median_ms": statistics.median(rest) * 1e3,
                     "min_ms": min(rest) * 1e3})
    return rows


def plot(records: list[dict], path: Path) -> None:
    """Median prefill ms against prompt tokens, a panel per model (weights), a line per commit."""
    models = sorted({r["weights"] for r in records})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for record in (r for r in records if r["weights"] == model):
            rows = record["prefills"]
            ax.plot([r["prompt_tokens"] for r in rows], [r["median_ms"] for r in rows], marker="o",
                    label=f"{record['commit']}, batch {record['batch']}")
        ax.set(title=f"{model} · {records[0]['device']}", xlabel="prompt tokens", ylabel="prefill ms (median)",
               yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("torch engine: one prompt's prefill, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="a config.json: random weights at its shapes")
    source.add_argument("--target", type=Path, help="a checkpoint directory")
    source.add_argument("--records", type=Path, nargs="+", help="earlier --out records: plot them (--plot), time nothing")
    parser.add_argument("--lengths", default="14,18,64,100,189,400,700", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1, help="the engine's rows (a server's --max-num-seqs)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--k-max", type=int, default=4)
    parser.add_argument("--no-graphs", action="store_true", help="prefill ungraphed (TorchEngine's graph_prefill off)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG of prefill ms against prompt tokens")
    args = parser.parse_args(argv)
    if args.records:
        if not args.plot:
            parser.error("--records plots them: give --plot")
        plot([json.loads(path.read_text()) for path in args.records], args.plot)
        return None
    if not torch.cuda.is_available():
        sys.exit("error: time_torch_prefill times a GPU's prefill; no CUDA device is visible")
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.target:
        model = GemmaModel.from_checkpoint(args.target, dtype=torch.bfloat16, device="cuda", max_seq_len=args.context)
    else:
        cfg = GemmaConfig.from_file(args.config)
        model = GemmaModel.random(cfg, torch.bfloat16, "cuda", args.context)
    engine = TorchEngine(model, batch=args.batch, max_seq_len=args.context, k_max=args.k_max,
                         graph_prefill=not args.no_graphs)
    with torch.inference_mode():
        warm_up_s = timed_s(engine.warm_up_prefill)
        rows = time_prefills(engine, lengths, args.repeats)
    record = {"device": torch.cuda.get_device_name(), "date": now_utc(), "commit": git_commit(),
              "graphs": not args.no_graphs,
              "torch": torch.__version__, "batch": args.batch, "context": args.context, "k_max": args.k_max,
              "weights": str(args.target) if args.target else f"random at {args.config.name}",
              "warm_up_s": warm_up_s, "prefills": rows}
    print(f"warm-up {warm_up_s:.2f} s, batch {args.batch}")
    print(f"{'tokens':>7} {'first ms':>9} {'median ms':>10} {'min ms':>7}")
    for row in rows:
        print(f"{row['prompt_tokens']:>7} {row['first_ms']:>9.2f} {row['median_ms']:>10.2f} {row['min_ms']:>7.2f}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot([record], args.plot)
    return record


if __name__ == "__main__":
    main()
