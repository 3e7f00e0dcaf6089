"""Speculative decoding benchmark: ours (PyTorch and JAX engines, plain and n-gram K=2..8) against
transformers' `generate` (plain and prompt lookup), side by side in one run, on the same prompts.

    python scripts/bench_spec.py --target DIR [--new-tokens 128] [--out bench.json]

Every speculative run is checked against the same engine's plain decode: "same" (token-identical) or
"DIFF@i" (first differs at token i; with the invariant forwards, the default, that is a bug). The table gives tok/s (wall time of a whole generation, prefill
included, best of two after a warm-up run), tau and ratios.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec import gates
from specdec.evidence import git_commit, now_utc

PROMPTS = {
    "code": '''import json
from dataclasses import dataclass


@dataclass
class User:
    name: str
    email: str
    age: int

    def to_dict(self) -> dict:
        return {"name": self.name, "email": self.email, "age": self.age}

    @classmethod
    def from_dict(cls, data: dict) -> "User":
        return cls(name=data["name"], email=data["email"], age=data["age"])


@dataclass
class Order:
    order_id: int
    user: User
    items: list
    total: float

    def to_dict(self) -> dict:
''',
    "prose": "The old lighthouse keeper climbed the narrow stairs one last time. At the top, he looked out over the "
    "grey sea and remembered the night of the great storm, when the light had failed and",
}
KS = (2, 3, 4, 5, 6, 8)


def losslessness(eut, prompt: list[int], plain: list[int], spec: list[int]) -> str:
    if spec == plain:
        return "same"
    return f"DIFF@{gates.divergence(eut, prompt, plain, spec)['first_divergence']}"


def timed(fn, repeats=2):
    """Best wall time of `repeats` runs after one warm-up; returns (seconds, last result)."""
    import torch

    result = fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_torch(target: Path, prompts: dict, new_tokens: int, dtype: str, rows: list):
    import torch

    from specdec.drafters.ngram import NgramDrafter
    from specdec.generate import StopCondition, run_cycles, speculative_generate
    from specdec.models.torch_gemma import GemmaModel
    from specdec.verifiers.torch_engine import FusedCycle, TorchEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GemmaModel.from_checkpoint(target, dtype=getattr(torch, dtype), device=device, max_seq_len=2048)
    engine = TorchEngine(model, max_seq_len=2048, k_max=max(KS))
    eut = gates.torch_engines(model, graphs=engine.use_graphs)[-1]
    for name, ids in prompts.items():
        secs, out = timed(lambda: engine.greedy_decode(ids, new_tokens))
        rows.append(dict(engine="torch", method="plain", prompt=name, k=0, tok_s=len(out) / secs, tau=1.0, lossless="base"))
        for k in KS:
            stop = StopCondition(new_tokens)
            secs, gen = timed(lambda: speculative_generate(engine, NgramDrafter(), [ids], k, stop))
            rows.append(dict(engine="torch", method="ngram host loop", prompt=name, k=k, tok_s=len(gen.tokens[0]) / secs,
                             tau=gen.stats.tau, lossless=losslessness(eut, ids, out, gen.tokens[0])))
            cycle = FusedCycle(engine, NgramDrafter().device_draft_fn("torch", k), k)
            secs, gen = timed(lambda: run_cycles(cycle, [ids], k, stop))
            rows.append(dict(engine="torch", method="ngram fused graph", prompt=name, k=k, tok_s=len(gen.tokens[0]) / secs,
                             tau=gen.stats.tau, lossless=losslessness(eut, ids, out, gen.tokens[0])))
    del engine, model, eut
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # leave the memory to the JAX engine that runs next


def bench_jax(target: Path, prompts: dict, new_tokens: int, dtype: str, rows: list):
    import jax.numpy as jnp

    from specdec.drafters.ngram import NgramDrafter
    from specdec.verifiers.jax_engine import JaxEngine

    engine = JaxEngine.from_checkpoint(target, dtype=getattr(jnp, dtype), max_seq_len=2048, k_max=max(KS))
    (eut,) = gates.jax_engines(engine)
    draft_fns = {k: NgramDrafter().device_draft_fn("jax", k) for k in KS}
    for name, ids in prompts.items():
        secs, out = timed(lambda: engine.generate_fused(ids, new_tokens))
        rows.append(dict(engine="jax", method="plain fused loop", prompt=name, k=0, tok_s=len(out) / secs, tau=1.0,
                         lossless="base"))
        for k in KS:
            def run():
                state = engine.decode_fused(engine.begin_decode(ids, new_tokens, draft_fns[k]), new_tokens, (), draft_fns[k])
                return state, engine.emitted_tokens(state, len(ids), new_tokens)

            secs, (state, spec) = timed(run)
            tau = float(state.generated[0]) / max(int(state.cycles[0]), 1)
            rows.append(dict(engine="jax", method="ngram fused loop", prompt=name, k=k, tok_s=len(spec) / secs, tau=tau,
                             lossless=losslessness(eut, ids, out, spec)))


def bench_transformers(target: Path, prompts: dict, new_tokens: int, dtype: str, rows: list):
    import torch
    from transformers import Gemma3ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Gemma3ForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).to(device).eval()
    for name, ids in prompts.items():
        inputs = torch.tensor([ids], device=device)
        for label, extra in [("plain", {}), ("prompt lookup 10", {"prompt_lookup_num_tokens": 10})]:
            def run():
                with torch.inference_mode():
                    return model.generate(inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)

            secs, out = timed(run)
            rows.append(dict(engine="transformers", method=label, prompt=name, k=10 if extra else 0,
                             tok_s=(out.shape[1] - len(ids)) / secs, tau=None, lossless=None))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engines", default="torch,jax,transformers")
    parser.add_argument("--out", type=Path, default=Path("bench_spec.json"))
    args = parser.parse_args()

    import torch

    from specdec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.target)
    prompts = {name: tok.encode(text) for name, text in PROMPTS.items()}
    engines = args.engines.split(",")
    rows: list[dict] = []
    if "torch" in engines:
        bench_torch(args.target, prompts, args.new_tokens, args.dtype, rows)
    if "jax" in engines:
        bench_jax(args.target, prompts, args.new_tokens, args.dtype, rows)
    if "transformers" in engines:
        bench_transformers(args.target, prompts, args.new_tokens, args.dtype, rows)

    def base(prompt, engine, method):
        return next((r["tok_s"] for r in rows if r["prompt"] == prompt and r["engine"] == engine and r["method"] == method), None)

    for r in rows:
        ours_plain = base(r["prompt"], "torch", "plain")
        hf_plain = base(r["prompt"], "transformers", "plain")
        r["vs_our_plain"] = r["tok_s"] / ours_plain if ours_plain else None
        r["vs_hf_plain"] = r["tok_s"] / hf_plain if hf_plain else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    commit = git_commit()
    record = {"device": device, "date": now_utc(), "commit": commit, "dtype": args.dtype,
              "new_tokens": args.new_tokens, "prompt_tokens": {k: len(v) for k, v in prompts.items()}, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"\n{device} · {args.dtype} · {args.new_tokens} new tokens · commit {commit}")
    print(f"{'engine':13} {'method':18} {'prompt':6} {'k':>2} {'tok/s':>8} {'tau':>5} {'/our plain':>10} {'/hf plain':>9} lossless")
    for r in rows:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{r['engine']:13} {r['method']:18} {r['prompt']:6} {r['k']:>2} {r['tok_s']:8.1f} {fmt(r['tau'], '5.2f'):>5} "
              f"{fmt(r['vs_our_plain'], '10.2f'):>10} {fmt(r['vs_hf_plain'], '9.2f'):>9} {r['lossless'] or '-'}")


if __name__ == "__main__":
    main()
