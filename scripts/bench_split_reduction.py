"""16-row bf16 products on a GPU (a decode forward's invariant width): F.linear (cuBLAS) against the reduction
split into a batched GEMM over S slices of the input (gemma_torch.split_products), the slices' products
not yet summed (bmmS_us: in the compiled engine the kernel that reads them adds them), and on Hopper
skinny_gemm's kernel for the same slices (kernelS_us; each call launched under PDL, so it loads its weight while
the call before it runs). Each timed in a CUDA graph that cycles through at least 200 MB of weight copies, so L2
holds none of them.

    python scripts/bench_split_reduction.py docs/results/gemm-split-reduction-h200.json
"""

import json
import sys

import torch
import torch.nn.functional as F

from specdec.engines.verifier_torch import capture_graph
from specdec.models import skinny_gemm
from specdec.models.gemma_torch import split_products

ROWS = 16
SHAPES = {  # output columns, reduction
    "e4b qkv 2560->3072": (3072, 2560), "e4b q 2560->2048": (2048, 2560), "e4b o_proj 2048->2560": (2560, 2048),
    "e4b per-layer gate 2560->256": (256, 2560), "e4b per-layer proj 256->2560": (2560, 256),
    "e4b gate/up 2560->20480": (20480, 2560), "e4b down 10240->2560": (2560, 10240),
    "270m qkv 640->1536": (1536, 640), "270m o_proj 1024->640": (640, 1024), "270m gate/up 640->4096": (4096, 640),
    "270m down 2048->640": (640, 2048),
    "31b o_proj sliding 8192->5376": (5376, 8192), "31b o_proj global 16384->5376": (5376, 16384),
    "31b qkv sliding 5376->16384": (16384, 5376), "31b q/k global 5376->18432": (18432, 5376),
    "31b down 21504->5376": (5376, 21504), "31b gate/up 5376->43008": (43008, 5376),
}


def graph_us(calls, count: int, reps: int) -> float:
    """us per call of `calls` (a function that makes `count` calls), captured `reps` times in one CUDA graph after
    warm-up runs: the best of 5 replays."""
    graph, _ = capture_graph(lambda: [calls() for _ in range(reps)])
    for _ in range(3):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, begin.elapsed_time(end) * 1e3 / (reps * count))
    return round(best, 2)


def weight_copies(columns: int, reduction: int, total_bytes: int) -> list[torch.Tensor]:
    """bf16 weights [columns, reduction], at least two and at least `total_bytes` in all, so that L2 holds none."""
    return [torch.randn(columns, reduction, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(max(2, -(-total_bytes // (columns * reduction * 2))))]


def us_per_call(fn, weights, x, reps=20):
    def calls():
        for w in weights:
            fn(x, w)

    return graph_us(calls, len(weights), reps)


def main(out: str) -> None:
    torch.manual_seed(0)
    rows = []
    for name, (columns, reduction) in SHAPES.items():
        weights = weight_copies(columns, reduction, 200_000_000)
        x = torch.randn(ROWS, reduction, device="cuda", dtype=torch.bfloat16)
        row = dict(shape=name, MB=round(columns * reduction * 2 / 1e6, 2), linear_us=us_per_call(F.linear, weights, x))
        for splits in (2, 3, 4, 6, 8, 16):
            if reduction % (64 * splits):
                continue
            row[f"bmm{splits}_us"] = us_per_call(lambda x, w: split_products(x, w, splits), weights, x)
            if skinny_gemm.available():
                row[f"kernel{splits}_us"] = us_per_call(
                    lambda x, w: torch.ops.specdec.split_products(x, w, splits), weights, x)
        rows.append(row)
        print(f"{name:32s} {row['MB']:8.1f} MB  cuBLAS {row['linear_us']:7.2f} us  "
              + "  ".join(f"{k[:-3]} {v}" for k, v in row.items() if k.endswith("_us") and k != "linear_us"),
              flush=True)
        del weights
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
