"""Does graphed prefill slow the torch engine's decode cycle? Each case runs in a process of its own (what slows a
cycle graph holds for the whole process, docs/benchmarks.md) and times the fused plain cycle over whole generations:

- `ungraphed`: prefill without graph_prefill (the compiled forward, each chunk padded);
- `graphs-first`: prefill's graphs captured by `warm_up_prefill` before the cycle's graph;
- `cycle-first`: the cycle's graph captured in the first generation (whose prefill captures its own width's graph
  just before), warm_up_prefill's graphs after it, and the cycle timed again.

    python scripts/probe_prefill_graphs.py --config 270m.json [--context 333] [--out probe.json] [--plot probe.png]

Needs CUDA. Random weights cost what real ones do (shapes, not values, set a kernel's time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

CASES = ("ungraphed", "graphs-first", "cycle-first")


def time_case(config: Path, context: int, case: str, tokens: int, runs: int) -> dict:
    """One case in this process: ms per decode cycle of each generation after the first (which compiles and
    captures)."""
    import torch

    from specdec.generate import StopCondition, run_cycles
    from specdec.models.config import GemmaConfig
    from specdec.models.torch_gemma import GemmaModel
    from specdec.verifiers.torch_engine import FusedCycle, TorchEngine

    cfg = GemmaConfig.from_file(config)
    model = GemmaModel.random(cfg, torch.bfloat16, "cuda", context)
    engine = TorchEngine(model, max_seq_len=context, k_max=4, compile=True, graph_prefill=case != "ungraphed")
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, min(20000, cfg.vocab_size), 100)]

    def cycle_ms(cycle) -> list[float]:
        generations = [run_cycles(cycle, [prompt], 0, StopCondition(tokens)).stats for _ in range(runs + 1)]
        return [1e3 * s.decode_s / s.cycles for s in generations[1:]]

    with torch.inference_mode():
        if case == "graphs-first":
            engine.warm_up_prefill()
        cycle = FusedCycle(engine, None, 0)
        record = {"case": case, "cycle_ms": cycle_ms(cycle)}
        if case == "cycle-first":
            engine.warm_up_prefill()
            record["cycle_ms_after_warm_up"] = cycle_ms(cycle)
    record["prefill_graphs"] = len(engine._prefill_graphs)
    return record


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for r in records:
        labels.append(r["case"])
        values.append(np.median(r["cycle_ms"]))
        if "cycle_ms_after_warm_up" in r:
            labels.append(f"{r['case']},\nafter warm_up_prefill")
            values.append(np.median(r["cycle_ms_after_warm_up"]))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bars = ax.bar(labels, values, color=["tab:green"] + ["tab:red"] * (len(values) - 1))
    ax.bar_label(bars, fmt="%.3f")
    ax.set_ylabel("plain decode cycle, ms (median)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a config.json: random weights at its shapes")
    parser.add_argument("--context", type=int, default=333, help="the engine's max_seq_len (bench's, on the 270M)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--case", choices=CASES, help="run one case here and print its record (what main runs)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(time_case(args.config, args.context, args.case, args.tokens, args.runs)))
        return 0
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: probe_prefill_graphs times CUDA graphs; no CUDA device is visible")
    records = []
    for case in CASES:
        child = subprocess.run([sys.executable, __file__, "--config", str(args.config), "--context", str(args.context),
                                "--tokens", str(args.tokens), "--runs", str(args.runs), "--case", case],
                               capture_output=True, text=True, check=True)
        records.append(json.loads(child.stdout.strip().splitlines()[-1]))
    from specdec.evidence import git_commit, now_utc

    record = {"device": torch.cuda.get_device_name(), "date": now_utc(), "commit": git_commit(),
              "torch": torch.__version__, "config": str(args.config), "context": args.context, "tokens": args.tokens,
              "cases": records}
    print(f"{'case':<14} {'cycle ms':>9} {'after warm-up':>14} {'prefill graphs':>15}")
    for r in records:
        after = r.get("cycle_ms_after_warm_up")
        print(f"{r['case']:<14} {np.median(r['cycle_ms']):>9.4f} "
              f"{'' if after is None else f'{np.median(after):.4f}':>14} {r['prefill_graphs']:>15}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(records, args.plot, f"{record['device']} · {args.config.name} · context {args.context}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
