"""What a model drafter and an MTP assistant cost on a 31B-shaped target (random weights at the real shapes, bf16,
one GPU, the PyTorch engine): the time of one fused cycle (catch-up + K draft steps + verify + accept, one CUDA
graph replay and one host sync) against the target's plain decode step on the same kind of cycle, for K = 1..8,
and the end-to-end speedup that implies at tau = 2..6 (speedup = tau x plain step / cycle; acceptance on random
weights means nothing, so tau is the free variable). Also the target's verify step time against the tokens it
verifies (per-width forwards, T = 1..16, and the invariant width every decode forward runs at).

    python scripts/bench_drafter_cycles.py --out docs/results/drafter-cycles-h200.json --plot docs/results/drafter-cycles-h200.png
    python scripts/bench_drafter_cycles.py --tiny          # CPU smoke test at toy shapes

Shapes (assumed, not read from released checkpoints; see docs/benchmarks.md): the 31B and the E4B as in
specdec/roofline.py; the assistant as transformers' Gemma4AssistantConfig describes one (a few query-only
layers over the target's KV, a centroid-masked head of 2048 centroids, top 32).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from specdec.drafters.model import ModelDrafter
from specdec.drafters.mtp import Assistant, AssistantConfig, MtpDrafter, mtp_taps
from specdec.evidence import git_commit
from specdec.generate import StopCondition
from specdec.models.config import GemmaConfig
from specdec.models.torch_gemma import GemmaModel
from specdec.roofline import E4B_TINY, GEMMA4_31B, GEMMA4_E4B, GEMMA4_TINY, median_seconds, time_verify
from specdec.verifiers.torch_engine import FusedCycle, TorchEngine


def assistant_config(target: dict, tiny: bool) -> dict:
    """An assistant for `target`: query heads over the target's KV heads, its head dims, 4 layers."""
    text = dict(model_type="gemma4_text", vocab_size=target["vocab_size"], hidden_size=128 if tiny else 1024,
                intermediate_size=256 if tiny else 4096, num_hidden_layers=4,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                num_attention_heads=target["num_attention_heads"], num_key_value_heads=target["num_key_value_heads"],
                head_dim=target["head_dim"], global_head_dim=target["global_head_dim"],
                num_global_key_value_heads=target["num_global_key_value_heads"], attention_k_eq_v=True,
                sliding_window=target["sliding_window"], hidden_size_per_layer_input=0, rms_norm_eps=1e-6)
    return dict(model_type="gemma4_assistant", text_config=text, backbone_hidden_size=target["hidden_size"],
                use_ordered_embeddings=True, num_centroids=32 if tiny else 2048, centroid_intermediate_top_k=4 if tiny else 32)


def random_assistant(raw: dict, seed: int = 0) -> Assistant:
    cfg = AssistantConfig.from_dict(raw)
    rng = np.random.default_rng(seed)
    params = {name: (np.ones(shape, np.float32) if len(shape) == 1
                     else (rng.standard_normal(shape, np.float32) * shape[-1] ** -0.5))
              for name, shape in cfg.shapes().items()}
    ordering = rng.permutation(cfg.text.vocab_size).astype(np.int64)
    return Assistant(cfg, params, ordering, Path("random-assistant"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def time_cycles(cycle, prompt: list[int], cycles: int, rows: int = 1) -> float:
    """Median seconds per cycle.step() (graph replay + host sync), after a warm-up that captures the graph; each of
    the engine's `rows` decodes the prompt."""
    cycle.start([prompt] * rows, StopCondition(10**6))
    return median_seconds(cycle.step, cycles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("drafter-cycles.json"))
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (smoke test)")
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the target's and the model drafter's forwards (the per-width verify sweep is skipped)")
    args = parser.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ks = [int(k) for k in args.ks.split(",")]
    k_max, context = max(ks), 1024
    target_raw, drafter_raw = (GEMMA4_TINY, E4B_TINY) if args.tiny else (GEMMA4_31B, GEMMA4_E4B)
    target_cfg, drafter_cfg = GemmaConfig.from_dict(target_raw), GemmaConfig.from_dict(drafter_raw)
    log(f"building the target ({target_cfg.num_layers} layers) and the drafter ({drafter_cfg.num_layers} layers)")
    target = GemmaModel.random(target_cfg, dtype, device, context, seed=0)
    drafter = GemmaModel.random(drafter_cfg, dtype, device, context, seed=1)
    assistant = random_assistant(assistant_config(target_raw, args.tiny))
    prompt = list(np.random.default_rng(0).integers(3, target_cfg.vocab_size, 128))
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    graphs = device == "cuda"
    engine = TorchEngine(target, max_seq_len=context, k_max=k_max, cuda_graphs=graphs, compile=args.compile)
    tapped = TorchEngine(target, max_seq_len=context, k_max=k_max, cuda_graphs=graphs, compile=args.compile,
                         hidden_layers=mtp_taps(target_cfg))
    rows = []
    with torch.inference_mode():
        plain = time_cycles(FusedCycle(engine, None, 0), prompt, args.cycles)
        log(f"plain decode step {plain * 1e3:.2f} ms")
        for k in ks:
            for name, make in (("model", lambda k: ModelDrafter(drafter, engine, k)),
                               ("mtp", lambda k: MtpDrafter(assistant, tapped, k, None))):
                draft = make(k)
                cycle = FusedCycle(draft.verifier, draft.device_draft_fn("torch", k), k)
                seconds = time_cycles(cycle, prompt, args.cycles)
                rows.append({"drafter": name, "k": k, "cycle_ms": seconds * 1e3, "cycle_over_plain": seconds / plain,
                             "implied_speedup": {str(tau): tau * plain / seconds for tau in range(2, 7) if tau <= k + 1}})
                log(f"{name:5s} K={k}: cycle {seconds * 1e3:.2f} ms = {seconds / plain:.2f}x the plain step")
                del cycle, draft
                if device == "cuda":
                    torch.cuda.empty_cache()
        verify = []
        if not args.compile:
            per_width = TorchEngine(target, max_seq_len=context, k_max=15, cuda_graphs=graphs, compile=False,
                                    invariant=False)
            verify = [{"T": T, "ms": time_verify(per_width, prompt, T, args.cycles) * 1e3}
                      for T in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)]
        invariant_ms = time_verify(engine, prompt, 1, args.cycles) * 1e3
    for v in verify:
        v["over_T1"] = v["ms"] / verify[0]["ms"]
    record = {
        "benchmark": "drafter_cycles", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(dtype), "engine": ("torch (CUDA graphs, " + ("torch.compile)" if args.compile else "no torch.compile)")) if graphs else "torch (eager)",
        "shapes": {"target": target_raw, "drafter": drafter_raw, "assistant": assistant_config(target_raw, args.tiny)},
        "parameters": {"target": params(target), "drafter": params(drafter),
                       "assistant": int(sum(a.size for a in assistant.params.values()))},
        "context": {"prompt_tokens": len(prompt), "max_seq_len": context, "k_max": k_max},
        "plain_step_ms": plain * 1e3, "cycles": rows, "verify_per_width": verify,
        "verify_invariant_width_ms": invariant_ms, "invariant_width": engine.width,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"\n{record['device']} · plain step {plain * 1e3:.2f} ms · target {params(target) / 1e9:.1f}B, "
          f"drafter {params(drafter) / 1e9:.1f}B, assistant {record['parameters']['assistant'] / 1e6:.0f}M params")
    print(f"{'drafter':8s} {'K':>2s} {'cycle ms':>9s} {'x plain':>8s}  implied speedup at tau = 2 3 4 5 6")
    for r in rows:
        implied = " ".join(f"{r['implied_speedup'].get(str(t), float('nan')):5.2f}" for t in range(2, 7))
        print(f"{r['drafter']:8s} {r['k']:2d} {r['cycle_ms']:9.2f} {r['cycle_over_plain']:8.2f}  {implied}")
    if verify:
        print("verify, per-width forwards: " + " ".join(f"T={v['T']}: {v['ms']:.2f} ms ({v['over_T1']:.2f}x)" for v in verify))
    print(f"verify at the invariant width {engine.width}: {invariant_ms:.2f} ms")
    if args.plot:
        plot(record, args.plot)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("model", "o-"), ("mtp", "s-")):
        rows = [r for r in record["cycles"] if r["drafter"] == name]
        left.plot([r["k"] for r in rows], [r["cycle_ms"] for r in rows], style, label=f"{name} drafter cycle")
        for tau in (3, 5):
            pts = [(r["k"], r["implied_speedup"][str(tau)]) for r in rows if tau <= r["k"] + 1]
            right.plot([k for k, _ in pts], [s for _, s in pts], style, label=f"{name}, tau {tau}")
    left.axhline(record["plain_step_ms"], color="gray", ls="--", label="plain decode step")
    left.set(xlabel="K (drafts per cycle)", ylabel="ms", title="fused cycle time, 31B-shaped target")
    right.axhline(1.0, color="gray", ls="--")
    right.set(xlabel="K", ylabel="speedup over plain decoding", title="implied end-to-end speedup")
    left.legend()
    right.legend()
    fig.suptitle(f"{record['device']} · {record['dtype']} · {record['date'][:10]} · {record['commit'][:7]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
