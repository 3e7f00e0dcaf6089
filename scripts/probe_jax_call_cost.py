"""What a JAX call costs the host, untraced, in three parts, one record:

1. the call of a trivial program by how many arrays it takes and whether they are donated (the 270M's cycle takes
   182 weights and 46 arrays of donated state);
2. XLA's call of a command buffer by its kernel count, against torch's replay of a captured graph of as many
   kernels (on a GPU only), and what jax.profiler's trace says its cuGraphLaunch took;
3. with `--config`: the fused cycle at one cycle per call, as `serve` runs it: the jitted call, `_dispatch` around
   it, `_read`, and a whole `step`, in ms per call.

jax.profiler's traces overstate a command buffer's launch (the trace's cuGraphLaunch of 190 kernels read about
five times the whole untraced call), so every other time here is perf_counter's, untraced.

    python scripts/probe_jax_call_cost.py --config 270m.json --out docs/results/jax-call-cost-h200.json
    python scripts/probe_jax_call_cost.py --records A.json B.json --plot jax-call-cost.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # torch shares the GPU in part 2
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # profile_jax_cycle's trace readers
from specdec import compile_cache  # noqa: E402
from specdec.evidence import git_commit, now_utc  # noqa: E402

CALLS = 60


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def call_by_arrays(weights: int, state: int, donate: bool) -> float:
    """ms on the host of calling a program of one small kernel that takes `weights` bf16 arrays and `state` float32
    arrays (donated, and returned as the cycle returns its state, or not), the device idle before each call."""
    ws = [jnp.full((64, 64), i, jnp.bfloat16) for i in range(weights)]
    ss = [jnp.full((1024,), i, jnp.float32) for i in range(state)]

    def program(ws, ss):
        total = sum(w[0, 0].astype(jnp.float32) for w in ws) if ws else jnp.float32(0)
        return [s + total for s in ss], total

    call = jax.jit(program, donate_argnums=(1,) if donate else ())
    times = []
    for _ in range(CALLS):
        jax.block_until_ready((ws, ss))
        start = time.perf_counter()
        ss, total = call(ws, ss)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(total)
    return median_ms(times[10:])


def unfused_chain(kernels: int):
    """A jitted function of `kernels` elementwise kernels: an optimization barrier between them keeps XLA's GPU
    backend from fusing them."""

    def chain(x):
        for i in range(kernels):
            x = jax.lax.optimization_barrier(jnp.sin(x) * 1.0001 + i)
        return x

    return jax.jit(chain, donate_argnums=0)


def xla_launch(kernels: int) -> dict:
    """ms on the host of calling a one-array program of `kernels` kernels (one command buffer), device idle before;
    and what jax.profiler's trace of the same calls gives their cuGraphLaunch."""
    from profile_jax_cycle import host_events, traced

    chain, x = unfused_chain(kernels), jnp.ones(4096)

    def run() -> float:
        nonlocal x
        times = []
        for _ in range(CALLS):
            x.block_until_ready()
            start = time.perf_counter()
            x = chain(x)
            times.append(time.perf_counter() - start)
        x.block_until_ready()
        return median_ms(times[10:])

    call_ms = run()
    profile, _ = traced(run)
    launch = sum(e["ms"] for e in host_events(profile, CALLS, top=1000) if e["name"].startswith("cuGraphLaunch"))
    return {"xla_call_ms": call_ms, "xla_traced_launch_ms": launch}


def torch_replay(kernels: int) -> float:
    """ms on the host of one replay of a captured torch graph of `kernels` small kernels, device idle before."""
    import torch

    x = torch.zeros(4096, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(kernels):
                x.add_(1)
    times = []
    for _ in range(CALLS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return median_ms(times[10:])


def cycle_call(config: Path, context: int, k_max: int) -> dict:
    """The fused plain cycle of random weights at `config`'s shapes, one cycle per call and prefetched (`serve`'s
    settings): median ms of the jitted call, of `_dispatch` around it, of `_read`, and of a whole `step`; and of the
    call alone with the device idle."""
    from specdec.generate import StopCondition
    from specdec.models.config import GemmaConfig
    from specdec.models.jax_gemma import random_params
    from specdec.verifiers.jax_engine import JaxEngine, JaxFusedCycle

    prompt_tokens, cycles = 100, 8 + 6 * CALLS + 2  # the warm-up, the idle calls, the steps, prefetch's
    if prompt_tokens + cycles > context:
        raise SystemExit(f"error: {cycles} cycles after a {prompt_tokens}-token prompt need a context of at least "
                         f"{prompt_tokens + cycles}, got {context}")
    cfg = GemmaConfig.from_file(config)
    engine = JaxEngine(cfg, random_params(cfg, jax.random.key(0), pack=True), max_seq_len=context, k_max=k_max)
    cycle = JaxFusedCycle(engine, None, 0, cycles_per_call=1)
    prompt = np.random.default_rng(0).integers(3, min(20000, cfg.vocab_size), prompt_tokens)
    cycle.start([[int(t) for t in prompt]], StopCondition(10**6))
    for _ in range(8):
        cycle.step()
    steps, dispatch, read = cycle._steps, cycle._dispatch, cycle._read
    times: dict[str, list[float]] = {"call": [], "dispatch": [], "read": [], "step": []}

    def timed(name, fn):
        def wrapped(*args):
            start = time.perf_counter()
            returned = fn(*args)
            times[name].append(time.perf_counter() - start)
            return returned
        return wrapped

    idle = []
    for _ in range(CALLS):
        jax.block_until_ready(cycle.state)
        start = time.perf_counter()
        cycle.state, results = steps(engine.params, cycle.state, *cycle._stop, None)
        idle.append(time.perf_counter() - start)
        results.block_until_ready()
    engine.cache, engine.lengths = cycle.state.cache, cycle.state.length
    cycle._steps, cycle._dispatch, cycle._read = timed("call", steps), timed("dispatch", dispatch), timed("read", read)
    step = timed("step", cycle.step)
    for _ in range(5 * CALLS):
        step()
    cycle.drain()
    return {"arrays_in": len(jax.tree.leaves((engine.params, cycle.state, cycle._stop))),
            "call_device_idle_ms": median_ms(idle[10:]), **{f"{k}_ms": median_ms(v) for k, v in times.items()}}


def plot(records: list[dict], path: Path) -> None:
    """Host ms of a call by its arrays, and of the fused cycle's call and step, one bar per record (left); XLA's call
    of a command buffer against torch's replay by kernels (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (calls, launches) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{a['weights']} weights, {a['state']} state{' donated' if a['donated'] else ''}"
              for a in records[0]["by_arrays"]] + ["the cycle's call", "the cycle's step"]
    width = 0.8 / len(records)
    for i, record in enumerate(records):
        cycle = record["cycle"] or {}
        values = [a["ms"] for a in record["by_arrays"]] + [cycle.get("call_ms", 0), cycle.get("step_ms", 0)]
        name = "TFRT GPU client" if record["tfrt_gpu_client"] else "default client"
        calls.barh([y + i * width for y in range(len(labels))], values, width, label=f"{name} ({record['commit']})")
        if record["launch_by_kernels"]:
            rows = record["launch_by_kernels"]
            launches.plot([r["kernels"] for r in rows], [r["xla_call_ms"] for r in rows], marker="o",
                          label=f"XLA call, {name}")
            launches.plot([r["kernels"] for r in rows], [r["torch_replay_ms"] for r in rows], marker="s",
                          label=f"torch graph replay ({name}'s run)")
    calls.set_yticks([y + 0.4 - width / 2 for y in range(len(labels))], labels)
    calls.invert_yaxis()
    calls.set_xlabel("host ms a call (device idle before it; the step's while the device runs)")
    calls.legend(fontsize=8)
    launches.set_xlabel("kernels in the graph")
    launches.set_ylabel("host ms a call")
    launches.legend(fontsize=8)
    fig.suptitle(f"What a JAX call costs the host, {records[0]['device']}, jax {records[0]['jax']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="10,100,190,400", help="command buffers' kernel counts (part 2)")
    parser.add_argument("--config", type=Path, help="a config.json: time the fused cycle's call at its shapes")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--k-max", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--records", type=Path, nargs="+",
                        help="earlier --out records: plot them (--plot), time nothing")
    parser.add_argument("--plot", type=Path, help="PNG of the records' host times")
    args = parser.parse_args()
    if args.records:
        if not args.plot:
            parser.error("--records plots them: give --plot")
        plot([json.loads(path.read_text()) for path in args.records], args.plot)
        return
    compile_cache.enable_jax()
    gpu = jax.default_backend() == "gpu"
    arrays = [{"weights": w, "state": s, "donated": d, "ms": call_by_arrays(w, s, d)}
              for w, s, d in ((1, 0, False), (182, 0, False), (0, 46, False), (0, 46, True), (182, 46, True))]
    launches = [{"kernels": n, **xla_launch(n), "torch_replay_ms": torch_replay(n)}
                for n in map(int, args.kernels.split(","))] if gpu else []
    cycle = cycle_call(args.config, args.context, args.k_max) if args.config else None
    record = {"benchmark": "probe_jax_call_cost", "date": now_utc(), "commit": git_commit(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "tfrt_gpu_client": os.environ.get("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "0") == "1",
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "model": str(args.config) if args.config else None,
              "context": args.context, "by_arrays": arrays, "launch_by_kernels": launches, "cycle": cycle}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot([record], args.plot)
    print(f"\n{record['device']} · {record['commit']} · jax {jax.__version__}"
          f"{' · TFRT GPU client' if record['tfrt_gpu_client'] else ''}")
    print("a trivial program's call, host ms, by its arrays:")
    for a in arrays:
        print(f"  {a['weights']:>4} weights {a['state']:>3} state{' (donated)' if a['donated'] else '          '}"
              f" {a['ms']:8.4f}")
    if launches:
        print(f"{'kernels':>9} {'XLA call ms':>12} {'traced launch ms':>17} {'torch replay ms':>16}"
              f" {'XLA / torch':>12}")
        for r in launches:
            print(f"{r['kernels']:>9} {r['xla_call_ms']:>12.4f} {r['xla_traced_launch_ms']:>17.4f}"
                  f" {r['torch_replay_ms']:>16.4f} {r['xla_call_ms'] / r['torch_replay_ms']:>12.1f}")
    if cycle:
        print("the fused cycle, one cycle per call, host ms: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float)
                                                                            else f"{k} {v}" for k, v in cycle.items()))


if __name__ == "__main__":
    main()
