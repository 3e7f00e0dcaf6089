"""The fused norm + GEMM kernel (specdec.models.fused_kernels) against what the compiled forward runs in its place
(inductor's norm kernel, cuBLAS's GEMM, and for gate/up the GELU kernel), at a decode forward's 16 rows, each in a
CUDA graph of 20 calls; over block sizes and warps. Prints us per call and writes JSON.

    python scripts/bench_fused_norm_linear.py --out docs/results/fused-norm-linear-h100.json"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.evidence import git_commit, now_utc
from specdec.models import fused_kernels
from specdec.models.config import GemmaConfig
from specdec.models.torch_gemma import gelu_gate, rms_norm
from specdec.verifiers.torch_engine import compiled

SHAPES = {  # name: (hidden, columns per accumulator, gated)
    "270m q/k/v": (640, 1536, False),
    "270m gate/up": (640, 2048, True),
    "e4b q/k/v": (2560, 3072, False),
    "e4b gate/up": (2560, 10240, True),
}
CALLS = 20


def graph_us(fn, reps: int = 30) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / reps / CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("fused-norm-linear.json"))
    args = parser.parse_args()
    cfg = GemmaConfig(model_type="gemma3_text", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=8, layer_types=("full_attention",), sliding_window=8,
                      rope={})
    rows = []
    for name, (hidden, columns, gated) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        rand = lambda *shape, scale=1.0: torch.randn(*shape, device="cuda", generator=g).mul(scale).bfloat16()  # noqa: E731
        base, delta = rand(16, hidden), rand(16, hidden, scale=3.0)
        dw, nw = rand(hidden, scale=0.1), rand(hidden, scale=0.1)
        weight = rand(2 * columns if gated else columns, hidden, scale=hidden**-0.5)

        def unfused(base=base, delta=delta, dw=dw, nw=nw, weight=weight, gated=gated):
            stream = base + rms_norm(delta, dw, cfg)
            out = F.linear(rms_norm(stream, nw, cfg), weight)
            return (gelu_gate(*out.chunk(2, dim=-1)) if gated else out), stream

        reference = compiled(unfused)
        want = reference()
        ref_us = graph_us(reference)
        print(f"{name:14s} unfused (compiled) {ref_us:7.2f} us", flush=True)
        for block_n, block_k, warps in itertools.product((16, 32, 64), (64, 128), (4, 8)):
            out = torch.empty(16, columns, device="cuda", dtype=torch.bfloat16)
            stream = torch.empty_like(base)
            grid = (-(-columns // block_n), 1)

            def fused(block_n=block_n, block_k=block_k, warps=warps, out=out, stream=stream, grid=grid,
                      base=base, delta=delta, dw=dw, nw=nw, weight=weight, hidden=hidden, columns=columns,
                      gated=gated):
                fused_kernels._norm_linear_kernel[grid](
                    base, delta, dw, nw, weight, out, stream, 16, hidden, columns,
                    base.stride(0), delta.stride(0), weight.stride(0), out.stride(0), stream.stride(0),
                    cfg.rms_norm_eps, cfg.norm_weight_offset, HAS_DELTA=True, GEMMA4=False, GELU=gated,
                    BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)

            try:
                fused()
                torch.cuda.synchronize()
            except Exception as error:  # a configuration the compiler refuses (shared memory, registers)
                print(f"  BN={block_n} BK={block_k} w={warps}: {type(error).__name__}", flush=True)
                continue
            err = (out.float() - want[0].float()).abs().max().item() / want[0].float().abs().max().item()
            us = graph_us(fused)
            rows.append({"shape": name, "block_n": block_n, "block_k": block_k, "warps": warps, "fused_us": us,
                         "unfused_us": ref_us, "relative_error": err})
        best = sorted((r for r in rows if r["shape"] == name), key=lambda r: r["fused_us"])[:4]
        for r in best:
            print(f"  BN={r['block_n']:3d} BK={r['block_k']:3d} w={r['warps']}: {r['fused_us']:7.2f} us"
                  f" ({r['fused_us'] / ref_us:.2f}x unfused), rel err {r['relative_error']:.1e}", flush=True)
    record = {"benchmark": "fused_norm_linear", "date": now_utc(), "commit": git_commit(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
