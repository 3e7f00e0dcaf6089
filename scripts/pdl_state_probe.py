"""A torch cycle graph's replay slows after an unrelated CUDA graph capture (issue 11, open): the 270M's plain
FusedCycle graph timed alone, after a sync + empty_cache, after capturing a four-element graph, and a cycle captured
after that. On an H100 the first two ran 0.570 ms and the last two 0.62: the same kernels, each as long, overlapping
less under programmatic dependent launch (with inductor's PDL off, all four ran 0.714). On one fresh machine other
triggers did not slow it (docs/benchmarks.md); this one has, every time it was tried.

    python scripts/pdl_state_probe.py --config 270m/config.json --out pdl-state.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from specdec.evidence import git_commit, now_utc
from specdec.models.config import GemmaConfig
from specdec.models.torch_gemma import GemmaModel
from specdec.roofline import seconds_per_step
from specdec.verifiers.torch_engine import FusedCycle, TorchEngine

sys.path.insert(0, str(Path(__file__).parent))
from profile_cycle import gpu_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a config.json: random weights at its shapes")
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
        rows.append({"when": label, "gpu_ms": gpu_ms(cycle._graphs[None][0].replay, args.reps)})
        print(f"{label:45s} {rows[-1]['gpu_ms']:.3f} ms", flush=True)

    with torch.inference_mode():
        first = new_cycle()
        timed("the first cycle", first)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        timed("after a sync and empty_cache", first)
        tiny = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tiny):
            torch.ones(4, device="cuda").mul_(2)
        timed("after capturing a four-element graph", first)
        timed("a cycle captured after that", new_cycle())
    record = {"benchmark": "pdl_state_probe", "date": now_utc(), "commit": git_commit(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": str(args.config),
              "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
