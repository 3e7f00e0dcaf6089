"""Block sizes for decode_attention's kernel, measured as a decode forward runs it: its query rows written by a short
kernel just before it (launched under PDL, as inductor's are). Every (BLOCK_M, BLOCK_S, D_BLOCK, splits at most,
warps) of each shape; the combine kernel's blocks after plan()'s kernel; then the whole attention with plan()'s
blocks (kernel and combine, compiled) against the products and softmax it replaces (compiled), each after the same
compiled elementwise kernel, in CUDA graphs. Each for forwards of 16 tokens, or of the counts --tokens gives; --plan-only
times plan()'s blocks alone. Prints the best blocks per shape and ours; us per layer.

    python scripts/tune_decode_attention.py docs/results/decode-attention-tune-h200.json [--tokens 1 5 16]
        ["31b sliding (1088)" ...]
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

from specdec.evidence import git_commit, now_utc
from specdec.models import decode_attention_torch, decode_plan

sys.path.insert(0, str(Path(__file__).parent))
from bench_split_reduction import graph_us  # noqa: E402
from tune_skinny_gemm import rows_kernel  # noqa: E402

SHAPES = {  # KV heads, query heads per KV head, slots, head_dim, sliding window (0: none)
    "270m sliding": (1, 4, 576, 256, 512), "270m full (1024)": (1, 4, 1024, 256, 0),
    "e4b sliding": (2, 4, 576, 256, 512),
    # Past 1,024 slots: the 31B's sliding ring (17 splits since fbdfcad), the 270M's full layers at 2,048 (32).
    "31b sliding (1088)": (16, 2, 1088, 256, 1024), "270m full (2048)": (1, 4, 2048, 256, 0),
}
LAYERS = 18


def inputs(nkv: int, groups: int, slots: int, head_dim: int, window: int, tokens: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, nkv, tokens * groups, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    # A cache per layer, as a forward reads them: the 31B's 18 layers' (320 MB) are not in L2 when read.
    keys, values = ([torch.randn(1, nkv, slots, head_dim, device="cuda", generator=g).to(torch.bfloat16)
                     for _ in range(LAYERS)] for _ in range(2))
    stored = torch.arange(slots, device="cuda")[None]
    highest = torch.arange(slots - tokens, slots, device="cuda")[None]
    lowest = (highest - window + 1).clamp(min=0) if window else torch.zeros_like(highest)
    return q, keys, values, stored, lowest, highest


def configs(slots: int, head_dim: int):
    for block_m, block_s, d_block, most, warps in itertools.product((16, 32, 64), (16, 32, 64), (128, 256), (16, 32),
                                                                     (4, 8)):
        if d_block > head_dim or (head_dim == 512 and block_s == 64) or (block_m == 16 and warps == 8):
            continue
        blocks = -(-slots // block_s)
        chunk = block_s * -(-blocks // most)
        yield {"splits": -(-slots // chunk), "chunk": chunk, "BLOCK_S": block_s, "BLOCK_M": block_m,
               "D_BLOCK": d_block, "num_warps": warps}


def chain_us(config: dict, q, keys, values, stored, lowest, highest, groups: int,
             combine_blocks: tuple[int, int] | None = None) -> float:
    """us per (rows kernel, attention kernel of `config`) pair, LAYERS of them back to back in one CUDA graph; with
    `combine_blocks` (rows, value columns), each followed by the combine kernel in those blocks."""
    src, rows = q.clone(), q.view(-1, q.shape[-1])
    partials = decode_attention_torch.empty_partials(q, config["splits"])
    out = q.new_empty(q.shape[0], q.shape[2] // groups, q.shape[1] * groups * q.shape[3])
    block = triton.next_power_of_2(q.shape[-1])

    def chain():
        for layer in range(LAYERS):
            rows_kernel[(rows.shape[0],)](src, q, q.shape[-1], BLOCK=block, launch_pdl=True)
            decode_attention_torch.launch(q, keys[layer], values[layer], stored, lowest, highest, 0.0625, groups, config,
                                    partials)
            if combine_blocks is not None:
                decode_attention_torch.combine(partials, out, groups, *combine_blocks)

    return graph_us(chain, LAYERS, 5)


def whole_us(q, keys, values, stored, lowest, highest, groups: int) -> dict:
    """us per layer of the compiled attention after a compiled elementwise kernel: plan()'s kernel and combine, and
    the products and softmax it replaces."""
    from specdec.engines.verifier_torch import _configure_compile

    _configure_compile()
    mask = ((stored[:, None, :] >= lowest[:, :, None]) & (stored[:, None, :] <= highest[:, :, None]))
    mask = mask.repeat_interleave(groups, dim=1)[:, None]

    def kernel(x, keys, values):
        out = decode_attention_torch.attend((x.float() * 1.5).to(x.dtype), keys, values, stored, lowest, highest, 0.0625,
                                      groups)
        return out.view(x.shape)  # the next layer's query

    def products(x, keys, values):
        x = (x.float() * 1.5).to(x.dtype)
        scores = (x @ keys.transpose(-1, -2) * 0.0625).masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(x.dtype) @ values

    result = {}
    for name, fn in (("kernel", kernel), ("products", products)):
        compiled = torch.compile(fn, fullgraph=True)
        outs = [q]

        def chain():
            for layer in range(LAYERS):
                outs.append(compiled(outs[-1], keys[layer], values[layer]))
                outs.pop(0)

        result[name] = graph_us(chain, LAYERS, 5)
    return result


def main(out: str, names: list[str], token_counts: list[int], plan_only: bool) -> None:
    results = []
    ours = (decode_attention_torch.COMBINE_BLOCK_M, decode_attention_torch.COMBINE_D_BLOCK)
    for tokens, name in itertools.product(token_counts, names or SHAPES):
        nkv, groups, slots, head_dim, window = SHAPES[name]
        tensors = inputs(nkv, groups, slots, head_dim, window, tokens)
        planned = decode_plan.plan(slots, head_dim, nkv)
        planned_us = chain_us(planned, *tensors, groups)
        timed = sorted(((chain_us(c, *tensors, groups), c) for c in configs(slots, head_dim) if not plan_only),
                       key=lambda pair: pair[0]) or [(planned_us, planned)]
        whole = whole_us(*tensors, groups)
        combines = sorted((chain_us(planned, *tensors, groups, blocks), blocks)
                          for blocks in ([ours] if plan_only else itertools.product((8, 16, 32), (32, 64, 128))))
        results.append({"shape": name, "tokens": tokens, "best": [{"us": us, **c} for us, c in timed[:5]],
                        "plan": {"us": planned_us, **planned}, "whole_layer_us": whole,
                        "with_combine_us": [{"us": us, "BLOCK_M": m, "D_BLOCK": d} for us, (m, d) in combines]})
        label = f"{name} T={tokens}"
        print(f"{label:24s} best {timed[0][0]:5.2f} us {timed[0][1]}\n{'':24s} plan {planned_us:5.2f} us; "
              f"compiled layer: kernel+combine {whole['kernel']:5.2f} us, products+softmax {whole['products']:5.2f} us")
        print(f"{'':24s} with the combine: best {combines[0][0]:5.2f} us {combines[0][1]}, ours "
              f"{next(us for us, blocks in combines if blocks == ours):5.2f} us {ours}")
    Path(out).write_text(json.dumps({"benchmark": "tune_decode_attention", "date": now_utc(), "commit": git_commit(),
                                     "device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("shapes", nargs="*", help=f"of {list(SHAPES)} (default: all)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16])
    parser.add_argument("--plan-only", action="store_true", help="time plan()'s blocks alone: no sweep")
    args = parser.parse_args()
    if unknown := set(args.shapes) - set(SHAPES):
        parser.error(f"unknown shapes {sorted(unknown)}; known: {list(SHAPES)}")
    main(args.out, args.shapes, args.tokens, args.plan_only)
