"""Where a fused cycle's time goes (PyTorch engine, CUDA): for plain decode, n-gram and EAGLE-3 drafting,
the cycle as users run it (one CUDA graph replay and one host sync), its GPU time alone (replays back to
back, timed with events), the target's verify forward alone, and the kernels one replay runs (torch
profiler), grouped by name. The difference between cycle and verify is what drafting and acceptance cost.

    python scripts/profile_cycle.py --target DIR --out docs/results/profile-cycle-h100.json
    python scripts/profile_cycle.py --config .../config.json      # random weights at a checkpoint's shapes
    python scripts/profile_cycle.py --config 31b.json --methods plain --k 8 --context 1024   # a large target

Random weights cost what real ones do (shapes, not values, set a kernel's time); the drafter's acceptance
means nothing then, and nothing here depends on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from specdec.drafters.eagle3 import Eagle3Config, engine_taps, load_head, random_head
from specdec.drafters.eagle3_drafter import Eagle3Drafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engines.cycle_torch import FusedCycle
from specdec.engines.verifier_torch import TorchEngine
from specdec.evidence import git_commit, now_utc
from specdec.generate import StopCondition
from specdec.models.config import GemmaConfig, decode_width
from specdec.models.gemma_torch import GemmaModel
from specdec.bench.roofline import median_seconds
from specdec.sampling import SamplingParams


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def time_cycles(cycle, prompt: list[int], cycles: int, rows: int = 1) -> float:
    """Median seconds per cycle.step() (graph replay + host sync), after a warm-up that captures the graph; each of
    the engine's `rows` decodes the prompt."""
    cycle.start([prompt] * rows, StopCondition(10**6))
    return median_seconds(cycle.step, cycles)


def gpu_ms(replay, reps: int) -> float:
    """ms per replay with replays back to back and no host sync between them (CUDA events)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def kernels(replay, reps: int) -> dict:
    """The kernels of one replay, from the profiler over `reps` replays: count, busy ms, top names, and their
    sequence."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[event.name]
            entry[0] += 1
            entry[1] += event.device_time_total / 1e3  # us -> ms
    count = sum(c for c, _ in by_name.values()) / reps
    busy = sum(t for _, t in by_name.values()) / reps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    return {"per_replay": count, "busy_ms": busy,
            "top": [{"name": n[:120], "per_replay": c / reps, "ms": t / reps} for n, (c, t) in top],
            "sequence": sequence(prof, reps)}


def sequence(prof, reps: int) -> list[dict]:
    """A replay's kernels in launch order, each one's us averaged over the replays: where kernels share a name (one
    Triton kernel for every product), its place tells which product it ran."""
    launched = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                      key=lambda e: e.time_range.start)
    if not launched or len(launched) % reps:
        return []
    per_replay = len(launched) // reps
    return [{"name": launched[i].name[:80],
             "us": sum(launched[r * per_replay + i].device_time_total for r in range(reps)) / reps}
            for i in range(per_replay)]


def ops_by_shape(run, reps: int, top: int = 20) -> list[dict]:
    """GPU ms per forward of each (operator, input shapes) of `run`, called outside a CUDA graph: a replay
    records kernels alone, with no operator or shape to tell which GEMM is which."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::") and e.self_device_time_total > 0]
    ops.sort(key=lambda e: -e.self_device_time_total)
    return [{"op": e.key, "shapes": str(e.input_shapes), "per_forward": e.count / reps,
             "ms": e.self_device_time_total / 1e3 / reps} for e in ops[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="an imported checkpoint directory")
    source.add_argument("--config", type=Path, help="a config.json: random weights at its shapes")
    parser.add_argument("--head", type=Path, help="an EAGLE-3 head directory (default: a random head)")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--methods", default="plain,ngram,eagle3", help="comma-separated: plain, ngram, eagle3")
    parser.add_argument("--context", type=int, default=4096, help="cache positions")
    parser.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=True,
                        help="decode forwards at the engine's one width (--no-invariant: each at its own; what "
                             "invariance costs is the difference)")
    parser.add_argument("--fp8", action="store_true", help="FP8 linears (specdec.models.fp8)")
    parser.add_argument("--batch", type=int, default=1, help="rows, each decoding the prompt (a server's batch)")
    parser.add_argument("--out", type=Path, default=Path("profile-cycle.json"))
    args = parser.parse_args()
    dtype, device, context = torch.bfloat16, "cuda", args.context
    # Every replay advances the cycle by up to k + 1 positions, and nothing rewinds it between the timings: 3 warm-up
    # steps, the timed steps and the one they prefetch, the replays back to back, the profiled ones.
    k = args.k if set(args.methods.split(",")) - {"plain"} else 0
    needed = args.prompt_tokens + (2 * args.reps + 24) * (k + 1) + decode_width(args.k)
    if needed > context:
        sys.exit(f"--context {context} is too short for --reps {args.reps} at k={k}: the cycles may reach position "
                 f"{needed} (a device-side assert); raise --context or lower --reps")
    if not torch.cuda.is_available():
        sys.exit("profile_cycle needs CUDA")
    if args.target:
        model = GemmaModel.from_checkpoint(args.target, dtype=dtype, device=device, max_seq_len=context, fp8=args.fp8)
    else:
        model = GemmaModel.random(GemmaConfig.from_file(args.config), dtype, device, context, fp8=args.fp8)
    cfg = model.cfg
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 20000, args.prompt_tokens)]
    batch = args.batch
    plain_engine = TorchEngine(model, batch=batch, max_seq_len=context, k_max=args.k, invariant=args.invariant)

    def eagle3_cycle():
        head = load_head(args.head) if args.head else random_head(Eagle3Config.for_target(cfg))
        tapped_engine = TorchEngine(model, batch=batch, max_seq_len=context, k_max=args.k, invariant=args.invariant,
                                    hidden_layers=engine_taps(head.cfg.aux_layer_ids))
        return FusedCycle(tapped_engine, Eagle3Drafter(head, tapped_engine, args.k, SamplingParams())
                          .device_draft_fn("torch", args.k), args.k)

    methods = {
        "plain": lambda: FusedCycle(plain_engine, None, 0),
        "ngram": lambda: FusedCycle(plain_engine, NgramDrafter().device_draft_fn("torch", args.k), args.k),
        "eagle3": eagle3_cycle,
    }
    rows = []
    for name in args.methods.split(","):
        if name not in methods:
            sys.exit(f"unknown method {name!r}: use {', '.join(methods)}")
        make = methods[name]
        log(f"{name}: capturing")
        cycle = make()
        engine = cycle.verifier
        wall = time_cycles(cycle, prompt, args.reps, batch) * 1e3  # replay and the host's read, as decoding runs it
        graph = cycle._graphs[None, engine.batch][0]  # the greedy rule's graph over every row
        gpu = gpu_ms(graph.replay, args.reps)
        cycle_kernels = kernels(graph.replay, 20)
        # the verify forward alone, of the cycle's k + 1 tokens (an invariant engine pads them to its one width)
        verified = torch.zeros(batch, cycle.k + 1, dtype=torch.long, device=device)
        engine.verify(verified)
        verify_graph = engine._graphs[engine.pad(verified).shape[1]][0]
        verify = gpu_ms(verify_graph.replay, args.reps)
        verify_kernels = kernels(verify_graph.replay, 20)
        # the same forward outside the graph, where the profiler sees each GEMM's operator and shapes
        ungraphed = TorchEngine(model, batch=batch, max_seq_len=context, k_max=args.k, cuda_graphs=False,
                                hidden_layers=engine.hidden_layers, invariant=args.invariant)
        ungraphed.prefill([prompt] * batch)
        verify_ops = ops_by_shape(lambda: ungraphed.verify(verified), 10)
        rows.append({"method": name, "k": cycle.k, "cycle_wall_ms": wall, "cycle_gpu_ms": gpu,
                     "verify_gpu_ms": verify, "kernels": cycle_kernels, "verify_kernels": verify_kernels,
                     "verify_ops": verify_ops})
        log(f"{name}: wall {wall:.3f} ms, gpu {gpu:.3f} ms, verify {verify:.3f} ms, "
            f"{cycle_kernels['per_replay']:.0f} kernels ({cycle_kernels['busy_ms']:.3f} ms busy)")
        del cycle
    record = {"benchmark": "profile_cycle", "date": now_utc(), "commit": git_commit(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(dtype),
              "model": str(args.target or args.config), "weights": "checkpoint" if args.target else "random",
              "head": str(args.head or "random") if "eagle3" in args.methods else None, "invariant": args.invariant,
              "fp8": args.fp8, "batch": batch,
              "width": plain_engine.width if args.invariant else None,
              "prompt_tokens": len(prompt), "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    width = record["width"] or "k + 1 (not invariant)"
    print(f"\n{record['device']} · {record['commit']} · batch {batch} · width {width} · k {args.k}")
    print(f"{'method':8s} {'wall ms':>8s} {'gpu ms':>7s} {'verify':>7s} {'rest':>6s} {'kernels':>8s} "
          f"{'busy ms':>8s} {'verify kernels':>15s}")
    for r in rows:
        print(f"{r['method']:8s} {r['cycle_wall_ms']:8.3f} {r['cycle_gpu_ms']:7.3f} {r['verify_gpu_ms']:7.3f} "
              f"{r['cycle_gpu_ms'] - r['verify_gpu_ms']:6.3f} {r['kernels']['per_replay']:8.0f} "
              f"{r['kernels']['busy_ms']:8.3f} {r['verify_kernels']['per_replay']:15.0f}")
    for r in rows:
        print(f"\n{r['method']}: top kernels per replay (count, ms)")
        for t in r["kernels"]["top"][:12]:
            print(f"  {t['per_replay']:5.1f} {t['ms']:7.4f}  {t['name'][:100]}")
        print(f"{r['method']}: verify forward's costliest operators by input shapes (per forward, ms)")
        for o in r["verify_ops"][:12]:
            print(f"  {o['per_forward']:5.1f} {o['ms']:7.4f}  {o['op']} {o['shapes'][:90]}")


if __name__ == "__main__":
    main()
