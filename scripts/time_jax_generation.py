"""A JAX generation timed as `specdec bench` times one: `run_cycles` over the fused plain cycle, its prefill and its
decode per token, the host's time per dispatch and in its reads, and the device's own pace (calls back to back, one
wait at the end). Where decode per token exceeds the device's pace, the host or the run's set-up is the difference.

    python scripts/time_jax_generation.py --config 270m.json --contexts 333,1024 [--out timings.json]
    python scripts/time_jax_generation.py --target DIR --contexts 333
    python scripts/time_jax_generation.py --config 270m.json --prefill-chunks 0,128 --prompt-tokens 14,100,400
        [--cycles-per-call 1] [--plot prefill.png]

`--prefill-chunks`: each engine's prefill_chunk (0: through the decode forward, inside the cycle's program).

Random weights cost what real ones do (shapes, not values, set a kernel's time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from specdec import compile_cache
from specdec.evidence import git_commit, now_utc
from specdec.generate import StopCondition, run_cycles
from specdec.models.config import FULL, GemmaConfig
from specdec.models.jax_gemma import load_params, random_params
from specdec.verifiers.jax_engine import JaxEngine, JaxFusedCycle


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def time_generations(cycle: JaxFusedCycle, prompt: list[int], tokens: int, runs: int) -> list[dict]:
    """`runs` generations of `tokens` tokens after one short warm-up: the tokens each emitted, prefill and decode ms,
    dispatches, and the host's ms per dispatch and in reads (the wait for a call's results included)."""
    run_cycles(cycle, [prompt], 0, StopCondition(16))
    host = {"dispatch": 0.0, "read": 0.0, "calls": 0}
    dispatch, read = cycle._dispatch, cycle._read

    def timed_dispatch():
        start = time.perf_counter()
        results = dispatch()
        host["dispatch"] += time.perf_counter() - start
        host["calls"] += 1
        return results

    def timed_read(results):
        start = time.perf_counter()
        read(results)
        host["read"] += time.perf_counter() - start

    cycle._dispatch, cycle._read = timed_dispatch, timed_read
    rows = []
    try:
        for _ in range(runs):
            host.update(dispatch=0.0, read=0.0, calls=0)
            generation = run_cycles(cycle, [prompt], 0, StopCondition(tokens))
            stats = generation.stats
            rows.append({"emitted": len(generation.tokens[0]), "prefill_ms": stats.prefill_s * 1e3,
                         "decode_ms": stats.decode_s * 1e3,
                         "decode_ms_per_token": stats.decode_s * 1e3 / tokens, "calls": host["calls"],
                         "dispatch_ms_per_call": host["dispatch"] * 1e3 / max(host["calls"], 1),
                         "read_ms": host["read"] * 1e3})
    finally:
        cycle._dispatch, cycle._read = dispatch, read
    return rows


def device_pace(cycle: JaxFusedCycle, prompt: list[int], calls: int) -> float:
    """ms per cycle of `calls` calls dispatched back to back, with one wait at the end."""
    cycle.start([prompt], StopCondition(10**6))
    for _ in range(3):
        cycle.step()
    cycle.drain()
    jax.block_until_ready(cycle.state.cache)
    start = time.perf_counter()
    for _ in range(calls):
        results = cycle._dispatch()
    jax.block_until_ready(results)
    return (time.perf_counter() - start) * 1e3 / (calls * cycle.cycles_per_call)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="an imported checkpoint directory")
    source.add_argument("--config", type=Path, help="a config.json: random weights at its shapes")
    parser.add_argument("--contexts", default="333,1024", help="comma-separated contexts (the engine's max_seq_len)")
    parser.add_argument("--prompt-tokens", default="100", help="comma-separated prompt lengths")
    parser.add_argument("--prefill-chunks", default="0", help="comma-separated prefill_chunk values (0: none)")
    parser.add_argument("--cycles-per-call", type=int, default=8, help="the fused cycle's")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens a generation")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--k-max", type=int, default=4, help="the engine's k_max (sets the invariant width)")
    parser.add_argument("--out", type=Path, help="JSON of the timings")
    parser.add_argument("--plot", type=Path, help="PNG: median prefill ms by prompt length, a line per engine")
    args = parser.parse_args()

    compile_cache.enable_jax()
    if args.target:
        cfg, params = load_params(args.target, pack=True)
    else:
        cfg = GemmaConfig.from_file(args.config)
        params = random_params(cfg, jax.random.key(0), pack=True)
    tokens = np.random.default_rng(0).integers(3, min(20000, cfg.vocab_size), max(ints(args.prompt_tokens)))
    rows = []
    for context, chunk in ((c, k) for c in ints(args.contexts) for k in ints(args.prefill_chunks)):
        engine = JaxEngine(cfg, params, max_seq_len=context, k_max=args.k_max, prefill_chunk=chunk or None)
        cycle = JaxFusedCycle(engine, None, 0, cycles_per_call=args.cycles_per_call)
        slots = int(engine.cache["slot_pos"][FULL].shape[1])
        for length in ints(args.prompt_tokens):
            prompt = [int(t) for t in tokens[:length]]
            generations = time_generations(cycle, prompt, args.tokens, args.runs)
            pace = device_pace(cycle, prompt, calls=20)
            name = f"context {context} ({slots} slots), prefill_chunk {engine.prefill_chunk}, prompt {length}"
            for g in generations:
                print(f"{name}: prefill {g['prefill_ms']:.2f} ms, decode {g['decode_ms']:.1f} ms"
                      f" ({g['decode_ms_per_token']:.3f} a token), {g['calls']} calls, dispatch"
                      f" {g['dispatch_ms_per_call']:.2f} ms a call, reads {g['read_ms']:.1f} ms", flush=True)
            print(f"{name}: the device alone {pace:.3f} ms a cycle", flush=True)
            rows.append({"context": context, "slots": slots, "prefill_chunk": engine.prefill_chunk,
                         "prompt_tokens": length, "cycles_per_call": args.cycles_per_call, "generations": generations,
                         "device_ms_per_cycle": pace})
    print(f"{'context':>8} {'prefill_chunk':>13} {'prompt':>6} {'prefill ms':>10} {'decode ms/token':>15}")
    for row in rows:
        medians = {key: float(np.median([g[key] for g in row["generations"]]))
                   for key in ("prefill_ms", "decode_ms_per_token")}
        print(f"{row['context']:>8} {str(row['prefill_chunk']):>13} {row['prompt_tokens']:>6} "
              f"{medians['prefill_ms']:>10.2f} {medians['decode_ms_per_token']:>15.3f}")
    if args.out:
        args.out.write_text(json.dumps({
            "benchmark": "time_jax_generation", "date": now_utc(), "commit": git_commit(),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": str(args.target or args.config),
            "weights": "checkpoint" if args.target else "random", "tokens": args.tokens, "rows": rows}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (context, chunk), group in itertools.groupby(rows, key=lambda r: (r["context"], r["prefill_chunk"])):
        group = list(group)
        ax.plot([r["prompt_tokens"] for r in group],
                [np.median([g["prefill_ms"] for g in r["generations"]]) for r in group], marker="o",
                label=f"context {context}, " + (f"prefill_chunk {chunk}" if chunk else "prefill in the cycle"))
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill, ms (median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
