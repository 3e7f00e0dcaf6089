"""Where a JAX fused plain-decode cycle's time goes: wall time per cycle as users run it, the device's kernels per
cycle and the host's traced events per call from jax's profiler, grouped by name. The JAX counterpart of
profile_cycle.py (plain decode only).

    python scripts/profile_jax_cycle.py --config 31b.json --context 1024 --out docs/results/profile-jax-31b6.json
    python scripts/profile_jax_cycle.py --config 270m.json --context 333 --cycles-per-call 1 --steps 64

Random weights cost what real ones do (shapes, not values, set a kernel's time). `--share-weights` gives every layer
layer 0's weights of the named blocks: one layer's weights, which L2 holds, so the cycle then bounds what reading
weights ahead into L2 can buy (docs/journal). `--sources DIR` has XLA dump its optimized modules into DIR and
names, for each kernel, the kinds of op XLA fused into it and the specdec lines they come from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from specdec import compile_cache
from specdec.engines.cycle_jax import CYCLES_PER_CALL, JaxFusedCycle
from specdec.engines.verifier_jax import JaxEngine
from specdec.evidence import git_commit, now_utc
from specdec.generate import StopCondition
from specdec.models.config import GemmaConfig
from specdec.models.gemma_jax import load_params, random_params


def traced(run) -> tuple:
    """(jax.profiler's ProfileData of a trace while `run` runs, what `run` returned)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        returned = run()
        jax.profiler.stop_trace()
        [path] = Path(trace_dir).rglob("*.xplane.pb")
        return jax.profiler.ProfileData.from_file(str(path)), returned


def device_kernels(profile, cycles: int) -> dict:
    """The device's kernels in a trace of `cycles` cycles: count and ms per cycle, by name, from the streams of the
    first GPU's plane."""
    plane = next((p for p in profile.planes if p.name.startswith("/device:GPU:0")), None)
    if plane is None:
        raise SystemExit("error: profile_jax_cycle reads a GPU's kernels; the trace has no GPU")
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for line in plane.lines:
        if not line.name.startswith("Stream"):  # the plane also holds derived lines (XLA ops, modules)
            continue
        for event in line.events:
            entry = by_name[event.name]
            entry[0] += 1
            entry[1] += event.duration_ns / 1e6
            spans.append((event.start_ns, event.start_ns + event.duration_ns))
    if not spans:
        raise SystemExit(f"no kernels on the streams of {plane.name}: lines {[line.name for line in plane.lines]}")
    count = sum(c for c, _ in by_name.values()) / cycles
    busy = sum(t for _, t in by_name.values()) / cycles
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e6 / cycles
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])  # every kernel: fusion names match an HLO dump
    return {"per_cycle": count, "busy_ms": busy, "span_ms": span,
            "top": [{"name": n[:120], "per_cycle": c / cycles, "ms": t / cycles} for n, (c, t) in top]}


def host_events(profile, calls: int, top: int = 40) -> list[dict]:
    """The host's traced events in a trace of `calls` dispatches, by thread and name, the longest first: count and ms
    per call. Where a call's host time goes: PJRT's argument handling and output buffers, XLA's command-buffer
    updates, launches. Times are inclusive (an event holds the events it calls). Tracing inflates them: a traced
    cuGraphLaunch of 190 kernels read 0.44 ms where the whole untraced call took 0.08 (scripts/probe_jax_call_cost.py at commit 45ab491)."""
    by_name: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for plane in profile.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            thread = re.sub(r"/-?\d+$", "", line.name)  # a client's threads by kind, not by id
            for event in line.events:
                entry = by_name[(thread, event.name)]
                entry[0] += 1
                entry[1] += event.duration_ns / 1e6
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"thread": thread, "name": name[:120], "per_call": count / calls, "ms": ms / calls}
            for (thread, name), (count, ms) in ranked]


def _hlo_table(text: str, name: str) -> dict[str, str]:
    """One of the id tables (FileNames, StackFrames, ...) heading an HLO module's text dump: id -> its line."""
    _, _, rest = text.partition(f"\n{name}\n")
    return dict(re.findall(r"^(\d+) (.*)$", rest.split("\n\n", 1)[0], re.M))


def _innermost_specdec_line(text: str) -> Callable[[str], str | None]:
    """stack_frame_id -> the innermost specdec file:line:function of that stack, or None."""
    files, functions = _hlo_table(text, "FileNames"), _hlo_table(text, "FunctionNames")
    locations, frames = _hlo_table(text, "FileLocations"), _hlo_table(text, "StackFrames")

    def innermost(frame: str) -> str | None:
        while frame in frames:
            location, parent = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", frames[frame]).groups()
            file, function, line = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)",
                                             locations[location]).groups()
            path = files[file].strip('"')
            if "specdec" in Path(path).parts:
                return f"{Path(path).name}:{line}:{functions[function].strip(chr(34))}"
            if parent == frame:
                break
            frame = parent
        return None

    return innermost


def _defined(text: str, kernel: str):
    """The line defining the fusion a kernel is named after (`fusion_373` runs `%fusion.373`), or None."""
    numbered = re.fullmatch(r"(.*)_(\d+)", kernel)
    for name in ([f"{numbered[1]}.{numbered[2]}"] if numbered else []) + [kernel]:
        found = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = (.*)$", text, re.M)
        if found:
            return found
    return None


def kernel_sources(names: list[str], dump: Path) -> dict[str, dict]:
    """For each kernel name an XLA fusion goes by: the kinds of op fused into it and the specdec lines its ops come
    from (the innermost of each stack), read from XLA's optimized modules dumped as text into `dump`; the module is
    the one defining most of `names`. Names not defined there (Pallas kernels, copies) are left out."""
    modules = [path.read_text() for path in dump.glob("*after_optimizations.txt")]
    if not modules:
        return {}
    text = max(modules, key=lambda t: sum(_defined(t, name) is not None for name in names))
    innermost = _innermost_specdec_line(text)
    sources = {}
    for name in names:
        match = _defined(text, name)
        if match is None:
            continue
        ops, origins = set(), set()
        called = re.search(r"calls=%([\w.\-]+)", match[1])
        body = called and re.search(rf"^%{re.escape(called[1])} .*?\{{\n(.*?)\n\}}", text, re.M | re.S)
        for line in [match[1], *(body[1].splitlines() if body else [])]:
            op = re.search(r"= \S+ ([a-z][\w-]*)\(", line)
            if op and op[1] not in ("fusion", "parameter", "constant", "bitcast", "broadcast", "tuple",
                                    "get-tuple-element"):
                ops.add(op[1])
            frame = re.search(r"stack_frame_id=(\d+)", line)
            origin = innermost(frame[1]) if frame else None
            if origin:
                origins.add(origin)
        sources[name] = {"ops": sorted(ops), "sources": sorted(origins)}
    return sources


def shared_weights(params: dict, blocks: list[str]) -> dict:
    """params with each layer's weights in `blocks` (name parts, e.g. `mlp.`) replaced by layer 0's (the same
    arrays)."""
    shared = dict(params)
    for name in params:
        match = re.match(r"layers\.(\d+)\.(.*)", name)
        if match and match[1] != "0" and any(block in match[2] for block in blocks):
            shared[name] = params[f"layers.0.{match[2]}"]
    return shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="an imported checkpoint directory")
    source.add_argument("--config", type=Path, help="a config.json: random weights at its shapes")
    parser.add_argument("--steps", type=int, default=20 * CYCLES_PER_CALL, help="timed decode cycles")
    parser.add_argument("--cycles-per-call", type=int, default=CYCLES_PER_CALL,
                        help="the fused cycle's (1: a server's, where the host's time per call shows)")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--context", type=int, default=4096, help="cache positions")
    parser.add_argument("--k-max", type=int, default=8, help="the engine's k_max (sets the invariant width)")
    parser.add_argument("--fp8", action="store_true", help="FP8 linears (specdec.models.fp8)")
    parser.add_argument("--out", type=Path, default=Path("profile-jax-cycle.json"))
    parser.add_argument("--share-weights", nargs="+", metavar="BLOCK",
                        help="every layer reads layer 0's weights of these blocks (self_attn. mlp.): a bound")
    parser.add_argument("--sources", type=Path, metavar="DIR",
                        help="dump XLA's optimized modules into DIR and name each kernel's ops and specdec lines")
    args = parser.parse_args()
    if args.sources:  # before JAX starts its backend, which reads XLA_FLAGS once; compiled anew, so dumped
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.sources} "
                                   "--xla_dump_hlo_as_text").strip()
    else:
        compile_cache.enable_jax()
    if args.target:
        cfg, params = load_params(args.target, pack=True, fp8=args.fp8)
    else:
        cfg = GemmaConfig.from_file(args.config)
        params = random_params(cfg, jax.random.key(0), pack=True, fp8=args.fp8)
    if args.share_weights:
        params = shared_weights(params, args.share_weights)
    engine = JaxEngine(cfg, params, max_seq_len=args.context, k_max=args.k_max)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 20000, args.prompt_tokens)]
    cycle = JaxFusedCycle(engine, None, 0, cycles_per_call=args.cycles_per_call)
    cycle.start([prompt], StopCondition(10**6))

    def run(steps: int) -> int:
        """`steps` cycles handed out as decoding takes them (a device call, and a wait, per cycles_per_call);
        -> the cycles the device ran meanwhile."""
        before = cycle.device_cycles
        for _ in range(steps):
            cycle.step()
        return cycle.device_cycles - before

    run(3 * args.cycles_per_call)
    start = time.perf_counter()
    ran = run(args.steps)
    wall = (time.perf_counter() - start) * 1e3 / ran
    profile, ran = traced(lambda: run(args.steps))
    kernels = device_kernels(profile, ran)
    host = host_events(profile, ran // args.cycles_per_call)
    if args.sources:
        sources = kernel_sources([t["name"] for t in kernels["top"]], args.sources)
        for t in kernels["top"]:
            t.update(sources.get(t["name"], {}))
    record = {"benchmark": "profile_jax_cycle", "date": now_utc(), "commit": git_commit(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "dtype": str(engine.params["embed_tokens.weight"].dtype), "fp8": args.fp8,
              "model": str(args.target or args.config), "weights": "checkpoint" if args.target else "random",
              "shared_weights": args.share_weights,
              "invariant_width": engine.width, "prompt_tokens": len(prompt), "cycles_per_call": args.cycles_per_call,
              "cycle_wall_ms": wall, "kernels": kernels, "host_per_call": host}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"\n{record['device']} · {record['commit']} · width {engine.width} · {args.cycles_per_call} cycles per call")
    print(f"cycle wall {wall:.3f} ms · device span {kernels['span_ms']:.3f} ms · busy {kernels['busy_ms']:.3f} ms"
          f" · {kernels['per_cycle']:.0f} kernels per cycle")
    for t in kernels["top"][:25]:
        where = f"  {','.join(t['ops'])[:40]}  {' '.join(t['sources'][:2])}" if t.get("sources") else ""
        print(f"  {t['per_cycle']:6.1f} {t['ms']:7.4f}  {t['name'][:60]}{where}")
    print("host, per call (inclusive):")
    for h in host[:20]:
        print(f"  {h['per_call']:6.1f} {h['ms']:7.4f}  {h['thread'][:24]:<24} {h['name'][:70]}")


if __name__ == "__main__":
    sys.exit(main())
