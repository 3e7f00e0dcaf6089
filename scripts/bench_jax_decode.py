"""Fused-loop greedy decode speed of the JAX engine against the HBM roofline (batch 1).

    python scripts/bench_jax_decode.py --out bench_jax_decode.json [--checkpoint DIR] [--models 270m,31b]
    python scripts/bench_jax_decode.py --tiny --out /tmp/smoke.json      # CPU smoke test, tiny shapes

Models: `270m`, the real Gemma 3 270M (a checkpoint directory; default: specdec's imported one), and `31b`,
a random Gemma 4 of the 31B's shape built directly on the device in bf16. Per model: fused-loop decode tok/s
(one lax.while_loop dispatch for all new tokens, compile and warm-up excluded), host-loop decode tok/s (one
dispatch per token) for comparison, and the roofline: measured device copy bandwidth / bytes read per decode
step, where bytes = every weight the step reads (the tied embedding once, as the LM head; one row of
per-layer embeddings) + the whole static KV cache (every allocated slot is read each step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec.evidence import git_commit
from specdec.models.config import GemmaConfig
from specdec.models.jax_gemma import load_params, random_params
from specdec.verifiers.jax_engine import JaxEngine

K_MAX = 8

# Gemma 4 31B as we understand its config (assumed, not read from a released checkpoint): 60 layers, every
# 6th full attention; sliding layers 32 query / 16 KV heads of 256; full layers k_eq_v with 4 KV heads of 512.
GEMMA4_31B = dict(
    model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504,
    num_hidden_layers=60, sliding_window_pattern=6, num_attention_heads=32, num_key_value_heads=16,
    head_dim=256, global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
    sliding_window=1024, final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    hidden_size_per_layer_input=0,
)
# The same structure at toy size, for --tiny.
GEMMA4_TINY = dict(
    GEMMA4_31B, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
    sliding_window=16,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def copy_bandwidth(num_bytes: int, reps: int = 20) -> float:
    """Bytes/s of a device-to-device elementwise copy (bytes read + bytes written), median of `reps`."""
    x = jnp.zeros(num_bytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 1)
    copy(x).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / float(np.median(times))


def bytes_per_step(cfg: GemmaConfig, params, cache) -> dict[str, int]:
    """What one batch-1 decode step must read: weights (a single row of each embedding table looked up by
    token, the full table when it is also the LM head) and every allocated KV slot."""
    weights = 0
    for name, w in params.items():
        untied_embedding = name == "embed_tokens.weight" and not cfg.tie_word_embeddings
        lookup_only = untied_embedding or name == "embed_tokens_per_layer.weight"
        weights += w.nbytes // w.shape[0] if lookup_only else w.nbytes
    kv = sum(a.nbytes for a in jax.tree.leaves((cache["keys"], cache["values"])))
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def time_decode(engine: JaxEngine, prompt: list[int], new_tokens: int, reps: int) -> tuple[float, float]:
    """(fused-loop tok/s, host-loop tok/s), best of `reps` after a warm-up run of each."""
    def fused() -> float:
        state = jax.block_until_ready(engine.begin_decode(prompt, new_tokens))
        start = time.perf_counter()
        state = jax.block_until_ready(engine.decode_fused(state, new_tokens))
        elapsed = time.perf_counter() - start
        assert int(state.generated[0]) == new_tokens
        return new_tokens / elapsed

    def host_loop() -> float:
        pending = engine.prefill([prompt])
        jax.block_until_ready(pending)
        one = jnp.ones(1, jnp.int32)
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits = engine.verify(pending[:, None]).logits
            engine.commit(one)
            pending = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            int(pending[0])  # the host reads each token, as a streaming host loop must
        return new_tokens / (time.perf_counter() - start)

    results = []
    for run in (fused, host_loop):
        start = time.perf_counter()
        run()
        log(f"  {run.__name__}: compiled and warmed up in {time.perf_counter() - start:.1f} s")
        results.append(max(run() for _ in range(reps)))
    return results[0], results[1]


def bench_model(name: str, cfg: GemmaConfig, params, prompt: list[int], args, bandwidth: float) -> dict:
    max_seq_len = -(-(len(prompt) + args.new_tokens + K_MAX + 1) // 64) * 64
    engine = JaxEngine(cfg, params, max_seq_len=max_seq_len, k_max=K_MAX)
    step_bytes = bytes_per_step(cfg, engine.params, engine.cache)
    fused, host = time_decode(engine, prompt, args.new_tokens, args.reps)
    roofline = bandwidth / step_bytes["total"]
    return {
        "model": name,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "params": int(sum(w.size for w in params.values())),
        "dtype": str(params["embed_tokens.weight"].dtype),
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "max_seq_len": max_seq_len,
        "bytes_per_step": step_bytes,
        "roofline_tok_s": roofline,
        "fused_tok_s": fused,
        "host_loop_tok_s": host,
        "fused_vs_roofline": fused / roofline,
        "fused_vs_host_loop": fused / host,
    }


def load_270m(args):
    if args.checkpoint:
        path = Path(args.checkpoint)
    else:
        from specdec.models.gguf_import import default_checkpoint

        path = default_checkpoint()
    cfg, params = load_params(path, jnp.bfloat16)
    try:
        from specdec.models.tokenizer import Tokenizer

        prompt = Tokenizer.from_dir(path).encode("def fibonacci(n):")
    except Exception as e:  # the speed does not depend on the prompt's text
        log(f"  no tokenizer ({e}); using fixed token ids")
        prompt = [2, 2063, 92861, 236769, 236749, 1473]
    return cfg, params, prompt


def build_31b(args):
    cfg = GemmaConfig.from_dict(GEMMA4_TINY if args.tiny else GEMMA4_31B)
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    prompt = [cfg.bos_token_id] + np.random.default_rng(0).integers(3, cfg.vocab_size, 31).tolist()
    return cfg, params, prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--models", default="270m,31b", help="comma-separated: 270m, 31b")
    parser.add_argument("--checkpoint", help="the 270M checkpoint directory (default: specdec's imported one)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="toy 31B-structured model and small copies (CPU smoke test)")
    args = parser.parse_args()
    device = jax.devices()[0]
    log(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")

    bandwidth = copy_bandwidth((64 << 20) if args.tiny else (4 << 30))
    log(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    builders = {
        "270m": ("gemma3-270m", load_270m),
        "31b": ("gemma4-31b-shaped-random" + ("-tiny" if args.tiny else ""), build_31b),
    }
    rows = []
    for key in args.models.split(","):
        name, build = builders[key.strip()]
        log(f"{name}: building")
        cfg, params, prompt = build(args)
        rows.append(bench_model(name, cfg, params, prompt, args, bandwidth))
        del params

    print(f"\n{device.device_kind}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; tok/s at batch 1, {args.new_tokens} new tokens")
    print(f"{'model':<30} {'GB/step':>8} {'roofline':>9} {'fused':>9} {'host loop':>10} {'fused/roof':>10} {'fused/host':>10}")
    for r in rows:
        gb = r["bytes_per_step"]["total"] / 1e9
        print(
            f"{r['model']:<30} {gb:>8.3f} {r['roofline_tok_s']:>9.1f} {r['fused_tok_s']:>9.1f} {r['host_loop_tok_s']:>10.1f}"
            f" {r['fused_vs_roofline']:>10.2f} {r['fused_vs_host_loop']:>10.2f}"
        )
    result = {
        "benchmark": "jax_fused_decode",
        "device": device.device_kind,
        "platform": device.platform,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "jax_version": jax.__version__,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "k_max": K_MAX,
        "assumed_31b_config": GEMMA4_TINY if args.tiny else GEMMA4_31B,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
