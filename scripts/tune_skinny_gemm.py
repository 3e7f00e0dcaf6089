"""Block sizes for skinny_gemm's split products, measured as a decode forward runs them: each product's rows written
by a short kernel just before it (a stand-in for the norm or GELU a layer runs there, launched under PDL as
inductor's are), so the product can load its weight while that kernel runs. Every (splits, BLOCK_N, BLOCK_K)
of each shape, against cuBLAS's product and the batched GEMM (gemma_torch.reduction_splits) after the same
kernel, in CUDA graphs cycling through at least 100 MB of weight copies (L2 holds none). Prints the best per shape
and what splits() and plan() pick; us per (kernel, product) pair.

    python scripts/tune_skinny_gemm.py docs/results/skinny-gemm-tune-h100.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.evidence import git_commit, now_utc
from specdec.models import skinny_gemm
from specdec.models.gemma_torch import reduction_splits, split_products

sys.path.insert(0, str(Path(__file__).parent))
from bench_split_reduction import ROWS  # noqa: E402
from bench_split_reduction import SHAPES as BENCH_SHAPES  # noqa: E402
from bench_split_reduction import graph_us, weight_copies

SHAPES = {name: shape for name, shape in BENCH_SHAPES.items()  # the 270M's and E4B's, but E4B's gate/up (105 MB)
          if name.startswith("270m") or (name.startswith("e4b") and "gate/up" not in name)}


@triton.jit
def rows_kernel(src, dst, width, BLOCK: tl.constexpr):
    """dst = src * 1.0 row by row, waiting for the kernel before it as inductor's kernels do under PDL."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    tl.extra.cuda.gdc_wait()
    values = tl.load(src + row * width + cols, mask=cols < width)
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(dst + row * width + cols, values, mask=cols < width)


def us_per_pair(product, weights, src, x, reps=10):
    """us per (rows kernel, product) pair, the pairs back to back in one CUDA graph."""
    block = triton.next_power_of_2(x.shape[1])

    def chain():
        for w in weights:
            rows_kernel[(x.shape[0],)](src, x, x.shape[1], BLOCK=block, launch_pdl=True)
            product(x, w)

    return graph_us(chain, len(weights), reps)


def main(out: str) -> None:
    torch.manual_seed(0)
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, (columns, reduction) in SHAPES.items():
        weights = weight_copies(columns, reduction, 100_000_000)
        src = torch.randn(ROWS, reduction, device="cuda", dtype=torch.bfloat16)
        x = torch.empty_like(src)
        engine_splits = reduction_splits(ROWS, columns, reduction)
        row = dict(shape=name, MB=round(columns * reduction * 2 / 1e6, 2), bmm_splits=engine_splits,
                   cublas_us=us_per_pair(F.linear, weights, src, x))
        if engine_splits > 1:
            row["bmm_us"] = us_per_pair(lambda x, w: split_products(x, w, engine_splits), weights, src, x)
        kernel_splits = skinny_gemm.splits(reduction)
        config = skinny_gemm.plan(ROWS, columns, kernel_splits, reduction // kernel_splits, processors)
        row["plan"] = dict(splits=kernel_splits, **config, taken=skinny_gemm.takes(weights[0], ROWS))
        row["plan_us"] = us_per_pair(lambda x, w: torch.ops.specdec.split_products(x, w, kernel_splits),
                                     weights, src, x)
        sweep = []
        for splits in (1, 2, 4, 8, 16):
            if reduction % (16 * splits):
                continue
            part = reduction // splits
            for block_n in (16, 32, 64, 128):
                for block_k in (64, 128, 256, 512):
                    if (block_k > max(64, triton.next_power_of_2(part)) or block_n * block_k > 128 * 256
                            or part > 8 * block_k):
                        continue
                    config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, STEPS=-(-part // block_k),
                                  num_warps=4 if block_n * block_k <= 16 * 512 else 8)
                    buffer = torch.empty(splits, ROWS, columns, device="cuda", dtype=torch.float32)
                    us = us_per_pair(lambda x, w: skinny_gemm.launch(x, w, splits, config, buffer), weights, src, x)
                    sweep.append(dict(splits=splits, **config, us=us))
        row["sweep"] = sorted(sweep, key=lambda r: r["us"])
        best = row["sweep"][0]
        results.append(row)
        print(f"{name:30s} {row['MB']:6.1f} MB  cuBLAS {row['cublas_us']:6.2f}  bmm {row.get('bmm_us', '-')}  "
              f"plan {row.get('plan_us', '-')}  best {best['us']} (S{best['splits']} N{best['BLOCK_N']} "
              f"K{best['BLOCK_K']} w{best['num_warps']})", flush=True)
        del weights
    json.dump(dict(benchmark="tune_skinny_gemm", date=now_utc(), commit=git_commit(),
                   device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   rows=ROWS, results=results), open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
