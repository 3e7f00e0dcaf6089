"""The 31B shape tensor-parallel in the PyTorch engine: step time and greedy tokens on N devices, one process per
device over torch.distributed (NCCL on GPUs, gloo on the CPU), random weights at the real shapes, bf16 on CUDA.

    torchrun --nproc-per-node 1 scripts/bench_tensor_parallel.py --out tp1.json
    torchrun --nproc-per-node 2 scripts/bench_tensor_parallel.py --out tp2.json
    python scripts/bench_tensor_parallel.py --compare tp1.json tp2.json --plot tp.png
    torchrun --nproc-per-node 2 scripts/bench_tensor_parallel.py --tiny --out tiny.json   # CPU smoke test

Each run reports the plain decode step (the fused cycle with k = 0: one CUDA-graph replay and a host sync,
median over cycles), the bytes one device reads per step (its weight slices, the LM head's included, and
the replicated tensors, plus the KV cache it holds) and the device's measured copy bandwidth, so roofline =
bytes / bandwidth per device. `--compare` prints the step time against one device, the fraction of the
devices' combined roofline, and whether greedy tokens are identical to the single device's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from specdec.evidence import git_commit
from specdec.generate import StopCondition, run_cycles
from specdec.models.config import GemmaConfig
from specdec.models.torch_gemma import GemmaModel
from specdec.verifiers.torch_engine import FusedCycle, TorchEngine

sys.path.insert(0, str(Path(__file__).parent))
from bench_drafter_cycles import time_cycles  # noqa: E402
from bench_roofline import GEMMA4_31B, GEMMA4_TINY  # noqa: E402


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted once each, as a step reads)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def run(args) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    group = dist.group.WORLD if world > 1 else None
    raw = dict(GEMMA4_TINY, num_global_key_value_heads=2) if args.tiny else GEMMA4_31B  # global KV heads split too
    cfg = GemmaConfig.from_dict(raw)
    dtype = torch.bfloat16 if cuda else torch.float32
    context = 1024
    model = GemmaModel.random(cfg, dtype, device, context, seed=0, tp_group=group)
    engine = TorchEngine(model, max_seq_len=context, k_max=8, cuda_graphs=cuda, compile=args.compile)
    prompt = list(np.random.default_rng(0).integers(3, cfg.vocab_size, 128))
    with torch.inference_mode():
        tokens = run_cycles(FusedCycle(engine, None, 0), [prompt], 0, StopCondition(args.tokens)).tokens[0]
        step = time_cycles(FusedCycle(engine, None, 0), prompt, args.cycles)
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    cache = engine.cache
    cache_bytes = sum(t.numel() * t.element_size() for t in cache.keys + cache.values if t is not None)
    bandwidth = copy_bandwidth(device) if cuda else None
    if rank == 0:
        record = {
            "benchmark": "tensor_parallel", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "devices": world, "dtype": str(dtype), "shape": raw, "compile": args.compile,
            "step_ms": step * 1e3, "bytes_per_device": weight_bytes + cache_bytes,
            "copy_bandwidth": bandwidth, "tokens": tokens,
        }
        if bandwidth:
            record["roofline_ms"] = record["bytes_per_device"] / bandwidth * 1e3
            record["fraction_of_roofline"] = record["roofline_ms"] / record["step_ms"]
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"{world} device(s): step {step * 1e3:.2f} ms, {record['bytes_per_device'] / 1e9:.2f} GB per device"
              + (f", roofline {record['roofline_ms']:.2f} ms ({record['fraction_of_roofline']:.0%})" if bandwidth else ""))
    dist.destroy_process_group()


def compare(paths: list[str], plot: str | None) -> None:
    runs = sorted((json.loads(Path(p).read_text()) for p in paths), key=lambda r: r["devices"])
    base = runs[0]
    print(f"{'devices':>7s} {'step ms':>8s} {'x 1 dev':>8s} {'roofline ms':>12s} {'of roofline':>12s}  greedy = 1 device")
    for r in runs:
        roof = r.get("roofline_ms")
        print(f"{r['devices']:7d} {r['step_ms']:8.2f} {base['step_ms'] / r['step_ms']:8.2f} "
              f"{roof if roof is not None else float('nan'):12.2f} {r.get('fraction_of_roofline', float('nan')):12.0%}  "
              f"{r['tokens'] == base['tokens']}")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([str(r["devices"]) for r in runs], [r["step_ms"] for r in runs], label="plain decode step")
        ax.plot([str(r["devices"]) for r in runs], [r.get("roofline_ms", 0) for r in runs], "k--o", label="roofline")
        ax.set(xlabel="devices (tensor parallel)", ylabel="ms", title=f"31B shape, {base['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tp.json")
    parser.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (smoke test)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the forward")
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens compared across device counts")
    parser.add_argument("--compare", nargs="+", help="JSON files of runs at different device counts")
    parser.add_argument("--plot")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare, args.plot)
    else:
        run(args)


if __name__ == "__main__":
    main()
