"""Do 1 and 2 tensor-parallel devices compute the same bits? Checked on ONE GPU: the 2 ranks run as 2 processes
sharing it over gloo, their collectives copied through host memory (exact copies). Each rank runs the kernels a
2-GPU rank runs (its slices, its compiled program); only the transport and the timing differ, so the bits say
what 2 GPUs would compute, the times nothing. For when no 2-GPU machine is at hand; `specdec roofline
--tensor-parallel 1,2 --tp-parts 2` is the check on two GPUs.

    python scripts/tp_parts_one_gpu.py --layers 6 --out docs/results/tp-parts-one-gpu.json

For each of `--parts` (none: the plain split), 1 and 2 ranks decode 32 greedy tokens of the 31B shape cut to
`--layers` layers (random weights, bf16, compiled), and digest the logits of one verify forward
(roofline.logits_digest). All runs go at once (their times are not the point). `--tiny --device cpu` runs the
script at toy sizes of the same layout, eager, as its CPU test does.
"""

import argparse
import json
import socket
import subprocess
import sys
from datetime import datetime, timezone


def rank_main(rank: int, world: int, port: str, layers: int, parts: int | None, compile: bool, device: str,
              tiny: bool) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    from specdec.bench import roofline
    from specdec.api import leave_distributed
    from specdec.engines.verifier_torch import TorchEngine
    from specdec.models import gemma_torch
    from specdec.models.config import GemmaConfig
    from specdec.protocol import DEFAULT_DRAFTS

    # gloo moves host tensors: the model's collectives go through host memory (this check's transport only).
    gather, reduce = gemma_torch._gather_first, gemma_torch.sum_across
    gemma_torch._gather_first = lambda x, group: gather(x.cpu(), group).to(x.device)
    gemma_torch.sum_across = lambda x, group: x if group is None else reduce(x.cpu(), group).to(x.device)

    cfg = GemmaConfig.from_dict(dict(roofline.GEMMA4_TINY if tiny else roofline.GEMMA4_31B, num_hidden_layers=layers))
    prompt = [cfg.bos_token_id] + np.random.default_rng(0).integers(3, cfg.vocab_size, 127).tolist()
    model = gemma_torch.GemmaModel.random(cfg, torch.bfloat16, device, roofline.CONTEXT, tp_parts=parts,
                                          tp_group=dist.group.WORLD if world > 1 else None)
    # CUDA graphs cannot capture gloo's host copies: 2 ranks call the compiled forward directly (same kernels).
    engine = TorchEngine(model, max_seq_len=roofline.CONTEXT, k_max=DEFAULT_DRAFTS, compile=compile,
                         cuda_graphs=compile and world == 1)
    with torch.inference_mode():
        tokens = engine.greedy_decode(prompt, 32)
        digest = roofline.logits_digest(engine, prompt)
    if rank == 0:
        print(json.dumps({"devices": world, "tp_parts": parts, "tokens": tokens, "logits_digest": digest}), flush=True)
    leave_distributed()  # the ranks meet, then exit past the group's teardown, whose races abort a rank


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="the 31B cut to its first N layers (6: both kinds)")
    parser.add_argument("--parts", default="none,2", help="comma-separated tp_parts to check; none: the plain split")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager forwards")
    parser.add_argument("--device", default="cuda", help="cuda; cpu (eager) to try the script itself")
    parser.add_argument("--tiny", action="store_true", help="the 31B's layout at toy sizes (a smoke test on the CPU)")
    parser.add_argument("--out", help="JSON of the runs")
    parser.add_argument("--rank", nargs=4, help=argparse.SUPPRESS)  # world port parts rank: one rank's process
    args = parser.parse_args()
    args.compile = args.compile and args.device == "cuda"
    if args.rank:
        world, port, parts, rank = args.rank
        rank_main(int(rank), int(world), port, args.layers, None if parts == "none" else int(parts), args.compile,
                  args.device, args.tiny)
        return
    runs = []
    for parts in args.parts.split(","):
        for world in (1, 2):
            port = free_port()
            runs.append([subprocess.Popen([sys.executable, __file__, "--layers", str(args.layers), "--rank", str(world),
                                           port, parts, str(rank), "--device", args.device]
                                          + ["--no-compile"] * (not args.compile) + ["--tiny"] * args.tiny,
                                          stdout=subprocess.PIPE, text=True) for rank in range(world)])
    rows = []
    for procs in runs:
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"a rank failed (exit codes {[p.returncode for p in procs]})")
        rows.append(json.loads(outs[0].strip().splitlines()[-1]))
    print(f"{'parts':>5} {'devices':>7} {'logits digest':>17} {'tokens = 1 device':>17} {'bits = 1 device':>15}")
    for row in rows:
        one = next(r for r in rows if r["tp_parts"] == row["tp_parts"] and r["devices"] == 1)
        same = row["devices"] > 1
        print(f"{row['tp_parts'] or 'none':>5} {row['devices']:>7} {row['logits_digest']:>17} "
              f"{(str(row['tokens'] == one['tokens']) if same else ''):>17} "
              f"{(str(row['logits_digest'] == one['logits_digest']) if same else ''):>15}")
    if args.out:
        import torch

        from specdec.evidence import git_commit

        record = {"benchmark": "tp_parts_one_gpu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "commit": git_commit(), "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                  "layers": args.layers, "compiled": args.compile, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
