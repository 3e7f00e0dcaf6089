"""How far FP8 linears move a model's greedy choices: on each prompt of the packaged set, the model's own greedy
tokens (its weights in the engine's dtype), then both forwards teacher-forced over prompt + those tokens, and at each
generated position whether FP8's argmax is the reference's; FP8's own greedy decode's first token that differs too.
Writes JSON (device, date, commit) and prints a table.

    python scripts/fp8_agreement.py --tokens 64 --out docs/results/fp8-agreement-cpu-270m.json
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec.evidence import git_commit, now_utc
from specdec.models import jax_gemma
from specdec.models.gguf_import import default_checkpoint
from specdec.models.tokenizer import Tokenizer
from specdec.verifiers.jax_engine import JaxEngine


def greedy_choices(engine: JaxEngine, sequence: list[int]) -> np.ndarray:
    """The argmax at every position of one prefill forward over `sequence` (nothing committed)."""
    tokens = jnp.asarray([sequence], jnp.int32)
    positions = jnp.arange(len(sequence), dtype=jnp.int32)[None]
    logits = jax.jit(lambda p, c: jax_gemma.forward(p, engine.cfg, tokens, positions, c)[0])(engine.params,
                                                                                           engine.cache)
    return np.asarray(jnp.argmax(logits[0], axis=-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help="a checkpoint directory [default: the embedded Gemma 3 270M]")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=12, help="the first N prompts of the packaged set")
    parser.add_argument("--out", type=Path, default=Path("fp8-agreement.json"))
    args = parser.parse_args()
    path = args.target or default_checkpoint()
    tokenizer = Tokenizer.from_dir(path)
    rows = [json.loads(line) for line in (resources.files("specdec") / "prompts" / "bench.jsonl").read_text().splitlines()
            if line.strip()][: args.prompts]
    context = max(len(tokenizer.encode(r["prompt"])) for r in rows) + args.tokens + 16
    reference, fp8 = (JaxEngine.from_checkpoint(path, fp8=f, max_seq_len=context, k_max=1) for f in (False, True))
    results = []
    for row in rows:
        prompt = tokenizer.encode(row["prompt"])
        own = reference.generate(prompt, args.tokens)
        own_fp8 = fp8.generate(prompt, args.tokens)
        sequence = prompt + own
        chosen, chosen_fp8 = (greedy_choices(e, sequence)[len(prompt) - 1: -1] for e in (reference, fp8))
        differs = [i for i, (a, b) in enumerate(zip(own, own_fp8)) if a != b]
        results.append({"id": row.get("id"), "kind": row.get("kind"), "prompt_tokens": len(prompt),
                        "teacher_forced_agreement": float(np.mean(chosen == chosen_fp8)),
                        "first_difference": differs[0] if differs else None})
    record = {"benchmark": "fp8_agreement", "date": now_utc(), "commit": git_commit(),
              "device": jax.devices()[0].device_kind, "dtype": str(reference.params["embed_tokens.weight"].dtype),
              "target": str(path), "tokens": args.tokens, "prompts": results,
              "mean_agreement": float(np.mean([r["teacher_forced_agreement"] for r in results]))}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"{record['device']} · {record['dtype']} activations · {args.tokens} greedy tokens a prompt")
    print(f"{'prompt':<24} {'kind':<6} {'argmax agreement':>17} {'FP8 greedy differs from':>24}")
    for r in results:
        first = "never" if r["first_difference"] is None else f"token {r['first_difference']}"
        print(f"{str(r['id'])[:24]:<24} {str(r['kind']):<6} {r['teacher_forced_agreement']:>17.3f} {first:>24}")
    print(f"mean argmax agreement {record['mean_agreement']:.3f}")


if __name__ == "__main__":
    main()
