"""Plain decoding against the memory roofline, both engines, at the 270M, E4B and 31B shapes (batch 1).

    specdec roofline --out roofline.json --plot roofline.png [--models 270m,31b,e4b] [--engines torch,jax]
    specdec roofline --config-270m DIR/config.json ...   # the 270M at random weights (no checkpoint)
    specdec roofline --models 31b --tensor-parallel 1,2 ...  # the 31B on 1 and 2 devices
    specdec roofline --tiny --out /tmp/r.json             # CPU smoke test, toy shapes
    specdec roofline --replot a.json b.json --plot roofline.png   # tables and plots of runs

Per engine and model: the plain decode step as `specdec generate` runs it (the fused plain cycle: one CUDA graph
replay of the torch.compile'd forward per token in torch, 8 steps per compiled call in JAX; invariant forwards,
so every step is the engine's one decode width: 8 rows for generate's default of 4 drafts, 16 for `--k-max` 8 to
15), its seconds per token over `--steps` tokens after warm-up, and
the roofline: the device's copy bandwidth over the bytes one step must read, i.e. every weight (one row of a
table that is only looked up: untied embeddings, per-layer inputs) and every allocated KV slot. Bytes are counted
from the config, the same for both engines. Each (engine, model) runs in a process of its own, so a 31B's
weights are held once and JAX's allocator does not meet torch's. The caches hold 1,024 positions (`--context`):
a sliding ring is never longer than the context, so the 31B's ring of 1,088 slots needs `--context 1088` or more.

Random weights cost what real ones do (shapes, not values, set the time). Shapes of the 31B and E4B are
assumed (no released configs could be read here; docs/journal).

Verify cost against T (`--verify-widths 1,5,8`): the time of one T-token verify forward at a fixed position,
with per-width forwards (not the invariant width), each width its own engine: in JAX an engine of k_max T-1
compiles exactly T; in torch the sweep replays CUDA graphs of the eager forward, since torch.compile would
recompile dynamic in T after the second width.

Tensor parallel over N devices (`--tensor-parallel 1,2`): torch runs one process per device under torchrun (NCCL;
gloo on the CPU), JAX one process over a mesh of N devices. The roofline is then N devices' bandwidth over the
same bytes, and every row keeps the greedy tokens it decoded and a digest of the logits of one verify forward, so
the table says whether N devices decode, and compute to the bit, what one does. `--tp-parts P` runs the rows in P
parts on every device count (config.check_tp_parts), which is what makes them agree in bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from specdec.bench import first_difference
from specdec.bench.child import run_child, say
from specdec.protocol import DEFAULT_DRAFTS

CONTEXT = 1024  # cache positions by default (--context): a 128-token prompt and the decoded tokens fit
PROMPT_TOKENS = 128
MOST_WARM_UP = 16  # steps an engine runs before the timed ones, at most

# Gemma 4 31B as we understand its config: 60 layers, every 6th full attention; sliding layers 32 query / 16 KV
# heads of 256; full layers k_eq_v with 4 KV heads of 512.
GEMMA4_31B = dict(
    model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504,
    num_hidden_layers=60, sliding_window_pattern=6, num_attention_heads=32, num_key_value_heads=16,
    head_dim=256, global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
    sliding_window=1024, final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    hidden_size_per_layer_input=0,
)
GEMMA4_TINY = dict(
    GEMMA4_31B, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=2,
    sliding_window=16,
)
# E4B as issue 10 describes it (42 layers, per-layer inputs, KV sharing) with Gemma 3n E4B-style widths.
GEMMA4_E4B = dict(
    model_type="gemma4_text", vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
    sliding_window_pattern=6, num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
    sliding_window=512, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
    final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
E4B_TINY = dict(GEMMA4_E4B, vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=64, intermediate_size=128,
                num_hidden_layers=8, num_attention_heads=4, head_dim=32, global_head_dim=64, hidden_size_per_layer_input=8,
                num_kv_shared_layers=2, sliding_window=16)
GEMMA3_TINY = dict(model_type="gemma3_text", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
                   tie_word_embeddings=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_config(name: str, args) -> dict:
    """The raw config of a model name (the 270M's from --config-270m or the imported checkpoint), cut to its
    first --layers layers when given."""
    if args.tiny:
        raw = {"270m": GEMMA3_TINY, "31b": GEMMA4_TINY, "e4b": E4B_TINY}[name]
    elif name == "270m":
        raw = json.loads(Path(args.config_270m or (checkpoint_270m() / "config.json")).read_text())
    else:
        raw = {"31b": GEMMA4_31B, "e4b": GEMMA4_E4B}[name]
    if args.layers:
        raw = dict(raw, num_hidden_layers=args.layers)
        if "layer_types" in raw:
            raw["layer_types"] = raw["layer_types"][: args.layers]
    return raw


def checkpoint_270m() -> Path:
    from specdec.models.gguf_import import default_checkpoint

    return default_checkpoint()


def step_bytes(cfg, itemsize: int, context: int, k_max: int, fp8: bool = False) -> dict[str, int]:
    """What one batch-1 decode step reads: every weight (a single row of a table that is only looked up) and
    every allocated KV slot of an engine of `context` positions and drafts of up to `k_max` tokens. `fp8`: the
    linears at a byte a weight and 4 a row for their scales (specdec.models.fp8); a tied head reads its FP8 copy,
    and its table a row a token."""
    from specdec.models.checkpoint import expected_shapes
    from specdec.models.fp8 import quantizes

    shapes = dict(expected_shapes(cfg))
    lookup_only = {"embed_tokens_per_layer.weight"} | ({"embed_tokens.weight"} if not cfg.tie_word_embeddings else set())
    if fp8 and cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = shapes["embed_tokens.weight"]
        lookup_only.add("embed_tokens.weight")

    def read(name: str, shape) -> int:
        if name in lookup_only:
            return math.prod(shape[1:]) * itemsize
        if fp8 and quantizes(name, shape):
            return math.prod(shape) + shape[0] * 4
        return math.prod(shape) * itemsize

    weights = sum(read(name, shape) for name, shape in shapes.items())
    kv = sum(math.prod(shape) * (2 if with_values else 1)
             for shape, with_values in filter(None, cfg.kv_cache_shapes(1, context, k_max))) * itemsize
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def seconds_per_step(cycle, prompt: list[int], steps: int, warm_up: int) -> tuple[float, float]:
    """Wall seconds per plain decode step of a cycle (one token each), over `steps` after `warm_up`: the mean
    (what throughput is) and the median over the cycle's calls of a call's seconds per step. A torch cycle runs
    one step a call; a JAX cycle runs `cycles_per_call`, and every step of a call but the first is a host read
    of results already there, so a median of single steps would time the host. Fewer steps than a call: the mean
    twice."""
    from specdec.generate import StopCondition

    cycle.start([prompt], StopCondition(10**6))
    for _ in range(cycle.decode_cycles_in_start + warm_up):  # the timed steps start at a call's first cycle
        cycle.step()
    stamps = [time.perf_counter()]
    for _ in range(steps):
        cycle.step()
        stamps.append(time.perf_counter())
    cycle.drain()
    per_call = cycle.cycles_per_call
    mean = (stamps[-1] - stamps[0]) / steps
    calls = sorted((stamps[i + per_call] - stamps[i]) / per_call for i in range(0, steps - per_call + 1, per_call))
    return mean, calls[len(calls) // 2] if calls else mean


def greedy_tokens(cycle, prompt: list[int], count: int) -> list[int]:
    """The first `count` tokens a plain greedy decode emits (compared across device counts)."""
    from specdec.generate import StopCondition, run_cycles

    return [int(t) for t in run_cycles(cycle, [prompt], 0, StopCondition(count)).tokens[0]]


def median_seconds(call, reps: int) -> float:
    """Median wall seconds of `call` (which waits for its result), after 3 untimed calls."""
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def time_plain_decode(cycle, prompt: list[int], args, first_steps: int, warm_up: int,
                      first_run: str) -> tuple[float, float, list[int]]:
    """Mean and median seconds per plain decode step over --steps and the first --tokens greedy tokens, all on
    one cycle, after a first run that compiles (its time logged as `first_run`). One cycle, as a user's process
    runs one: after a later capture, a process's torch cycle graphs sometimes replay 10% slower for the rest of it
    (H100 and H200, docs/journal), and a fresh cycle to time would make the timed graph the second captured."""
    start = time.perf_counter()
    seconds_per_step(cycle, prompt, first_steps, warm_up)
    log(f"  {first_run} in {time.perf_counter() - start:.1f} s")
    step, median = seconds_per_step(cycle, prompt, args.steps, warm_up)
    log(f"  {args.steps} steps timed: {1e3 * step:.3f} ms a step (median {1e3 * median:.3f})")
    tokens = greedy_tokens(cycle, prompt, args.tokens)
    log(f"  {len(tokens)} greedy tokens decoded")
    return step, median, tokens


def logits_digest(engine, prompt: list[int]) -> str:
    """A digest of the float32 logits of one verify forward of k_max + 1 tokens after `prompt`: equal digests
    on 1 and N devices mean they compute the same bits, a stronger test than the greedy tokens of random weights."""
    import hashlib

    import numpy as np

    pending = int(engine.prefill([prompt])[0])
    tokens = [[pending] + [(pending + 1 + i) % engine.vocab_size for i in range(engine.k_max)]]
    if hasattr(engine, "device"):  # torch
        import torch

        tokens = torch.tensor(tokens)
    else:
        import jax.numpy as jnp

        tokens = jnp.asarray(tokens, jnp.int32)
    logits = engine.verify(tokens).logits
    logits = logits.float().cpu().numpy() if hasattr(logits, "cpu") else np.asarray(logits, np.float32)
    return hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest()[:16]


def time_verify(engine, prompt: list[int], T: int, reps: int) -> float:
    """Median seconds of a T-token verify (graph replay) at a fixed position of a TorchEngine, synchronised."""
    import torch

    pending = engine.prefill([prompt])
    tokens = pending[:, None].expand(1, T).contiguous()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    return median_seconds(lambda: (engine.verify(tokens), sync()), reps)


def measure_torch(cfg, checkpoint: Path | None, prompt: list[int], args, tp: int) -> dict | None:
    """None on the ranks past the first of a tensor-parallel run (the first reports)."""
    import torch

    from specdec.engines.cycle_torch import FusedCycle
    from specdec.engines.verifier_torch import TorchEngine
    from specdec.models.gemma_torch import GemmaModel

    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    group, rank = None, 0
    if tp > 1:
        import torch.distributed as dist

        from specdec.api import init_distributed

        rank, group = init_distributed(cuda), dist.group.WORLD
        if cuda:
            device = f"cuda:{torch.cuda.current_device()}"
    if checkpoint:
        model = GemmaModel.from_checkpoint(checkpoint, dtype=dtype, device=device, max_seq_len=args.context,
                                           tp_group=group, tp_parts=args.tp_parts, fp8=args.fp8)
    else:
        model = GemmaModel.random(cfg, dtype, device, args.context, tp_group=group, tp_parts=args.tp_parts,
                                  fp8=args.fp8)
    engine = TorchEngine(model, max_seq_len=args.context, k_max=args.k_max, compile=cuda and args.torch_compile)
    with torch.inference_mode():
        step, median, tokens = time_plain_decode(FusedCycle(engine, None, 0), prompt, args, 8, 3,
                                                 "compiled and captured")
        digest = logits_digest(engine, prompt)
        log(f"  logits digest {digest}")

        def verify_s(width: int) -> float:
            per_width = TorchEngine(model, max_seq_len=args.context, k_max=max(width - 1, 1), invariant=False,
                                    compile=False)
            return time_verify(per_width, prompt, width, 20)

        verify_ms = {str(width): 1e3 * verify_s(width) for width in args.verify_widths}
    bandwidth = 0.0
    if cuda:
        x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        y.copy_(x)
        begin.record()
        for _ in range(10):
            y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        bandwidth = 2 * x.numel() * 10 / (begin.elapsed_time(end) / 1e3)
    if rank > 0:
        return None
    return {"step_s": step, "step_median_s": median, "copy_bandwidth": bandwidth, "width": engine.width,
            "itemsize": dtype.itemsize,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "version": torch.__version__,
            "compiled": cuda and args.torch_compile, "tokens": tokens, "logits_digest": digest, "verify_ms": verify_ms}


def measure_jax(cfg, checkpoint: Path | None, prompt: list[int], args, tp: int) -> dict:
    import jax
    import jax.numpy as jnp

    import specdec.compile_cache as compile_cache
    from specdec.engines.cycle_jax import JaxFusedCycle
    from specdec.engines.verifier_jax import JaxEngine
    from specdec.models.gemma_jax import load_params, random_params
    from specdec.models.sharding_jax import make_mesh

    compile_cache.enable_jax()
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" and not args.tiny else jnp.float32
    split = dict(mesh=make_mesh(tp) if tp > 1 else None, tp_parts=args.tp_parts)
    pack = tp == 1 and args.tp_parts is None  # as a one-device engine holds them
    if checkpoint:
        cfg, params = load_params(checkpoint, dtype, pack=pack, fp8=args.fp8)
    else:
        # Split over a mesh or in parts, the weights are made a layer at a time into host memory, and the engine
        # places each device's share: the whole 31B (62 GB) made on the first H100 left no room there for its share.
        params = random_params(cfg, jax.random.key(0), dtype, pack=pack, place=None if pack else jax.device_get,
                               fp8=args.fp8)
    engine = JaxEngine(cfg, params, max_seq_len=args.context, k_max=args.k_max, **split)
    del params  # a mesh's shards are copies: one model's weights held, not two
    step, median, tokens = time_plain_decode(JaxFusedCycle(engine, None, 0), prompt, args, 16, 16, "compiled")
    digest = logits_digest(engine, prompt)

    def verify_s(width: int) -> float:
        per_width = JaxEngine(cfg, engine.params, max_seq_len=args.context, k_max=max(width - 1, 1), invariant=False,
                              **split)
        pending = per_width.prefill([prompt])
        ids = jnp.broadcast_to(jnp.asarray(pending, jnp.int32)[:, None], (1, width))
        return median_seconds(lambda: per_width.verify(ids).logits.block_until_ready(), 20)

    verify_ms = {str(width): 1e3 * verify_s(width) for width in args.verify_widths}
    bandwidth = 0.0
    if jax.default_backend() == "gpu":
        x = jnp.zeros(1 << 29, jnp.float32)
        copy = jax.jit(lambda a: a + 1)
        copy(x).block_until_ready()
        begin = time.perf_counter()
        for _ in range(10):  # back to back, one wait: as torch's events time its copies
            y = copy(x)
        y.block_until_ready()
        bandwidth = 2 * x.nbytes * 10 / (time.perf_counter() - begin)
    device = jax.devices()[0]
    return {"step_s": step, "step_median_s": median, "copy_bandwidth": bandwidth, "width": engine.width,
            "itemsize": jnp.dtype(dtype).itemsize,
            "device": device.device_kind, "version": jax.__version__, "compiled": True, "tokens": tokens,
            "logits_digest": digest, "verify_ms": verify_ms}


def child(engine: str, name: str, tp: int, args) -> dict | None:
    """One (engine, model, device count) measurement, in this process (one rank's, under torchrun)."""
    import numpy as np

    from specdec.models.config import GemmaConfig

    raw = model_config(name, args)
    cfg = GemmaConfig.from_dict(raw)
    checkpoint = checkpoint_270m() if name == "270m" and not (args.tiny or args.config_270m) else None
    prompt = [cfg.bos_token_id] + np.random.default_rng(0).integers(3, cfg.vocab_size, PROMPT_TOKENS - 1).tolist()
    log(f"{engine} {name} on {tp} device(s): {cfg.num_layers} layers, "
        f"{'checkpoint ' + str(checkpoint) if checkpoint else 'random weights'}")
    result = (measure_torch if engine == "torch" else measure_jax)(cfg, checkpoint, prompt, args, tp)
    if result is None:
        return None
    return dict(result, engine=f"{engine}-fp8" if args.fp8 else engine, model=name, tensor_parallel=tp,
                tp_parts=args.tp_parts, bytes_per_step=step_bytes(cfg, result["itemsize"], args.context, args.k_max,
                                                                  args.fp8),
                **({"layers": cfg.num_layers} if args.layers else {}))


def child_command(engine: str, name: str, tp: int, args) -> tuple[list[str], dict]:
    """The command and environment of one measurement: torch over N devices is N processes under torchrun;
    JAX over N devices is one process (N CPU devices made up for a --tiny run)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")  # a 31B's weights are 77% of an H100
    launcher = [sys.executable, "-m"]
    if engine == "torch" and tp > 1:
        launcher += ["torch.distributed.run", "--nproc-per-node", str(tp), "-m"]
    elif engine == "jax" and tp > 1 and args.tiny:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}".strip()
    if engine == "jax" and args.tp_parts:
        from specdec.models.config import with_parts_xla_flags

        env["XLA_FLAGS"] = with_parts_xla_flags(env.get("XLA_FLAGS", ""))
    command = launcher + ["specdec.bench.roofline", "--child", f"{engine}:{name}:{tp}", "--steps", str(args.steps),
                          "--tokens", str(args.tokens), "--context", str(args.context),
                          "--k-max", str(args.k_max)]
    command += ["--tiny"] * args.tiny + ["--no-torch-compile"] * (not args.torch_compile)
    command += ["--verify-widths", ",".join(map(str, args.verify_widths))] if args.verify_widths else []
    command += ["--config-270m", str(args.config_270m)] if args.config_270m else []
    command += ["--tp-parts", str(args.tp_parts)] if args.tp_parts else []
    command += ["--layers", str(args.layers)] if args.layers else []
    command += ["--fp8"] * args.fp8
    return command, env


def run_all(args) -> tuple[dict, list[str]]:
    """Every (engine, model, device count) in a child process; the record is rewritten after each (a run cut
    short keeps what it measured). -> (the record, the measurements that failed)."""
    rows: list[dict] = []
    failed: list[str] = []
    for name in args.models.split(","):
        for engine in args.engines.split(","):
            for tp in map(int, args.tensor_parallel.split(",")):
                command, env = child_command(engine, name, tp, args)
                status, row = run_child(command, env)
                if status != 0 or row is None:
                    failed.append(f"{engine} {name} on {tp} device(s)")
                    log(f"{failed[-1]}: failed (exit {status})")
                    continue
                rows.append(row)
                args.out.write_text(json.dumps(summarise(rows, args.steps, args.context, args.k_max), indent=1))
    return summarise(rows, args.steps, args.context, args.k_max), failed


def summarise(rows: list[dict], steps: int, context: int, k_max: int) -> dict:
    bandwidth = max((r["copy_bandwidth"] for r in rows), default=0.0)  # one device's, at its best measurement
    for r in rows:
        tp = r.get("tensor_parallel", 1)
        r["roofline_tok_s"] = tp * bandwidth / r["bytes_per_step"]["total"] if bandwidth else None
        r["tok_s"] = 1 / r["step_s"]
        r["fraction_of_roofline"] = r["tok_s"] / r["roofline_tok_s"] if bandwidth else None
    from specdec.evidence import git_commit

    return {"benchmark": "roofline", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "device": rows[0]["device"] if rows else None, "copy_bandwidth": bandwidth,
            "context": context, "k_max": k_max, "steps": steps, "rows": rows}


def merge(paths: list[Path]) -> dict:
    """One record of several runs' rows (e.g. one device and two, run apart), their date and commit kept per row."""
    records = [json.loads(p.read_text()) for p in paths]
    rows = [dict(r, date=rec["date"], commit=rec["commit"]) for rec in records for r in rec["rows"]]
    if len(records) == 1:
        return records[0]
    context = records[0].get("context", CONTEXT)
    return dict(summarise(rows, records[0]["steps"], context, records[0]["k_max"]), date=records[-1]["date"],
                commit=records[-1]["commit"], merged_from=[str(p) for p in paths])


def row_commits(record: dict) -> set[str]:
    return {r.get("commit", record["commit"]) for r in record["rows"]}


def table(record: dict) -> str:
    """Per row: its tensor-parallel parts, the fraction of roofline, JAX's step over torch's (same model and
    devices, no parts), the speed-up over the same engine and parts on one device, whether its greedy tokens are
    that run's ("from i": they differ from token i on) and its logits digest too ("bits"), and how many distinct
    tokens they hold (random weights at depth often repeat one token, which makes the tokens' comparison weak);
    and each row's commit where merged runs differ in it."""
    merged = len(row_commits(record)) > 1
    lines = [f"{record['device']}: copy bandwidth {record['copy_bandwidth'] / 1e9:.0f} GB/s per device, batch 1, "
             f"invariant width {', '.join(sorted({str(r['width']) for r in record['rows']}))} rows",
             f"{'model':<6} {'engine':<6} {'devs':>4} {'parts':>5} {'GB/step':>8} {'step ms':>8} {'tok/s':>8} "
             f"{'roofline':>9} {'fraction':>9} {'jax/torch':>10} {'x 1 dev':>8} {'= 1 dev':>8} {'bits':>5} {'distinct':>8}"
             + ("  commit" if merged else "")]
    key = lambda r: (r["model"], r["engine"], r.get("tensor_parallel", 1), r.get("tp_parts"))  # noqa: E731
    by_key = {key(r): r for r in record["rows"]}
    for r in record["rows"]:
        model, engine, tp, parts = key(r)
        torch_row, jax_row = by_key.get((model, "torch", tp, None)), by_key.get((model, "jax", tp, None))
        ratio = jax_row["step_s"] / torch_row["step_s"] if torch_row and jax_row else math.nan
        single = by_key.get((model, engine, 1, parts))
        speedup = single["step_s"] / r["step_s"] if single and tp > 1 else math.nan
        compared = single is not None and tp > 1
        index = first_difference(single["tokens"], r["tokens"]) if compared and "tokens" in r else None
        same = "" if not compared or "tokens" not in r else "yes" if index is None else f"from {index}"
        bits = "" if not compared or "logits_digest" not in r else (
            "yes" if r["logits_digest"] == single.get("logits_digest") else "no")
        roof, frac = r["roofline_tok_s"], r["fraction_of_roofline"]
        lines.append(f"{model:<6} {engine:<6} {tp:>4} {parts or '':>5} {r['bytes_per_step']['total'] / 1e9:>8.3f} "
                     f"{r['step_s'] * 1e3:>8.3f} {r['tok_s']:>8.1f} {roof or math.nan:>9.1f} {frac or math.nan:>9.2f} "
                     f"{ratio:>10.2f} {speedup:>8.2f} {same:>8} {bits:>5} {len(set(r.get('tokens', []))):>8}"
                     + (f"  {r['commit']}" if merged else ""))
    for r in record["rows"]:
        verify = {int(t): ms for t, ms in r.get("verify_ms", {}).items()}
        if 1 in verify:
            lines.append(f"{r['model']} {r['engine']} on {r.get('tensor_parallel', 1)}: verify, per-width forwards: "
                         + " ".join(f"T={t} {ms:.2f} ms ({ms / verify[1]:.2f}x)" for t, ms in sorted(verify.items())))
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def group(r: dict) -> str:
        tp, parts = r.get("tensor_parallel", 1), r.get("tp_parts")
        name = r["model"] + (f" ({r['layers']} layers)" if r.get("layers") else "")
        return (name if tp == 1 else f"{name} on {tp}") + (f", {parts} parts" if parts else "")

    def series(r: dict) -> str:  # runs of several commits merged: one bar per engine and commit
        return f"{r['engine']} {r['commit']}" if merged else r["engine"]

    merged = len(row_commits(record)) > 1
    groups = list(dict.fromkeys(map(group, record["rows"])))
    engines = list(dict.fromkeys(map(series, record["rows"])))
    fig, ax = plt.subplots(figsize=(7 if len(engines) < 3 else 10, 4))
    width = 0.8 / max(len(engines), 1)
    for i, engine in enumerate(engines):
        fractions = [next((r["fraction_of_roofline"] or 0 for r in record["rows"] if group(r) == g and series(r) == engine),
                          math.nan) for g in groups]  # nan: not measured, no bar
        bars = ax.bar([j + i * width for j in range(len(groups))], fractions, width, label=engine)
        ax.bar_label(bars, labels=["" if math.isnan(f) else f"{f:.2f}" for f in fractions])
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(groups))], groups)
    ax.axhline(1.0, color="gray", ls="--")
    ax.set(ylabel="plain decode / roofline", title=f"fraction of the memory roofline, {record['device']}, batch 1",
           xlabel="model (on N devices: tensor parallel, against N devices' bandwidth)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    swept = [r for r in record["rows"] if r.get("verify_ms")]
    if swept:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in swept:
            widths = sorted(int(t) for t in r["verify_ms"])
            ax.plot(widths, [r["verify_ms"][str(t)] for t in widths],
                    "o-", label=f"{r['model']} {r['engine']}" + (f" on {r['tensor_parallel']}" if r.get("tensor_parallel", 1) > 1 else ""))
        ax.set(xlabel="tokens per verify forward (T)", ylabel="ms", ylim=(0, None),
               title=f"verify step time against T, per-width forwards, {record['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_name(path.stem + "-verify.png"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec roofline", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("roofline.json"),
                        help="JSON results, rewritten after each measurement (a run cut short keeps what it measured)")
    parser.add_argument("--plot", type=Path, help="PNG of the fraction of roofline per model (and PLOT-verify.png "
                        "of step time against T with --verify-widths)")
    parser.add_argument("--models", default="270m,31b,e4b", help="comma-separated: 270m, 31b, e4b")
    parser.add_argument("--engines", default="torch,jax", help="comma-separated: torch, jax")
    parser.add_argument("--config-270m", type=Path, help="the 270M's config.json: random weights at its shapes")
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed per (engine, model)")
    parser.add_argument("--tensor-parallel", default="1", help="comma-separated device counts, e.g. 1,2")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens kept per row (compared across devices)")
    parser.add_argument("--context", type=int, default=CONTEXT, help="cache positions (a sliding ring is the window "
                        "and a verify forward's slots, at most the context: 1,088 slots for the 31B past 1,088)")
    parser.add_argument("--layers", type=int, help="cut each model to its first N layers (shorter compiles, the "
                        "same layer shapes; the 270m and 31b)")
    parser.add_argument("--tp-parts", type=int, help="compute each split weight in this many parts on every "
                        "device count (config.check_tp_parts), so that 1..P devices compute the same bits")
    parser.add_argument("--no-torch-compile", dest="torch_compile", action="store_false",
                        help="torch: CUDA graphs of the eager forward (no torch.compile)")
    parser.add_argument("--verify-widths", type=lambda text: [int(t) for t in text.split(",")], default=[],
                        help="comma-separated T: also time a T-token verify forward per width, e.g. 1,2,4,5,8,9")
    parser.add_argument("--k-max", type=int, default=DEFAULT_DRAFTS, help="the engines' largest K, which sets their "
                        "decode width (k_max + 1 rounded up to 8 rows) [default: specdec generate's --k]")
    parser.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (smoke test)")
    parser.add_argument("--fp8", action="store_true", help="FP8 linears (specdec.models.fp8), their rows "
                        "labelled ENGINE-fp8 and their roofline at FP8's bytes")
    parser.add_argument("--replot", type=Path, nargs="+", help="print and draw results files (merged) and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [args.child.split(":")[1]] if args.child else args.models.split(",")  # a child runs its own
    needed = PROMPT_TOKENS + MOST_WARM_UP + max(args.steps, args.tokens) + 2 * (args.k_max + 1)  # a cycle's slack too
    if args.k_max < 1:
        parser.error(f"--k-max must be at least 1, got {args.k_max}")
    if args.context < needed:
        parser.error(f"--context {args.context} is too short for a {PROMPT_TOKENS}-token prompt and {MOST_WARM_UP} + "
                     f"{max(args.steps, args.tokens)} decode steps: at least {needed}")
    if args.layers and "e4b" in models:
        parser.error("--layers does not cut e4b, whose last layers share the caches of earlier ones")
    if args.child:
        engine, name, tp = args.child.split(":")
        result = child(engine, name, int(tp), args)
        if result is not None:  # a torchrun group's first rank
            say({"result": result})
        if engine == "torch" and int(tp) > 1:
            from specdec.api import leave_distributed

            log(f"  rank {os.environ['RANK']}: leaving the group")
            leave_distributed()
        return
    record, failed = (merge(args.replot), []) if args.replot else run_all(args)
    print(table(record))
    if args.plot and record["rows"]:
        plot(record, args.plot)
    if failed:
        sys.exit(f"specdec roofline: {len(failed)} measurement(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
