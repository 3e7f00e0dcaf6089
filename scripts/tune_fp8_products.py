"""FP8 products of a decode forward's few rows in the torch engine (skinny_gemm's kernel with FP8 weights and their
scales), measured as tune_skinny_gemm.py measures: each product after a short PDL kernel that writes its rows, in CUDA
graphs cycling through at least 200 MB of weight copies. Per shape: cuBLAS's bf16 product, the product the bf16
engine runs (gemma_torch.linear, compiled), the FP8 kernel at what skinny_gemm.fp8_splits() and plan() pick, and a sweep
of its slices and blocks (a loop over the slice pipelined STAGES deep where it takes several steps). us per (kernel,
product) pair, and the FP8 weight's TB/s.

    python scripts/tune_fp8_products.py --out docs/results/fp8-products-torch-h200.json [--shapes 31b,e4b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

from specdec.evidence import git_commit, now_utc
from specdec.models import fp8_torch, skinny_gemm
from specdec.models.gemma_torch import linear

sys.path.insert(0, str(Path(__file__).parent))
from bench_split_reduction import SHAPES as BENCH_SHAPES  # noqa: E402
from bench_split_reduction import weight_copies  # noqa: E402
from tune_skinny_gemm import us_per_pair  # noqa: E402

ROWS = 8  # the invariant width of k_max 1-7, generate's default
SHAPES = BENCH_SHAPES | {"270m lm_head 640->262144": (262144, 640), "e4b lm_head 2560->262144": (262144, 2560),
                         "31b lm_head 5376->262144": (262144, 5376)}


def configs(columns: int, reduction: int) -> list[tuple[int, dict]]:
    """(splits, plan-like config) to sweep: slices of 128 or more, column blocks of 16-128, 128-512 deep steps, the
    steps unrolled (up to 4) or pipelined 4 deep."""
    out = []
    for splits in (1, 2, 4, 8, 16):
        part = reduction // splits
        if reduction % (16 * splits) or part < 128:
            continue
        for block_n in (16, 32, 64, 128):
            for block_k in (128, 256, 512):
                steps = -(-part // block_k)
                if block_k > triton.next_power_of_2(part) or steps > 64:
                    continue
                for stages in ((0,) if steps <= 4 else ()) + ((4,) if steps > 1 else ()):
                    out.append((splits, dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, STEPS=steps,
                                             STAGES=stages, num_warps=4 if block_n * block_k <= 16 * 512 else 8)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="", help="comma-separated prefixes of shape names (default: all)")
    parser.add_argument("--budget-s", type=float, default=500, help="stop sweeping once this much time has passed")
    args = parser.parse_args()
    from specdec.engines.verifier_torch import _configure_compile

    _configure_compile()
    for limit in ("recompile_limit", "cache_size_limit"):  # one compiled linear per shape and dtype
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 1024)
    torch.manual_seed(0)
    start = time.perf_counter()
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    prefixes = [p for p in args.shapes.split(",") if p]
    results = []
    for name, (columns, reduction) in SHAPES.items():
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        src = torch.randn(ROWS, reduction, device="cuda", dtype=torch.bfloat16)
        x = torch.empty_like(src)
        row = dict(shape=name, fp8_MB=round(columns * reduction / 1e6, 2))
        weights = weight_copies(columns, reduction, 200_000_000)
        row["cublas_bf16_us"] = us_per_pair(torch.nn.functional.linear, weights, src, x)
        engine = torch.compile(linear, fullgraph=True, dynamic=False)
        row["engine_bf16_us"] = us_per_pair(engine, weights, src, x)
        del weights
        # as many copies at a byte a weight: (values, scale) pairs of at least 200 MB
        weights = [fp8_torch.quantize(w) for w in weight_copies(columns, reduction, 400_000_000)]
        splits = skinny_gemm.fp8_splits(ROWS, columns, reduction)
        config = skinny_gemm.plan(ROWS, columns, splits, reduction // splits, processors, itemsize=1)
        row["plan"] = dict(splits=splits, **config)
        row["plan_fp8_us"] = us_per_pair(lambda x, w: engine(x, *w), weights, src, x)
        reference = fp8_torch.product(src.float(), *weights[0]).double()  # float32 arithmetic, cuBLAS
        error = (engine(src, *weights[0]).double() - reference).abs().max() / reference.abs().max()
        row["plan_fp8_error"] = float(error)  # relative to the largest output: bf16 rounding, ~2^-9
        sweep = []
        for splits, config in configs(columns, reduction):
            if time.perf_counter() - start > args.budget_s:
                row["sweep_cut"] = True
                break
            buffer = torch.empty(splits, ROWS, columns, device="cuda", dtype=torch.float32)
            try:
                us = us_per_pair(lambda x, w: skinny_gemm.launch(x, w[0], splits, config, buffer, w[1]), weights,
                                 src, x)
            except triton.runtime.errors.OutOfResources:  # pipelined stages past the shared memory
                continue
            sweep.append(dict(splits=splits, **config, us=us))
        row["sweep"] = sorted(sweep, key=lambda r: r["us"])
        best = row["sweep"][0] if sweep else {}
        results.append(row)
        tbs = lambda us: round(columns * reduction / us / 1e6, 2)  # noqa: E731
        print(f"{name:32s} {row['fp8_MB']:7.1f} MB  cuBLAS bf16 {row['cublas_bf16_us']:7.2f}  engine bf16 "
              f"{row['engine_bf16_us']:7.2f}  fp8 plan {row['plan_fp8_us']:7.2f} ({tbs(row['plan_fp8_us'])} TB/s, "
              f"error {row['plan_fp8_error']:.1e})  "
              + (f"best {best['us']:7.2f} ({tbs(best['us'])} TB/s; S{best['splits']} N{best['BLOCK_N']} "
                 f"K{best['BLOCK_K']} x{best['STEPS']} st{best['STAGES']} w{best['num_warps']})" if best else ""),
              flush=True)
        del weights
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(dict(benchmark="tune_fp8_products", date=now_utc(), commit=git_commit(),
                   device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   rows=ROWS, results=results), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
