"""Whole-command wall time of `specdec generate`, as a user runs it: a fresh process per run, timed around it.

For each engine and decoding mode, run 1 starts with empty compile caches (a private SPECDEC_CACHE holding
only the imported checkpoint's directory, which is passed with --target), later runs reuse them. The stats
line each run prints (load, compile, prefill, decoding) is kept beside the wall time. `--profile` adds one
more later run per configuration under cProfile and keeps its 30 costliest calls (cumulative time).

    python scripts/bench_cold_start.py --target DIR --out docs/results/cold-start-h200.json \
        --plot docs/results/cold-start-h200.png [--profile DIR]

Where Python may not write bytecode (the GPU machine sets PYTHONDONTWRITEBYTECODE), every process compiles
the libraries' sources again, 2.1-2.3 s of each run there; `--pycache DIR` lifts that, points
PYTHONPYCACHEPREFIX at DIR and imports the libraries once first, as a user's `pip install` leaves them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdec.evidence import git_commit, now_utc

PROMPT = "def quicksort(arr):"
MODES = {"greedy": [], "sampled": ["--temperature", "0.7", "--seed", "3"]}


def run_once(cmd: list[str], env: dict) -> tuple[float, str, int]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    stats = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    return wall, stats, proc.returncode


def seconds_in(stats: str, label: str) -> float | None:
    m = re.search(label + r" ([0-9.]+) s", stats)
    return float(m.group(1)) if m else None


def top_calls(prof: Path, n: int = 30) -> list[str]:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(prof), stream=buf).sort_stats("cumulative").print_stats(n)
    return buf.getvalue().splitlines()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the imported checkpoint directory")
    ap.add_argument("--engines", default="torch,jax")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--runs", type=int, default=3, help="runs per configuration, the first with empty caches")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--pycache", help="PYTHONPYCACHEPREFIX for every run, warmed once first")
    ap.add_argument("--profile", help="directory for one cProfile'd later run per configuration")
    ap.add_argument("--out", default="cold-start.json")
    ap.add_argument("--plot")
    args = ap.parse_args()

    env = dict(os.environ)
    if args.pycache:  # a user's pip install leaves compiled bytecode; a machine that forbids writing it does not
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = args.pycache
        subprocess.run([sys.executable, "-c", "import torch, jax, jax.numpy, specdec.cli, specdec.api, "
                        "specdec.engines.verifier_torch, specdec.engines.verifier_jax"], env=env, check=True)
    results = []
    for engine in args.engines.split(","):
        for mode in args.modes.split(","):
            cache = Path(tempfile.mkdtemp(prefix="specdec-cold-"))
            run_env = dict(env, SPECDEC_CACHE=str(cache))
            cmd = [sys.executable, "-m", "specdec", "generate", PROMPT, "--target", args.target, "--engine", engine,
                   "--max-new-tokens", str(args.max_new_tokens), *MODES[mode]]
            runs = []
            for i in range(args.runs):
                wall, stats, rc = run_once(cmd, run_env)
                runs.append({"wall_s": wall, "stats": stats, "returncode": rc,
                             "load_s": seconds_in(stats, "loaded"), "compile_s": seconds_in(stats, "compiled")})
                print(f"{engine:5s} {mode:7s} run {i + 1}: {wall:5.1f} s   {stats}", flush=True)
            entry = {"engine": engine, "mode": mode, "runs": runs}
            if args.profile:
                prof = Path(args.profile) / f"{engine}-{mode}.prof"
                prof.parent.mkdir(parents=True, exist_ok=True)
                wall, _, _ = run_once([sys.executable, "-m", "cProfile", "-o", str(prof), *cmd[1:]], run_env)
                entry["profile"] = {"file": prof.name, "wall_s": wall, "top": top_calls(prof)}
                (prof.with_suffix(".txt")).write_text("\n".join(entry["profile"]["top"]))
            results.append(entry)
            shutil.rmtree(cache, ignore_errors=True)

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"benchmark": "cold start of `specdec generate`", "device": device, "date": now_utc(),
           "commit": git_commit(), "prompt": PROMPT, "max_new_tokens": args.max_new_tokens,
           "python": sys.version.split()[0], "results": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"\n{'engine':6s} {'mode':8s} {'run 1':>7s} {'later (median)':>15s}")
    for r in results:
        walls = [run["wall_s"] for run in r["runs"]]
        later = sorted(walls[1:])[len(walls[1:]) // 2] if len(walls) > 1 else float("nan")
        print(f"{r['engine']:6s} {r['mode']:8s} {walls[0]:6.1f}s {later:14.1f}s")
    if args.plot:
        plot(results, device, args.plot)


def plot(results: list[dict], device: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['engine']}\n{r['mode']}" for r in results]
    first = [r["runs"][0]["wall_s"] for r in results]
    later = [min(run["wall_s"] for run in r["runs"][1:]) if len(r["runs"]) > 1 else 0 for r in results]
    x = range(len(results))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], first, 0.4, label="first run (empty caches)")
    ax.bar([i + 0.2 for i in x], later, 0.4, label="later runs (best)")
    for target, style, label in ((10, "--", "target, first run"), (5, ":", "target, later runs")):
        ax.axhline(target, color="gray", linestyle=style, linewidth=1, label=label)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds, whole command")
    ax.set_title(f"specdec generate, 128 tokens, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
