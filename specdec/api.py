"""The Python API: `specdec.load(...)` a target (weights, tokenizer, engine) and `specdec.generate(...)`."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from specdec.drafters.registry import DrafterSource
from specdec.errors import SpecdecError
from specdec.generate import Generation, HostCycle, StopCondition, check_context, run_cycles
from specdec.models.config import GemmaConfig, decode_width, with_parts_xla_flags
from specdec.models.gguf_import import resolve_checkpoint
from specdec.models.tokenizer import Tokenizer
from specdec.protocol import DEFAULT_DRAFTS
from specdec.sampling import SamplingParams

ENGINES = ("torch", "jax")
DTYPES = ("float32", "bfloat16", "float16")  # what both engines compute in


@dataclass
class Target:
    """A loaded target model: its checkpoint, tokenizer and verifier engine."""

    path: Path
    config: GemmaConfig
    tokenizer: Tokenizer
    engine: object  # a specdec.protocol.Verifier
    engine_name: str
    load_s: float = 0.0  # reading the tokenizer and weights, building the engine (the JAX engine's transfer aside)
    load_started: float = 0.0  # perf_counter when load began

    def check_tokenizer(self) -> None:
        """The tokenizer's ids must all be the model's (waits for a tokenizer still being parsed in a child)."""
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise SpecdecError(f"{self.path}: tokenizer has {self.tokenizer.vocab_size} tokens, the model "
                               f"{self.config.vocab_size}")

    @property
    def weights_ready_at(self) -> float:
        """perf_counter when the weights were on the device: after load returned where the JAX engine moved
        them in a thread (JaxEngine.from_checkpoint's background)."""
        ready = getattr(self.engine, "weights_ready_at", None)
        return self.load_started + self.load_s if ready is None else max(ready, self.load_started + self.load_s)


def load(
    target: str | Path | None = None,
    engine: str = "torch",
    device: str | None = None,
    dtype: str | None = None,
    k_max: int = 8,
    max_seq_len: int = 4096,
    batch: int = 1,
    hidden_layers: tuple[int, ...] = (),
    invariant: bool = True,
    compile: bool = False,
    tensor_parallel: int = 1,
    tp_parts: int | None = None,
    tokenizer_in_child: bool = False,
    fp8: bool = False,
    graph_prefill: bool = False,
) -> Target:
    """Load a target for generation. Defaults: the embedded Gemma 3 270M, the PyTorch engine, CUDA in
    bf16 when there is a GPU, else CPU in fp32, row-invariant forwards (greedy speculative output is the
    plain decode's; `invariant=False` is faster on CPU but can differ at floating-point near-ties).
    `k_max`, the most drafts a cycle verifies, sets the invariant width every forward runs: k_max + 1 rounded up
    to 8 rows. On an H200, 16 rows (k_max 8-15) cost a plain step 3-4% more than 8 (k_max 1-7) on the 270M and
    31B shapes (docs/journal).

    `compile` spends compile time on what many requests repay. Torch on CUDA: torch.compile fuses the forward
    before capturing CUDA graphs: about 2.5x faster decoding of the 270M, for about 45 s of
    compilation on a machine's first run and 10 s later (inductor's cache, see specdec.compile_cache). Without it
    the CUDA graphs replay the eager forward and set up in a fraction of a second: the better choice for short
    runs. The JAX engine always compiles (and caches its programs on disk); `compile` gives it prefill's own
    program (JaxEngine's prefill_chunk, PREFILL_CHUNK tokens a forward), which a one-off command would wait for
    beside its cycle program. Either way plain and speculative runs of one target prefill alike.

    `graph_prefill` (torch, compiled, on CUDA): prefill replayed as CUDA graphs, a prompt's prefill ~2.5x shorter, but
    every decode cycle of the process slower (TorchEngine's graph_prefill): for short requests.

    `tensor_parallel` > 1 splits the attention heads and MLP columns over that many devices. JAX: a mesh of
    this process's first devices. PyTorch: one process per device over torch.distributed, each of which calls
    load (launch with `torchrun --nproc-per-node N` and join its group with init_distributed first); every
    process then runs the same generation and gets the same tokens.

    `tp_parts`: compute every split weight in that many parts, on any device count that divides it
    (config.check_tp_parts), so that 1, 2, ... devices decode the same tokens; without it, a bf16 model on
    2 devices does not decode what it decodes on 1.

    `fp8` (either engine, tensor-parallel too): the linears as FP8 values with a float32 scale per output row
    (specdec.models.fp8), read at one byte a weight; the gates hold for the FP8 model as for the bf16 one.

    `tokenizer_in_child`, for one-off generations: the tokenizer is parsed in a child process while this one
    loads the engine, which takes its parse (about 1.4 s for Gemma's, holding the GIL) off the cold start; each
    encode and decode is then a round trip to that process, so servers and benchmarks keep it in this one.
    `generate` then checks the tokenizer against the model (Target.check_tokenizer), after its programs start
    compiling, rather than load waiting for the parse."""
    if engine not in ENGINES:
        raise SpecdecError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    if k_max < 0:
        raise SpecdecError(f"k_max must be >= 0, got {k_max}")
    if dtype is not None and dtype not in DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if max_seq_len <= decode_width(k_max):
        raise SpecdecError(f"a context of {max_seq_len} positions is too small: a decode forward alone writes "
                           f"{decode_width(k_max)} (k_max {k_max}), and a prompt needs one more")
    path = resolve_checkpoint(target)
    positions = GemmaConfig.from_file(path / "config.json").max_position_embeddings
    if max_seq_len > positions:
        raise SpecdecError(f"a context of {max_seq_len} positions is beyond the model's {positions} "
                           f"({path / 'config.json'}: max_position_embeddings)")
    start = time.perf_counter()
    # First, so that a missing tokenizer fails fast. In a thread beside the engine's load its parse would overlap
    # nothing (it holds the GIL: docs/journal); in a child process it does.
    tokenizer = Tokenizer.from_dir(path, in_child=tokenizer_in_child)
    verifier, cfg = _load_engine(path, engine, device, dtype, k_max, max_seq_len, batch, hidden_layers, invariant,
                                 compile, tensor_parallel, tp_parts, fp8, graph_prefill)
    target = Target(path, cfg, tokenizer, verifier, engine, time.perf_counter() - start, start)
    if not tokenizer_in_child:  # else generate checks, once its programs compile: the parse may be under way
        target.check_tokenizer()
    return target


def _load_engine(path, engine, device, dtype, k_max, max_seq_len, batch, hidden_layers, invariant, compile,
                 tensor_parallel=1, tp_parts=None, fp8=False, graph_prefill=False):
    import specdec.compile_cache as compile_cache

    if tensor_parallel < 1:
        raise SpecdecError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if engine == "torch":
        import torch

        from specdec.engines.verifier_torch import TorchEngine
        from specdec.models.gemma_torch import GemmaModel

        tp_group = _torch_tp_group(tensor_parallel)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        _check_torch_device(device)
        if tp_group is not None and device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"  # init_distributed picked this process's GPU
        torch_dtype = getattr(torch, dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        compile_cache.enable_torch()
        model = GemmaModel.from_checkpoint(path, dtype=torch_dtype, device=device, max_seq_len=max_seq_len,
                                           tp_group=tp_group, tp_parts=tp_parts, fp8=fp8)
        verifier = TorchEngine(model, batch=batch, max_seq_len=max_seq_len, k_max=k_max, hidden_layers=hidden_layers,
                               invariant=invariant, compile=compile and device.startswith("cuda"),
                               graph_prefill=graph_prefill)
        cfg = model.cfg
    else:
        from specdec.engines.verifier_jax import PREFILL_CHUNK, JaxEngine

        # XLA reserves 75% of a GPU's memory when it first starts: 1-2 s of every command on an H200
        # (docs/journal, issue 8). Allocate on demand instead, unless the user has chosen.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        if tp_parts is not None:  # read when JAX starts, before the first device is used below
            os.environ["XLA_FLAGS"] = with_parts_xla_flags(os.environ.get("XLA_FLAGS", ""))
        compile_cache.enable_jax()
        mesh = None
        if tensor_parallel > 1:
            import jax

            from specdec.models.sharding_jax import make_mesh

            if tensor_parallel > len(jax.devices()):
                raise SpecdecError(f"tensor parallelism over {tensor_parallel} devices, but JAX sees {len(jax.devices())}")
            mesh = make_mesh(tensor_parallel)
        # Without a mesh, the weights go to the device in a thread, while programs compile (JaxFusedCycle's
        # compile_ahead): 1.3-1.7 s of a first run on an H200 that the compile no longer waits for.
        verifier = JaxEngine.from_checkpoint(
            path, dtype=dtype, batch=batch, max_seq_len=max_seq_len, k_max=k_max, hidden_layers=hidden_layers,
            invariant=invariant, mesh=mesh, tp_parts=tp_parts, background=mesh is None and tp_parts is None, fp8=fp8,
            prefill_chunk=PREFILL_CHUNK if compile and tp_parts is None else None,
        )
        cfg = verifier.cfg
    return verifier, cfg


def _check_torch_device(device: str) -> None:
    """The torch engine runs on the CPU or a CUDA device that torch sees."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise SpecdecError(f"unknown device {device!r} (cpu, cuda or cuda:N)")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise SpecdecError(f"device {device!r}: torch sees {count or 'no'} CUDA device{'s' * (count != 1)}")


def init_distributed(cuda: bool | None = None) -> int:
    """Join the torch.distributed group that torchrun set up, one process per device: NCCL with each process on
    its LOCAL_RANK's GPU, or gloo on the CPU (`cuda` False, or no GPU); -> this process's rank. Leave it with
    leave_distributed."""
    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        raise SpecdecError("tensor parallelism in the torch engine runs one process per device: launch with "
                           "torchrun --nproc-per-node N")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank()


def leave_distributed() -> None:
    """End this process once its work is done and its output written: the ranks meet, then os._exit, past the
    group's teardown. A gloo rank torn down while the other still held their pair aborted ("terminate called
    without an active exception", 1 run in 6 without the meeting; test workers that left by the teardown aborted
    twice in CI since); NCCL's teardown hangs once its collectives were captured in CUDA graphs (pytorch#115388,
    seen on two H100s)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _torch_tp_group(tensor_parallel: int):
    """The torch.distributed group a tensor-parallel torch engine runs over (None for one device)."""
    if tensor_parallel == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != tensor_parallel:
        raise SpecdecError(f"tensor parallelism over {tensor_parallel} devices in the torch engine runs one process per "
                           f"device: launch with torchrun --nproc-per-node {tensor_parallel}")
    return dist.group.WORLD


def make_cycle(target: Target, drafter: str | DrafterSource, k: int, sampling: SamplingParams,
               fused: bool | None = None):
    """The cycle a generation runs, greedy or sampled. Fused (the default where it pays): the drafter runs
    on the device and the whole draft -> verify -> accept cycle is one CUDA graph replay (torch on CUDA),
    or 8 cycles are one compiled call (JAX); plain decoding is the same cycle with k = 0. Otherwise driven from the host
    (torch on the CPU, where there are no graphs to replay)."""
    if not 0 <= k <= target.engine.k_max:
        raise SpecdecError(f"k={k} is outside 0..{target.engine.k_max} (the engine's captured maximum)")
    draft = make_drafter(drafter, target, k, sampling) if k > 0 else None
    k = k if draft is not None else 0
    if fused is None:
        fused = target.engine_name == "jax" or target.engine.use_graphs
    if not fused:
        return HostCycle(target.engine, draft, k, sampling)
    draft_fn = draft.device_draft_fn(target.engine_name, k) if draft is not None else None
    if target.engine_name == "jax":
        from specdec.engines.cycle_jax import JaxFusedCycle

        return JaxFusedCycle(target.engine, draft_fn, k, sampling)
    from specdec.engines.cycle_torch import FusedCycle

    return FusedCycle(target.engine, draft_fn, k, sampling)


class WarmUp:
    """Compile and capture what a run of `cycle` uses. A JAX cycle starts compiling in threads when this is
    made, beside whatever the caller does next (encoding the prompts; the weights' transfer); `finish` runs
    two tokens of the cycle on the prompts -> (seconds since `started`: the compile's start, else finish's,
    the persistent caches' hits and misses). The run timed next then measures decoding alone."""

    def __init__(self, cycle, engine_name: str = "torch"):
        import specdec.compile_cache as compile_cache

        self.cycle, self.started = cycle, None
        self._watch = compile_cache.watch(engine_name)  # counts the compiling threads' events too
        self.report = self._watch.__enter__()
        if hasattr(cycle, "compile_ahead"):
            self.started = time.perf_counter()
            cycle.compile_ahead(StopCondition(2))

    def finish(self, prompts: list[list[int]], k: int):
        self.started = self.started or time.perf_counter()
        try:
            run_cycles(self.cycle, prompts, k, StopCondition(2))
        finally:
            self._watch.__exit__(None, None, None)
        return time.perf_counter() - self.started, self.report


def warm_up(cycle, prompts: list[list[int]], k: int, engine_name: str = "torch"):
    """WarmUp of `cycle`, finished at once."""
    return WarmUp(cycle, engine_name).finish(prompts, k)


def drafter_source(spec: str | DrafterSource, target: str | Path | None = None) -> DrafterSource:
    """The drafter a spec names for a target checkpoint; a DrafterSource (opened once for many runs) as it is."""
    return spec if isinstance(spec, DrafterSource) else DrafterSource(spec, target)


def drafter_taps(spec: str | DrafterSource, target: str | Path | None = None) -> tuple[int, ...]:
    """The target layers whose hidden states the drafter reads (load the target with them)."""
    return drafter_source(spec, target).taps


def make_drafter(spec: str | DrafterSource, target: Target, k: int = 0, sampling: SamplingParams = SamplingParams()):
    """The drafter a spec names (or a DrafterSource opened once for many runs), built for the target's engine, k and
    sampling (its engine must return the drafter's taps, see drafter_taps)."""
    return drafter_source(spec, target.path).build(target.engine, k, sampling)


def generate(
    prompt: str | Sequence[str],
    target: Target | str | Path | None = None,
    drafter: str | DrafterSource = "ngram",
    k: int = DEFAULT_DRAFTS,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    stop_strings: Sequence[str] = (),
    chat: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    fused: bool | None = None,
    compare_plain: bool = False,
) -> tuple[list[str], Generation]:
    """Generate a completion per prompt; returns the texts and the Generation (tokens, SpecStats).
    `on_text(row, text)` streams decoded text as tokens are accepted. `fused` runs each cycle on the device (see
    make_cycle); None: where that pays (torch on CUDA, JAX).
    `compare_plain` first runs a plain decode of the same prompts on the same engine and kind of cycle,
    so the stats carry the speedup over it. The stats time set-up (load, compile), prefill and decoding
    apart."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not isinstance(target, Target):
        target = load(target, batch=len(prompts), k_max=max(k, 0), hidden_layers=drafter_taps(drafter, target),
                      tokenizer_in_child=True)
    tok = target.tokenizer
    if chat and not tok.has_chat_template:
        raise SpecdecError(f"{target.path}: this checkpoint has no chat template (a base model: use plain prompts)")
    cycle = make_cycle(target, drafter, k, sampling, fused)
    k = cycle.k  # 0 without a drafter
    warm = WarmUp(cycle, target.engine_name)  # JAX: compiling from here on, beside the encoding and the weights' transfer
    target.check_tokenizer()
    if chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        ids = [tok.encode(p, add_bos=False) for p in prompts]
    else:
        ids = [tok.encode(p) for p in prompts]
    stop = StopCondition(max_new_tokens, tok.eos_ids, stop_strings, decode=tok.decode)
    check_context(target.engine, ids, max_new_tokens)  # before the warm-up's shorter run could refuse it in its terms
    decoders = [tok.stream_decoder() for _ in prompts]

    def stream(row: int, tokens: list[int]) -> None:
        text = decoders[row].push(tokens)
        if text and on_text is not None:
            on_text(row, text)

    compile_s, cache_report = warm.finish(ids, k)  # first: nothing compiles beside the timed runs
    baseline = None
    if compare_plain:  # like with like: the same engine and kind of cycle, set up before it is timed
        plain = make_cycle(target, "none", 0, sampling, fused)
        warm_up(plain, ids, 0)
        baseline = run_cycles(plain, ids, 0, stop).stats.tok_s
    result = run_cycles(cycle, ids, k, stop, on_tokens=stream)
    stats = result.stats
    stats.baseline_tok_s, stats.load_s, stats.compile_s, stats.compile_cache = (
        baseline, target.weights_ready_at - target.load_started, compile_s, cache_report.label)
    if (beside := target.weights_ready_at - warm.started) >= 0.05:  # the set-up's two parts overlapped
        stats.compile_cache = "; ".join(filter(None, [stats.compile_cache, f"{beside:.1f} s of it beside loading"]))
    if on_text is not None:
        for row, dec in enumerate(decoders):
            if tail := dec.flush():
                on_text(row, tail)
    texts = [tok.decode(t) for t in result.tokens]
    for i, text in enumerate(texts):  # a stop string ends the text where it starts
        for s in stop_strings:
            if s in text:
                texts[i] = text[: text.index(s)]
    return texts, result
