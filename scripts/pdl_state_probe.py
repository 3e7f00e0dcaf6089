"""A torch cycle graph's replay slows after an unrelated CUDA graph capture (issue 11, open). The 270M's plain
FusedCycle graph is timed alone, twice more after a sync and empty_cache, then after a trigger, then a cycle captured
after that. Run one trigger a process: the state, once slowed, stays for the process.

On an H100 the `tiny-graph` trigger (a four-element graph captured after the cycle's) took the cycle from 0.567 to
0.621 ms, and the cycle captured after it ran 0.619. The kernels are the same and each as long; they overlap less
under programmatic dependent launch (with inductor's PDL off, the cycle ran 0.714 before and after). On an H200
every small graph captured after the cycle's slowed it (0.526 -> 0.586 ms), in relaxed mode and through the engine's
capture_graph too, but for the tiny graph whose aten kernels had run once eagerly, with a sync, before its capture
(3 processes of 3, two machines). The one inductor kernel's graph slowed it although that kernel had run eagerly.
gc.collect, pinned memory's empty-cache, a second cycle and the profiler did not slow it there (docs/benchmarks.md).

    python scripts/pdl_state_probe.py --config 270m/config.json --trigger tiny-graph --out pdl-state.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specdec.evidence import git_commit, now_utc
from specdec.models.config import GemmaConfig
from specdec.models.torch_gemma import GemmaModel
from specdec.roofline import seconds_per_step
from specdec.verifiers.torch_engine import FusedCycle, TorchEngine, capture_graph

sys.path.insert(0, str(Path(__file__).parent))
from profile_cycle import gpu_ms, kernels  # noqa: E402


def capture_tiny(warm: bool = False, mode: str = "global") -> torch.cuda.CUDAGraph:
    """A graph of two aten kernels (fill and mul) on four elements, their first launch inside the capture unless
    `warm`."""
    if warm:
        torch.ones(4, device="cuda").mul_(2)
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        torch.ones(4, device="cuda").mul_(2)
    return graph


def capture_pdl_kernel() -> torch.cuda.CUDAGraph:
    """A graph of one inductor kernel, launched under PDL as the engine's are."""
    double = torch.compile(lambda x: x * 2 + 1)
    x = torch.ones(4, device="cuda")
    double(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        double(x)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a config.json: random weights at its shapes")
    parser.add_argument("--trigger", default="tiny-graph",
                        choices=["none", "host-empty-cache", "gc-collect", "tiny-graph", "tiny-graph-warm",
                                 "tiny-graph-relaxed", "tiny-capture-graph", "pdl-kernel-graph", "second-cycle",
                                 "profiler"])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("pdl-state.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pdl_state_probe needs CUDA")
    cfg = GemmaConfig.from_file(args.config)
    model = GemmaModel.random(cfg, torch.bfloat16, "cuda", 1024)
    engine = TorchEngine(model, max_seq_len=1024, k_max=8)
    prompt = [cfg.bos_token_id] + np.random.default_rng(0).integers(3, cfg.vocab_size, 127).tolist()
    rows = []

    def new_cycle() -> FusedCycle:
        cycle = FusedCycle(engine, None, 0)
        seconds_per_step(cycle, prompt, 8, 3)  # compiles (the first time) and captures
        return cycle

    def timed(label: str, cycle: FusedCycle) -> None:
        cycle.start([prompt])  # the same positions for every row
        rows.append({"when": label, "gpu_ms": gpu_ms(cycle._graphs[None, engine.batch][0].replay, args.reps)})
        print(f"{args.trigger:18s} {label:40s} {rows[-1]['gpu_ms']:.3f} ms", flush=True)

    with torch.inference_mode():
        first = new_cycle()
        timed("the first cycle", first)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        time.sleep(2)  # a trigger that takes time is not told from time passing
        timed("after a sync, empty_cache and 2 s", first)
        kept = {  # what the trigger made stays alive until the end
            "none": lambda: None,
            "host-empty-cache": torch._C._host_emptyCache,  # what torch.cuda.graph's __enter__ calls
            "gc-collect": gc.collect,  # so may torch.cuda.graph's __enter__
            "tiny-graph": capture_tiny,
            "tiny-graph-warm": lambda: capture_tiny(warm=True),
            "tiny-graph-relaxed": lambda: capture_tiny(mode="relaxed"),
            # the engine's way: warmed up on a side stream, captured into a shared pool
            "tiny-capture-graph": lambda: capture_graph(lambda: torch.ones(4, device="cuda").mul_(2),
                                                        pool=torch.cuda.graph_pool_handle()),
            "pdl-kernel-graph": capture_pdl_kernel,
            "second-cycle": new_cycle,
            "profiler": lambda: kernels(first._graphs[None, engine.batch][0].replay, 5),
        }[args.trigger]()
        timed(f"after the trigger ({args.trigger})", first)
        timed("a cycle captured after that", new_cycle())
        del kept
    record = {"benchmark": "pdl_state_probe", "date": now_utc(), "commit": git_commit(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": str(args.config),
              "trigger": args.trigger, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
