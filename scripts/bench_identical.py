"""Is greedy speculative decoding token-identical to plain decoding, and what does that cost? Row-invariant
engines (`invariant=True`, every decode forward at one width) against per-width forwards (`invariant=False`),
for the PyTorch and JAX engines, n-gram drafting at K = 1..8, over a file of prompts.

    python scripts/bench_identical.py --target DIR --prompts scripts/prompts/identical_greedy.jsonl \\
        [--new-tokens 128] [--ks 1,2,3,4,5,6,7,8] [--engines torch,jax] [--out identical.json] [--plot identical.png]

Per engine and mode: a plain greedy decode of every prompt (torch: `greedy_decode`; JAX: `generate_fused`),
then greedy n-gram speculative decoding at each K (torch: the fused CUDA-graph cycle; JAX: the fused
while_loop), each run compared token by token with that engine and mode's plain decode. tok/s is the wall
time of one whole generation (prefill included) after one warm-up run of the configuration on the first
prompt (compilation excluded); tau = tokens emitted per verify cycle; speedup = mean tok/s over mean plain
tok/s of the same engine and mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from specdec.evidence import git_commit, now_utc

K_MAX = 8
MODES = {"invariant": True, "per-width": False}  # invariant first: it gets the static-shape torch.compile


def log(msg: str) -> None:
    print(msg, flush=True)


def first_divergence(reference: list[int], tokens: list[int]) -> int | None:
    """The first index where the two token lists differ (a length difference counts), None if equal."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def bench_mode(engine_name: str, mode: str, plain, spec, prompts: list[dict], ks: list[int], sync, rows: list,
               save) -> None:
    """plain(ids) -> (tokens, tau); spec(k) -> a run(ids) -> (tokens, tau) for drafts of k tokens."""
    reference: dict[str, list[int]] = {}
    for k in [0, *ks]:
        run = plain if k == 0 else spec(k)
        start = time.perf_counter()
        run(prompts[0]["ids"])  # warm-up: compiles / captures this configuration
        sync()
        warm_s = time.perf_counter() - start
        mine = []
        for p in prompts:
            sync()
            start = time.perf_counter()
            tokens, tau = run(p["ids"])
            sync()
            secs = time.perf_counter() - start
            if k == 0:
                reference[p["id"]] = tokens
                div = None
            else:
                div = first_divergence(reference[p["id"]], tokens)
            mine.append(dict(engine=engine_name, mode=mode, prompt=p["id"], kind=p["kind"], k=k,
                             identical=None if k == 0 else div is None, first_divergence=div, tau=tau,
                             tok_s=len(tokens) / secs, new_tokens=len(tokens)))
            if k == 0:
                mine[-1]["tokens"] = tokens  # the reference, kept to compare the modes' plain decodes
        rows.extend(mine)
        same = "ref" if k == 0 else f"{sum(r['identical'] for r in mine)}/{len(mine)}"
        log(f"  {engine_name} {mode:9} K={k}: identical {same:>5}  {mean(r['tok_s'] for r in mine):7.1f} tok/s  "
            f"tau {mean(r['tau'] for r in mine):4.2f}  (warm-up {warm_s:.1f} s, {len(mine)} runs)")
        save()


def bench_torch(args, prompts, ks, rows, save) -> None:
    import torch

    from specdec.drafters.ngram import NgramDrafter
    from specdec.engines.cycle_torch import FusedCycle
    from specdec.engines.verifier_torch import TorchEngine
    from specdec.generate import StopCondition, run_cycles
    from specdec.models.gemma_torch import GemmaModel

    n = args.new_tokens
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    model = GemmaModel.from_checkpoint(args.target, dtype=getattr(torch, args.dtype), device=args.device,
                                       max_seq_len=args.max_seq_len)
    for mode, invariant in MODES.items():
        log(f"torch {mode}: building the engine")
        engine = TorchEngine(model, k_max=K_MAX, max_seq_len=args.max_seq_len, invariant=invariant)

        def plain(ids):
            return engine.greedy_decode(ids, n), 1.0

        def spec(k):
            cycle = FusedCycle(engine, NgramDrafter().device_draft_fn("torch", k), k)  # one graph per K, reused

            def run(ids):
                gen = run_cycles(cycle, [ids], k, StopCondition(n))
                return gen.tokens[0], gen.stats.tau

            return run

        bench_mode("torch", mode, plain, spec, prompts, ks, sync, rows, save)
        del engine, plain, spec
        gc.collect()
    del model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()  # leave the memory to the JAX engine that runs next


def bench_jax(args, prompts, ks, rows, save) -> None:
    import jax.numpy as jnp

    from specdec.drafters.ngram import NgramDrafter
    from specdec.engines.verifier_jax import JaxEngine

    n = args.new_tokens
    for mode, invariant in MODES.items():
        log(f"jax {mode}: building the engine")
        engine = JaxEngine.from_checkpoint(args.target, dtype=getattr(jnp, args.dtype), k_max=K_MAX,
                                           max_seq_len=args.max_seq_len, invariant=invariant)

        def plain(ids):
            return engine.generate_fused(ids, n), 1.0

        def spec(k):
            draft_fn = NgramDrafter().device_draft_fn("jax", k)  # the engine compiles one loop per draft_fn

            def run(ids):
                state = engine.decode_fused(engine.begin_decode(ids, n, draft_fn), n, (), draft_fn)
                tokens = engine.emitted_tokens(state, len(ids), n)  # device_get: waits for the loop
                return tokens, float(state.generated[0]) / max(int(state.cycles[0]), 1)

            return run

        bench_mode("jax", mode, plain, spec, prompts, ks, lambda: None, rows, save)
        del engine, plain, spec
        gc.collect()


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (engine, mode, k), in the order the rows came."""
    keys = list(dict.fromkeys((r["engine"], r["mode"], r["k"]) for r in rows))
    plain_tok_s = {(e, m): mean(r["tok_s"] for r in rows if (r["engine"], r["mode"], r["k"]) == (e, m, 0))
                   for e, m, _ in keys}
    summary = []
    for engine, mode, k in keys:
        mine = [r for r in rows if (r["engine"], r["mode"], r["k"]) == (engine, mode, k)]
        tok_s = mean(r["tok_s"] for r in mine)
        summary.append(dict(engine=engine, mode=mode, k=k, prompts=len(mine),
                            identical=None if k == 0 else sum(r["identical"] for r in mine),
                            tok_s=tok_s, tau=mean(r["tau"] for r in mine),
                            speedup=tok_s / plain_tok_s[(engine, mode)]))
    return summary


def plain_modes(rows: list[dict], engine: str) -> dict | None:
    """Plain decode with invariant forwards against per-width forwards: speed and whether the tokens agree."""
    by_mode = {m: {r["prompt"]: r for r in rows if r["engine"] == engine and r["mode"] == m and r["k"] == 0}
               for m in MODES}
    on, off = by_mode["invariant"], by_mode["per-width"]
    if not on or not off:
        return None
    common = [p for p in on if p in off]
    on_tok_s, off_tok_s = mean(on[p]["tok_s"] for p in common), mean(off[p]["tok_s"] for p in common)
    return dict(engine=engine, invariant_tok_s=on_tok_s, per_width_tok_s=off_tok_s, ratio=on_tok_s / off_tok_s,
                same_tokens=sum(on[p]["tokens"] == off[p]["tokens"] for p in common), prompts=len(common))


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_same) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"torch": "C0", "jax": "C2"}
    styles = {"invariant": ("o-", "invariant (one width)"), "per-width": ("s--", "per-width")}
    series = [(e, m) for e in dict.fromkeys(s["engine"] for s in record["summary"]) for m in styles]
    for i, (engine, mode) in enumerate(series):
        style, label = styles[mode]
        pts = [s for s in record["summary"] if s["engine"] == engine and s["mode"] == mode]
        if not pts:
            continue
        ax_speed.plot([s["k"] for s in pts], [s["tok_s"] for s in pts], style, color=colors.get(engine),
                      label=f"{engine} {label}")
        spec = [s for s in pts if s["k"] > 0]
        nudge = 0.06 * (i - (len(series) - 1) / 2)  # side by side, so equal counts stay visible
        ax_same.plot([s["k"] + nudge for s in spec], [s["identical"] for s in spec], style, color=colors.get(engine),
                     label=f"{engine} {label}")
    n_prompts = len(record["prompts"])
    ax_speed.set(xlabel="K (draft tokens per cycle; 0 = plain decode)", ylabel="tokens / s (mean over prompts)")
    ax_same.set(xlabel="K (draft tokens per cycle)", ylabel="prompts identical to plain decode",
                ylim=(-0.5, n_prompts + 0.5))
    ax_same.axhline(n_prompts, color="grey", ls=":", lw=1)
    ax_speed.set_xticks([0, *record["ks"]])
    ax_same.set_xticks(record["ks"])
    for ax in (ax_speed, ax_same):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"greedy n-gram speculative vs plain decode · {n_prompts} prompts x {record['new_tokens']} tokens · "
                 f"{record['device']} · {record['dtype']} · commit {record['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, default=Path(__file__).parent / "prompts" / "identical_greedy.jsonl")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8", help=f"draft lengths, each 1..{K_MAX}")
    parser.add_argument("--engines", default="torch,jax")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--limit-prompts", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--out", type=Path, default=Path("bench_identical.json"))
    parser.add_argument("--plot", type=Path, default=None, help="PNG: tok/s and identical prompts against K")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX is first imported

    import torch

    from specdec.models.tokenizer import Tokenizer

    t0 = time.perf_counter()
    ks = [int(k) for k in args.ks.split(",")]
    engines = args.engines.split(",")
    tok = Tokenizer.from_dir(args.target)
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit_prompts]
    for p in prompts:
        p["ids"] = tok.encode(p["prompt"])
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    record = {"device": device, "date": now_utc(), "commit": git_commit(), "dtype": args.dtype,
              "new_tokens": args.new_tokens, "ks": ks, "k_max": K_MAX, "max_seq_len": args.max_seq_len,
              "prompts": {p["id"]: {"kind": p["kind"], "tokens": len(p["ids"])} for p in prompts}}
    rows: list[dict] = []
    log(f"{device} · {args.dtype} · {len(prompts)} prompts x {args.new_tokens} tokens · K {ks} · engines {engines}")

    def save():
        record.update(rows=rows, summary=summarize(rows), elapsed_s=time.perf_counter() - t0,
                      plain_invariant_vs_per_width=[c for e in engines if (c := plain_modes(rows, e))])
        args.out.write_text(json.dumps(record, indent=1))

    if "torch" in engines:
        bench_torch(args, prompts, ks, rows, save)
    if "jax" in engines:
        bench_jax(args, prompts, ks, rows, save)
    save()
    if args.plot:
        plot(record, args.plot)

    log(f"\n{device} · {args.dtype} · {len(prompts)} prompts x {args.new_tokens} new tokens · commit {record['commit']}"
        f" · {record['elapsed_s']:.0f} s")
    log(f"{'engine':6} {'mode':9} {'K':>2} {'identical':>9} {'tok/s':>8} {'tau':>5} {'vs plain':>8}")
    for s in record["summary"]:
        same = "plain" if s["identical"] is None else f"{s['identical']}/{s['prompts']}"
        log(f"{s['engine']:6} {s['mode']:9} {s['k']:>2} {same:>9} {s['tok_s']:8.1f} {s['tau']:5.2f} {s['speedup']:8.2f}")
    for c in record["plain_invariant_vs_per_width"]:
        log(f"{c['engine']}: plain decode {c['invariant_tok_s']:.1f} tok/s invariant vs {c['per_width_tok_s']:.1f} "
            f"per-width (x{c['ratio']:.2f}); same tokens on {c['same_tokens']}/{c['prompts']} prompts")


if __name__ == "__main__":
    main()
