"""The server's scheduler timed without HTTP: requests sent one after another, as one client sends them, to a
scheduler of each engine, rows and cycles per call. It reports tokens/s, ms per cycle, and the part of it in the
fused cycle's `step` (a call's dispatch and read, and the device's wait); the rest is admission, prefill and
handing out tokens. Against `scripts/bench_serve.py` at one client it shows what the HTTP side costs, and across
rows what a batch's idle rows cost one request.

    python scripts/time_scheduler.py --target DIR --engines jax,torch --rows 1,8 --cycles-per-call 1,4 \\
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'] [--out timings.json] [--plot t.png]

Torch runs one cycle a call alone: its other counts are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdec.evidence import git_commit, now_utc
from specdec.generate import StopCondition
from specdec.sampling import SamplingParams
from specdec.serve.scheduler import Scheduler, SpeculativeConfig, widths_label

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import DEFAULT_PROMPTS  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def time_requests(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy requests of `max_tokens` one after another through a started scheduler, after one warm-up request:
    tokens/s, cycles, ms a cycle, and ms a cycle inside the cycle's `step`."""
    scheduler.generate(prompts[0], SamplingParams(), StopCondition(2))  # compiles and captures what greedy runs
    cycle = scheduler.cycle
    in_step = 0.0
    step = cycle.step

    def timed_step(*args, **kwargs):
        nonlocal in_step
        start = time.perf_counter()
        result = step(*args, **kwargs)
        in_step += time.perf_counter() - start
        return result

    cycle.step = timed_step
    try:
        scheduler.reset_stats()
        start, tokens = time.perf_counter(), 0
        for prompt in prompts:
            tokens += len(scheduler.generate(prompt, SamplingParams(), StopCondition(max_tokens)))
        wall = time.perf_counter() - start
    finally:
        del cycle.step  # the instance's wrapper goes, the class's method is back
    cycles = scheduler.steps
    return {"requests": len(prompts), "tokens": tokens, "tok_s": tokens / wall, "cycles": cycles,
            "tau": scheduler.stats.tau, "ms_per_cycle": wall * 1e3 / cycles, "step_ms_per_cycle": in_step * 1e3 / cycles}


def plot_timings(record: dict, path: Path) -> None:
    """ms a cycle against cycles a call, a line per engine, rows and cycle widths, the part in `step` dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = lambda r: (r["engine"], r["rows"], tuple(r.get("cycle_widths", [r["rows"]])))  # noqa: E731
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key, color in zip(sorted({series(r) for r in record["rows"]}), plt.cm.tab10.colors):
        engine, batch, widths = key
        runs = [r for r in record["rows"] if series(r) == key]
        calls = [r["cycles_per_call"] for r in runs]
        label = f"{engine}, {batch} row{'s' * (batch > 1)}" + widths_label(widths)
        ax.plot(calls, [r["ms_per_cycle"] for r in runs], "o-", color=color, label=label)
        ax.plot(calls, [r["step_ms_per_cycle"] for r in runs], "x--", color=color, alpha=0.6)
    ax.set_xticks(sorted({r["cycles_per_call"] for r in record["rows"]}))
    ax.set_xlabel("cycles a call")
    ax.set_ylabel("ms a cycle (dashed: in step)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"scheduler without HTTP · {record['model']} · {record['device']} · {record['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    import specdec
    from specdec.data.sources import read_prompts
    from specdec.serve.app import device_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help="checkpoint [default: the embedded 270M]")
    parser.add_argument("--engines", default="jax,torch")
    parser.add_argument("--rows", type=ints, default=[1, 8], help="the scheduler's rows (a server's --max-num-seqs)")
    parser.add_argument("--cycles-per-call", type=ints, default=[1, 2, 4], help="the JAX scheduler's")
    parser.add_argument("--narrow-cycles", default="on", help="the torch scheduler's: on, off or on,off (each timed)")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("scheduler-timings.json"))
    parser.add_argument("--plot", type=Path, help="a PNG of ms a cycle against cycles a call")
    args = parser.parse_args()

    if not set(args.narrow_cycles.split(",")) <= {"on", "off"}:
        parser.error(f"--narrow-cycles takes on, off or on,off, not {args.narrow_cycles!r}")
    spec = SpeculativeConfig.from_json(args.speculative_config)
    rows, device = [], None
    for engine_name in args.engines.split(","):
        for batch in args.rows:
            target = specdec.load(args.target, engine=engine_name, k_max=max(spec.k, 1), batch=batch,
                                  compile=True)  # as a server loads it
            device = device_name(target)
            texts = read_prompts(args.prompts, target.tokenizer)
            if engine_name == "torch":
                target.engine.warm_up_prefill()
            prompts = [target.tokenizer.encode(texts[i % len(texts)]) for i in range(args.requests)]
            runs = [(c, True) for c in args.cycles_per_call] if engine_name == "jax" else [
                (1, narrow == "on") for narrow in args.narrow_cycles.split(",")]
            for cycles_per_call, narrow in runs:
                scheduler = Scheduler(target.engine, spec, cycles_per_call, narrow_cycles=narrow)
                scheduler.start()
                try:
                    row = {"engine": engine_name, "rows": batch, "cycles_per_call": cycles_per_call,
                           "cycle_widths": list(scheduler.cycle.widths),
                           **time_requests(scheduler, prompts, args.max_tokens)}
                finally:
                    scheduler.stop()
                rows.append(row)
                print(f"{engine_name:<6} rows {batch:>2} · {cycles_per_call} a call · widths {row['cycle_widths']}: "
                      f"{row['tok_s']:,.0f} tok/s, {row['ms_per_cycle']:.3f} ms a cycle "
                      f"({row['step_ms_per_cycle']:.3f} in step), tau {row['tau']:.2f}", flush=True)
    record = {"device": device, "date": now_utc(), "commit": git_commit(), "model": (args.target or Path("270m")).name,
              "speculative_config": json.loads(args.speculative_config), "max_tokens": args.max_tokens, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot_timings(record, args.plot)
    print(f"results in {args.out}" + (f", plot in {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
