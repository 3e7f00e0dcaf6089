"""`specdec`: the command line (generate, validate, bench, roofline, serve, corpus, distill, train, export, import-gguf,
inspect)."""

from __future__ import annotations

import functools
import io
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from specdec.drafters import registry as drafter_registry
from specdec.errors import SpecdecError
from specdec.protocol import DEFAULT_DRAFTS

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Lossless speculative decoding for Gemma models.")
err = Console(stderr=True)

TARGET_HELP = "checkpoint directory (HF layout); default: the embedded Gemma 3 270M"
# Measured on an H200 (270M, bf16): compiling costs 10 s with a warm inductor cache and saves ~3 ms per
# token, so it pays off from a few thousand tokens on.
COMPILE_FROM_TOKENS = 2048
# The sampling gate's draws per case at most: it holds them all in memory, 13.7 GB at this many (2 CPU cores, 6 min).
MAX_DRAWS = 1_000_000
# Set by a command that leaves nothing to clean up: main() then ends the process without the interpreter's
# teardown, which takes about 0.5 s after a JAX generate on an H200 (the XLA client, the CUDA context).
skip_teardown = False


def quiet_libraries() -> None:
    """Library warnings and log lines (inductor's, XLA's) stay out of the generated text."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"(torch|jax|jaxlib|flax|transformers)\b")
    for name in ("torch", "jax", "absl"):
        logging.getLogger(name).setLevel(logging.ERROR)


def user_errors(fn):
    """Bad input ends the command with one line on stderr and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecdecError as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


@app.command()
@user_errors
def generate(
    prompt: str = typer.Argument(..., help="completion prompt (or the user turn with --chat)"),
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP),
    drafter: str = typer.Option("ngram", help=drafter_registry.help_text()),
    engine: str = typer.Option("torch", help="torch | jax"),
    k: int = typer.Option(DEFAULT_DRAFTS, "-k", "--k", help="draft tokens per cycle"),
    max_new_tokens: int = typer.Option(128, help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 = off"),
    min_p: float = typer.Option(0.0),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], help="stop string (repeatable)"),
    chat: bool = typer.Option(False, help="wrap the prompt in the checkpoint's chat template"),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (torch engine)"),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16"),
    max_seq_len: int = typer.Option(4096, help="context length the KV cache holds"),
    fused: Optional[bool] = typer.Option(None, help="draft+verify+accept on the device: one CUDA graph replay (torch) or compiled step (JAX) per cycle [default: torch on CUDA, JAX]"),
    compare_plain: bool = typer.Option(False, help="also time a plain decode first and report the speedup"),
    invariant: bool = typer.Option(True, help="row-invariant forwards: greedy output identical to plain decoding"),
    compile: Optional[bool] = typer.Option(None, help="compile for throughput: torch.compile the forward (CUDA), ~2.5x faster decoding after 10-45 s of compiling; JAX: prefill's own program beside the cycle's [default: from 2048 new tokens on]"),
    tensor_parallel: int = typer.Option(1, help="split the model over N devices (torch: launch with torchrun --nproc-per-node N; JAX: this process's first N devices)"),
    tp_parts: Optional[int] = typer.Option(None, help="compute each split weight in P parts on any device count dividing P, so 1..P devices decode identical tokens (costs launches)"),
    fp8: bool = typer.Option(False, help="FP8 linears with a scale per output row, read at one byte a weight"),
):
    """Generate text, streaming it, then print set-up and decoding times, tau, acceptance and tok/s."""
    import specdec
    from specdec.sampling import SamplingParams

    check_text(prompt, "the prompt")
    if "" in stop:
        raise SpecdecError("--stop '': an empty stop string would end the text at its first token")
    check_room(max_seq_len, max_new_tokens, k)
    rank = 0
    if tensor_parallel > 1 and engine == "torch":
        from specdec.api import init_distributed

        rank = init_distributed()  # every process decodes the same tokens; the first one prints them

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    if k < 0:
        raise SpecdecError(f"-k must be >= 0, got {k}")
    if not invariant:
        err.print("[yellow]invariant forwards off: greedy output can differ from plain decoding at "
                  "floating-point near-ties[/yellow]")
    if compile is None:  # compiling pays for itself only over long generations (see specdec.load)
        compile = max_new_tokens >= COMPILE_FROM_TOKENS
    from specdec.api import drafter_taps

    loaded = specdec.load(target, engine=engine, device=device, dtype=dtype, k_max=max(k, 1), max_seq_len=max_seq_len,
                          invariant=invariant, compile=compile, hidden_layers=drafter_taps(drafter, target),
                          tensor_parallel=tensor_parallel, tp_parts=tp_parts, tokenizer_in_child=True, fp8=fp8)
    out = sys.stdout if rank == 0 else io.StringIO()
    unechoed = [prompt]  # the prompt goes out with the first text: an error before it leaves stdout empty

    def on_text(_row: int, text: str) -> None:
        out.write("".join(unechoed) + text)
        unechoed.clear()
        out.flush()

    _, result = specdec.generate(
        prompt, loaded, drafter=drafter, k=k, max_new_tokens=max_new_tokens, sampling=sampling,
        stop_strings=stop, chat=chat, on_text=on_text, fused=fused, compare_plain=compare_plain,
    )
    out.write("".join(unechoed) + "\n")
    s = result.stats
    if rank == 0:
        err.print(f"[dim]{engine}{' fp8' if fp8 else ''} · drafter {drafter if s.k else 'none'} · k={s.k} · "
                  f"{s.summary()}[/dim]",
                  highlight=False, soft_wrap=True)
    if tensor_parallel > 1 and engine == "torch":
        from specdec.api import leave_distributed

        leave_distributed()
    global skip_teardown
    skip_teardown = tensor_parallel == 1  # its text is written and its programs are in the persistent caches


@app.command()
@user_errors
def validate(
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP),
    engine: str = typer.Option("torch", help="torch | jax | all"),
    prompt: str = typer.Option("def fibonacci(n):", help="completion prompt the model gates decode from"),
    prompts: Optional[Path] = typer.Option(None, help="run every gate per prompt: a prompt file, JSONL rows with conversations, messages, text or prompt, or text with one prompt a line"),
    tokens: Optional[int] = typer.Option(None, help="tokens per decode [default: 640 on CUDA (past the sliding-window ring wrap), 48 on CPU]"),
    k_max: int = typer.Option(8, help="greedy and self-draft gates run K = 1 .. k_max"),
    drafter: str = typer.Option("ngram", help="the greedy gates' drafter (one that samples its own drafts is also "
                                "gated end to end with sampled drafts): " + drafter_registry.help_text(plain=False)),
    draws: int = typer.Option(100_000, help="draws per case of the sampling gate"),
    sampled_rows: int = typer.Option(2000, help="rows (draws) of the end-to-end sampled gate of an eagle3, model or mtp drafter"),
    self_draft: bool = typer.Option(True, help="run the self-draft gate (the target as its own drafter)"),
    invariant: bool = typer.Option(True, help="row-invariant forwards; without them greedy gates can fail at near-ties"),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (torch engine)"),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16"),
    evidence: Path = typer.Option(Path("specdec-validate.json"), help="JSON evidence file to write"),
    fp8: bool = typer.Option(False, help="FP8 linears with a scale per output row, read at one byte a weight"),
):
    """Run the lossless gates on one prompt or a file of them; print a table per prompt and a summary, write
    a JSON evidence file. Exit 1 on any failure."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from specdec import gates
    from specdec.data.sources import read_prompts
    from specdec.drafters.registry import DrafterSource
    from specdec.evidence import git_commit, now_utc
    from specdec.models.gguf_import import resolve_checkpoint
    from specdec.models.tokenizer import Tokenizer
    from specdec.progress import LoggedProgress

    if k_max < 1:
        raise SpecdecError(f"--k-max must be >= 1, got {k_max}")
    for flag, value in (("--tokens", tokens), ("--draws", draws), ("--sampled-rows", sampled_rows)):
        if value is not None and value < 1:
            raise SpecdecError(f"{flag} must be >= 1, got {value}")
    if draws > MAX_DRAWS:
        raise SpecdecError(f"--draws must be at most {MAX_DRAWS:,}: the sampling gate holds every draw in memory "
                           f"(14 GB at that many)")
    check_text(prompt, "--prompt")
    check_output_file(evidence, "--evidence")  # before the gates, whose record it keeps
    engines = ["torch", "jax"] if engine == "all" else [engine]
    on_cuda = _cuda_available() if device is None else device.startswith("cuda")
    tokens = tokens if tokens is not None else (640 if on_cuda else 48)
    path = resolve_checkpoint(target)
    tokenizer = Tokenizer.from_dir(path)
    texts = read_prompts(prompts, tokenizer) if prompts is not None else [prompt]
    prompt_ids = [tokenizer.encode(text) for text in texts]
    context = max(len(ids) for ids in prompt_ids) + tokens + 2 * (k_max + 8)
    if not invariant:
        err.print("[yellow]invariant forwards off: speculative output can differ from plain decoding at "
                  "floating-point near-ties, and the greedy gates then fail[/yellow]")
    source = DrafterSource(drafter, path)
    stateful = source.samples_drafts  # gated end to end with sampled drafts too
    factory = (lambda verifier, k: source.build(verifier, k)) if stateful else None
    eut, batch_engines = [], []
    for name in engines:
        units, batch_engine = _gate_engines(name, path, device, dtype, k_max, context, invariant, source.taps, fp8)
        eut += units
        batch_engines.append(batch_engine)
    steps = sum(2 + (self_draft and e.name.startswith("torch")) for e in eut) * len(texts) + len(engines) * (1 + stateful)
    results: list[tuple[int | None, gates.GateResult]] = []
    with LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, transient=True) as bar:
        task = bar.add_task("gates", total=steps)

        def step(message: str) -> None:
            bar.update(task, description=message)

        for i, ids in enumerate(prompt_ids):
            for result in gates.model_gates(eut, ids, tokens, k_max, self_draft,
                                            progress=lambda m, i=i: (step(f"prompt {i + 1}/{len(texts)} · {m}"),
                                                                     bar.advance(task)),
                                            drafter_factory=factory, drafter_name=source.name):
                results.append((i, result))
        for framework, batch_engine in zip(engines, batch_engines):
            step(f"{framework}: sampling rule, {draws} draws per case")
            results += [(None, r) for r in gates.gate_sampling(framework, draws=draws)]
            bar.advance(task)
            if stateful:
                step(f"{framework}: {source.name} drafter's sampled drafts end to end, {sampled_rows} draws")
                results.append((None, gates.gate_sampled_drafter(batch_engine(sampled_rows), source.build, prompt_ids[0])))
                bar.advance(task)
    _print_gate_tables(texts, results)
    record = {
        "date": now_utc(), "commit": git_commit(), "target": str(target or "embedded gemma-3-270m"),
        "engines": [e.name for e in eut], "drafter": drafter, "invariant": invariant, "fp8": fp8, "tokens": tokens, "k_max": k_max,
        "prompts": texts, "passed": all(r.passed for _, r in results),
        "gates": [{"prompt": i, "name": r.name, "passed": r.passed, "detail": r.detail} for i, r in results],
    }
    evidence.write_text(json.dumps(record, indent=1, default=str))
    passed = sum(r.passed for _, r in results)
    clean = sum(all(r.passed for j, r in results if j == i) for i in range(len(texts)))
    err.print(f"{passed}/{len(results)} gates passed; {clean}/{len(texts)} prompts pass every gate; evidence in {evidence}")
    if passed != len(results):
        raise typer.Exit(1)


def check_text(text: str, what: str) -> None:
    """Text from the command line that is not UTF-8 (the shell passes bytes; Python keeps the bad ones as lone
    surrogates) is refused by name, before the tokenizer fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecdecError(f"{what} is not UTF-8 text (character {e.start + 1} is the byte "
                           f"0x{ord(text[e.start]) & 0xFF:02x})") from None


def check_room(max_seq_len: int, max_new_tokens: int, k: int) -> None:
    """Before loading: generate's context holds a one-token prompt, the new tokens and the positions a decode forward
    writes past them (generate.check_context checks the real prompt once it is encoded)."""
    from specdec.models.config import decode_width

    if max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    kept = decode_width(max(k, 1)) - 1
    if max_seq_len < 1 + max_new_tokens + kept:
        raise SpecdecError(f"--max-seq-len {max_seq_len} is too small for --max-new-tokens {max_new_tokens} at -k {k}: "
                           f"a prompt of one token, {max_new_tokens} new ones and the {kept} positions kept for drafts "
                           f"need {1 + max_new_tokens + kept}")


def check_output_file(path: Path, flag: str, makes_parents: bool = False) -> None:
    """Before the work whose results go to `path`: it is no directory, and its directory exists and is writable (or,
    for a command that `makes_parents`, the nearest one that exists)."""
    if path.is_dir():
        raise SpecdecError(f"{flag} {path}: is a directory")
    above = next(parent for parent in path.absolute().parents if parent.exists())
    if not above.is_dir() or above != path.absolute().parent and not makes_parents:
        raise SpecdecError(f"{flag} {path}: no directory {path.parent}")
    if not os.access(above, os.W_OK):
        raise SpecdecError(f"{flag} {path}: {above} is not writable")


def _print_gate_tables(texts: list[str], results) -> None:
    """Failures in full, then one row per prompt: passed gates per engine, and the verdict."""
    from rich.table import Table

    console = Console()
    failed = [(i, r) for i, r in results if not r.passed]
    if failed:
        table = Table("prompt", "gate", "detail", title="failed gates")
        for i, r in failed:
            shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.detail.items()
                     if isinstance(v, (int, float, str)) and len(str(v)) < 24}
            table.add_row("-" if i is None else str(i + 1), r.name, ", ".join(f"{k}={v}" for k, v in shown.items()))
        console.print(table)
    engines = sorted({r.name.split("/", 1)[1] for i, r in results if i is not None})
    table = Table("#", "prompt", *engines, "verdict", title="gates per prompt")
    for i, text in enumerate(texts):
        mine = [r for j, r in results if j == i]
        cells = []
        for name in engines:
            ran = [r for r in mine if r.name.split("/", 1)[1] == name]
            cells.append(f"{sum(r.passed for r in ran)}/{len(ran)}")
        ok = all(r.passed for r in mine)
        preview = text.strip().splitlines()[0][:40] if text.strip() else ""
        table.add_row(str(i + 1), preview, *cells, "[green]pass[/green]" if ok else "[red]FAIL[/red]")
    sampling = [r for i, r in results if i is None]
    table.add_row("", "sampling rule", *[""] * len(engines),
                  f"{sum(r.passed for r in sampling)}/{len(sampling)}")
    console.print(table)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _gate_engines(engine, path, device, dtype, k_max, context, invariant, hidden_layers=(), fp8=False):
    """The engine configurations the gates of a loaded target run on, and a builder of a batch engine over
    the same weights (rows -> engine; for the end-to-end sampled gate, k_max 2)."""
    import specdec
    from specdec import gates

    loaded = specdec.load(path, engine=engine, device=device, dtype=dtype, k_max=k_max, max_seq_len=context,
                          invariant=invariant, fp8=fp8)
    if engine == "torch":
        from specdec.engines.verifier_torch import TorchEngine

        model = loaded.engine.model
        return (gates.torch_engines(model, k_max=k_max, invariant=invariant, hidden_layers=hidden_layers),
                lambda rows: TorchEngine(model, batch=rows, max_seq_len=context, k_max=2, hidden_layers=hidden_layers))
    from specdec.engines.verifier_jax import JaxEngine

    jax_engine = loaded.engine
    return (gates.jax_engines(jax_engine, k_max=k_max, invariant=invariant, hidden_layers=hidden_layers),
            lambda rows: JaxEngine(jax_engine.cfg, jax_engine.params, batch=rows, max_seq_len=context, k_max=2,
                                   hidden_layers=hidden_layers, prefill_chunk=jax_engine.prefill_chunk))


@app.command()
@user_errors
def bench(
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP),
    engines: str = typer.Option("torch,jax", help="our engines, comma-separated: torch, jax"),
    k: str = typer.Option("2,4,8", "--k", help="draft lengths K of every drafter's runs, comma-separated (plain decoding always runs)"),
    k_max: Optional[int] = typer.Option(None, help="the engines' largest K, which sets their decode width [default: the largest --k]"),
    max_new_tokens: Optional[int] = typer.Option(None, help="tokens per decode [default: 128 on CUDA, 32 on CPU]"),
    prompts: Optional[Path] = typer.Option(None, help="a prompt file: JSONL rows with conversations, messages, text or prompt, or text with one prompt a line [default: the packaged prompt set]"),
    dataset: Optional[str] = typer.Option(None, help="a local Hugging Face dataset: a .jsonl/.json/.csv/.parquet/.txt file, or a directory (save_to_disk)"),
    field: Optional[str] = typer.Option(None, help="the dataset's prompt column [default: 'prompt', else 'text']"),
    num_prompts: Optional[int] = typer.Option(None, help="use the first N prompts"),
    peer: Optional[list[str]] = typer.Option(None, help="a peer to run beside ours (repeatable), plain and with its own speculative methods at each K: transformers (generate, prompt lookup), llama.cpp (the target's GGUF, for the embedded model its Q4_K_M weights; prompt lookup), vllm (n-gram, and EAGLE-3 with each --drafter eagle3=DIR) [default: transformers]"),
    no_peer: bool = typer.Option(False, "--no-peer", help="run no peer at all"),
    drafter: list[str] = typer.Option(["ngram"], help="a drafter to run at each K (repeatable): " + drafter_registry.help_text(plain=False)),
    invariant: bool = typer.Option(True, help="row-invariant forwards: speculative output identical to plain decoding"),
    compile: bool = typer.Option(True, help="torch.compile the torch engine's forward on CUDA; the JAX engine's prefill in a program of its own (during the warm-up, not timed)"),
    fp8: bool = typer.Option(False, help="our engines' linears in FP8, a scale per output row; transformers keeps the checkpoint's weights"),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate", help="run each engine in a process of its own [default: on a GPU, with several engines]"),
    graph_prefill: bool = typer.Option(False, help="torch, compiled on CUDA: prefill as CUDA graphs, ~2.5x shorter on the 270M, but each decode cycle ~12% longer (H200): for short requests"),
    out: Path = typer.Option(Path("specdec-bench.json"), help="JSON results to write"),
    plot: Optional[Path] = typer.Option(None, help="PNG of tok/s against K [default: --out with .png]"),
):
    """Benchmark plain decoding and each drafter's speculative decoding on both engines against peers (transformers'
    generate by default, llama.cpp, vLLM), each plain and speculative, on the same prompts: a table of tok/s,
    ratios, tau and whether each output is the plain decode's; JSON and PNGs. Exit 1 if a speculative output of
    ours differs from plain decoding."""
    import json

    from specdec.bench import decode as benchmark

    settings = benchmark.BenchSettings(
        target=target, engines=tuple(benchmark.parse_list(engines, "--engines")), ks=benchmark.parse_ks(k),
        k_max=k_max, max_new_tokens=max_new_tokens, prompts_file=prompts, dataset=dataset, field=field,
        num_prompts=num_prompts, peers=benchmark.peers_given(peer, no_peer), invariant=invariant, compile=compile, drafters=tuple(drafter), fp8=fp8,
        isolate=isolate, graph_prefill=graph_prefill,
    )
    benchmark.require("matplotlib", "the plot")
    plot = plot or out.with_suffix(".png")
    check_output_file(out, "--out")
    check_output_file(plot, "--plot")
    if not invariant:
        err.print("[yellow]invariant forwards off: speculative output can differ from plain decoding at "
                  "floating-point near-ties[/yellow]")
    record = benchmark.run_bench(settings)
    benchmark.print_table(record, Console())
    out.write_text(json.dumps(record, indent=1))
    benchmark.plot_bench(record, plot)
    acceptance, cost = (plot.with_name(f"{plot.stem}-{name}.png") for name in ("acceptance", "cost"))
    benchmark.plot_acceptance(record, acceptance)
    benchmark.plot_cost(record, cost)
    err.print(f"results in {out}, plots in {plot}, {acceptance} and {cost}", soft_wrap=True)
    if not record["identical"]:
        where = "; ".join(benchmark.differences(record))
        if invariant:
            err.print(f"[bold red]BUG: speculative output differs from the same engine's plain decode although the "
                      f"forwards are row-invariant: {where}[/bold red]", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        err.print(f"[yellow]speculative output differs from plain decoding (invariant forwards off): {where}[/yellow]",
                  highlight=False, soft_wrap=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def roofline(ctx: typer.Context):
    """Plain decoding against the memory roofline at the 270M, E4B and 31B shapes (random weights), both
    engines: step time, fraction of roofline, verify cost against T, tensor parallel; JSON and PNG. Options:
    specdec roofline --help."""
    from specdec.bench import roofline as harness

    harness.main(ctx.args)


@app.command()
@user_errors
def serve(
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP),
    engine: str = typer.Option("torch", help="torch | jax"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, help="port to listen on (0: a free one)"),
    max_num_seqs: int = typer.Option(8, help="requests decoded together (rows of the engine's batch)"),
    max_model_len: int = typer.Option(4096, help="positions the KV cache holds per request: its prompt and generated tokens fit in all but the few kept for drafts (/v1/models says how many fit)"),
    speculative_config: Optional[str] = typer.Option(None, help='JSON as vLLM\'s: {"method": M, "num_speculative_tokens": K} with M one of ' + ", ".join(dict.fromkeys(k.vllm_method for k in drafter_registry.KINDS.values())) + ', "model": DIR for a drafter with files (eagle3, draft_model, mtp), ngram\'s "prompt_lookup_min"/"prompt_lookup_max", "parallel_drafting": true for a P-EAGLE head; absent: plain decoding'),
    served_model_name: Optional[str] = typer.Option(None, help="the model name requests use [default: the checkpoint directory's name]"),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16"),
    compile: bool = typer.Option(True, help="torch.compile the forward (torch on CUDA); JAX: prefill in a program of its own"),
    fp8: bool = typer.Option(False, help="FP8 linears with a scale per output row, read at one byte a weight"),
    graph_prefill: bool = typer.Option(False, help="torch, compiled on CUDA: prefill as CUDA graphs, ~2.5x shorter on the 270M, but each decode cycle ~12% longer (H200): for short requests"),
    cycles_per_call: Optional[int] = typer.Option(None, help="JAX: decode cycles a device call; more spread a call's host cost (~0.7 ms on an H200 host) over them, and a request joins or stops between calls [default: 2 on JAX; torch runs 1]"),
    narrow_cycles: bool = typer.Option(True, help="torch: run each cycle over the rows in use (1, 2, 4, ... rows), at the widths checked at start to give a row the whole batch's bits; --no-narrow-cycles compiles one width and runs every row"),
):
    """Serve the OpenAI API (completions and chat, streamed or whole) from one warm engine, batching
    concurrent requests continuously; /metrics for Prometheus, /health."""
    try:
        from specdec.serve.app import ModelServer, ServeConfig
    except ImportError as e:
        raise SpecdecError(f"specdec serve needs the serve extra (pip install 'specdec[serve]'): {e}") from None
    from specdec.serve.scheduler import SpeculativeConfig, widths_label

    config = ServeConfig(target=target, engine=engine, host=host, port=port, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, speculative=SpeculativeConfig.from_json(speculative_config),
                         served_model_name=served_model_name, dtype=dtype, compile=compile, fp8=fp8,
                         graph_prefill=graph_prefill, cycles_per_call=cycles_per_call, narrow_cycles=narrow_cycles)
    server = ModelServer(config)
    url = server.start()
    cycles = server.scheduler.cycles_per_call
    print(f"serving {server.model_name} at {url}/v1 ({engine}, {max_num_seqs} rows, k={config.speculative.k}"
          + (f", {cycles} cycles a call" if cycles > 1 else "")
          + widths_label(server.scheduler.cycle.widths) + ")", flush=True)
    server.wait()


@app.command("distill")
@user_errors
def distill_cmd(
    out: Path = typer.Option(..., help="output directory: a datasets dataset (save_to_disk) and its manifest.json"),
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP),
    corpus: Optional[str] = typer.Option(None, help="builtin: Python sources and /usr/share/doc text on this machine"),
    prompts: Optional[Path] = typer.Option(None, help="a prompt file: JSONL rows with conversations, messages, text or prompt, or text with one prompt a line"),
    dataset: Optional[str] = typer.Option(None, help="a local Hugging Face dataset: save_to_disk directory, data file or directory, or a name already cached"),
    split: Optional[str] = typer.Option(None, help="the dataset's split (default: train, else the first)"),
    num_prompts: Optional[int] = typer.Option(None, help="prompts to answer at most (default: all)"),
    prompt_tokens: int = typer.Option(128, help="tokens of a text row kept as its prompt"),
    max_new_tokens: int = typer.Option(256, help="response tokens at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    seed: int = typer.Option(0, help="sampling and corpus shuffle seed"),
    batch: Optional[int] = typer.Option(None, help="prompts per engine batch [4 on a CPU; on a GPU the largest power of two up to 256 whose KV cache takes half the memory the weights leave]"),
    engine: str = typer.Option("torch", help="torch | jax"),
    k: int = typer.Option(4, "-k", "--k", help="n-gram draft tokens per cycle (speed only: the responses are the target's)"),
    max_seq_len: int = typer.Option(2048, help="context: prompt + response"),
    dump_features: bool = typer.Option(False, help="also store the target's hidden states for offline training"),
    aux_layers: Optional[str] = typer.Option(None, help="EAGLE-3 aux layer ids a,b,c, vLLM's convention (default: 2, L/2, L-3)"),
    feature_dtype: str = typer.Option("float16", help="float16 (values past its range saturate) | float32"),
    corpus_mb: float = typer.Option(16.0, help="MB of text the built-in corpus reads"),
    overwrite: bool = typer.Option(False, help="replace --out if it exists"),
):
    """Self-distilled EAGLE-3 training data: the target answers each prompt (lossless n-gram speculative
    decoding), written as a datasets dataset with a manifest (sources, target hash, settings, skips)."""
    from specdec.data import distill as data
    from specdec.data.corpus import manifest_path
    from specdec.data.sources import dataset_rows, prompt_file_rows

    given = [flag for flag, value in (("--corpus", corpus), ("--prompts", prompts), ("--dataset", dataset)) if value]
    if len(given) != 1:
        raise SpecdecError("give one prompt source: --corpus builtin, --prompts FILE.jsonl or --dataset DIR"
                           + (f" (got {' and '.join(given)})" if given else ""))
    try:
        aux = tuple(int(a) for a in aux_layers.split(",")) if aux_layers else None
    except ValueError:
        raise SpecdecError(f"--aux-layers {aux_layers!r}: comma-separated layer ids, e.g. 2,9,15") from None
    settings = data.DistillSettings(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature,
                                    seed=seed, batch=batch, engine=engine, k=k, max_seq_len=max_seq_len,
                                    dump_features=dump_features, aux_layer_ids=aux, feature_dtype=feature_dtype)
    settings.check()  # before the corpus is read
    data.check_out_dir(out, overwrite)
    if corpus is not None:
        if corpus != "builtin":
            raise SpecdecError(f"--corpus {corpus!r}: the only corpus is 'builtin' (else --prompts or --dataset)")
        from specdec.data.corpus import build_corpus

        built = build_corpus(max_bytes=int(corpus_mb * 2**20), seed=seed)
        rows, source = ((row["source"], row) for row in built.rows), built.describe()
    elif prompts is not None:
        rows, source = prompt_file_rows(prompts), {"kind": "jsonl", "path": str(prompts.resolve())}
        if manifest_path(prompts).is_file():  # a corpus `specdec corpus` wrote: keep what it was built from
            source["corpus"] = json.loads(manifest_path(prompts).read_text())
    else:
        rows, source = dataset_rows(dataset, split), {"kind": "dataset", "name": dataset, "split": split}
    manifest = data.distill(target, rows, out, settings, source, num_prompts, overwrite)
    c = manifest["counts"]
    err.print(f"wrote {c['rows']} rows ({c['tokens']:,} tokens, {c['response_tokens']:,} by the target) to {out}; "
              f"{c['skipped']} rows skipped (manifest.json says why)", highlight=False, soft_wrap=True)


@app.command("corpus")
@user_errors
def corpus_cmd(
    out: Path = typer.Option(..., help="JSONL to write, one {text, source} row a line (for distill --prompts); its description goes beside it as NAME.manifest.json"),
    source: list[str] = typer.Option([], "--source", help="a directory of text to add: DIR (code and prose), DIR:code or DIR:prose; repeatable"),
    builtin: bool = typer.Option(True, help="include this machine's Python sources and /usr/share/doc"),
    mb: float = typer.Option(16.0, help="MB of text to read, shared equally between the sources"),
    seed: int = typer.Option(0, help="file and row shuffle seed"),
    heldout: int = typer.Option(0, help="files to set aside, spread over the sources: one prompt each in NAME.heldout.jsonl (for bench --prompts), none of their text in the rows"),
    overwrite: bool = typer.Option(False, help="replace --out if it exists"),
):
    """Build a prompt corpus from text on this machine (built-in sources and directories you add, e.g. unpacked
    Debian or npm packages) with the benchmark prompts left out, to distill from here or on another machine."""
    from rich.table import Table

    from specdec.data.corpus import build_corpus, default_sources, heldout_path, parse_source, write_corpus

    if not mb > 0:  # NaN too
        raise SpecdecError(f"--mb must be > 0, got {mb}")
    if out.exists() and not overwrite:
        raise SpecdecError(f"{out}: already exists (pass --overwrite to replace it)")
    check_output_file(out, "--out", makes_parents=True)
    sources = (default_sources() if builtin else []) + [parse_source(s) for s in source]
    if not sources:
        raise SpecdecError("no sources: pass --source DIR, or leave --builtin on")
    built = build_corpus(sources, max_bytes=int(mb * 2**20), seed=seed, heldout=heldout)
    write_corpus(built, out)
    table = Table("source", "kind", "files", "MB", "rows")
    for s in built.sources:
        table.add_row(s["name"], s["kind"], f"{s['files']:,}", f"{s['chars'] / 2**20:.1f}", f"{s['chunks']:,}")
    err.print(table)
    left_out = ", ".join(f"{n:,} {why.replace('_', ' ')}" for why, n in built.excluded.items() if n)
    err.print(f"wrote {len(built.rows):,} rows to {out}" + (f" (left out: {left_out})" if left_out else ""),
              highlight=False, soft_wrap=True)
    if built.heldout:
        err.print(f"held out {len(built.heldout):,} files: one prompt each in {heldout_path(out)}", highlight=False, soft_wrap=True)


train_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train draft heads.")
app.add_typer(train_app, name="train")


@train_app.command("peagle", help="Train a P-EAGLE head (all drafts in one forward: the EAGLE-3 head trained with "
                   "mask rows in place of its own outputs) on distilled data, as `train eagle3` does; OUT/head drafts "
                   "as --drafter peagle=OUT/head, and vLLM runs it as eagle3 with parallel_drafting.")
@train_app.command("eagle3")
@user_errors
def train_eagle3_cmd(
    ctx: typer.Context,
    data: Optional[Path] = typer.Option(None, help="distilled data (specdec distill): a datasets directory with its manifest.json"),
    out: Optional[Path] = typer.Option(None, help="output directory: checkpoints/, head/ (the exported head), train_log.jsonl"),
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP + " (the one the data was distilled from)"),
    config: Optional[Path] = typer.Option(None, help="YAML of training settings (specdec.training.config.TrainConfig fields); flags override it"),
    steps: Optional[int] = typer.Option(None, help="optimizer steps [2000]"),
    batch_size: Optional[int] = typer.Option(None, help="sequences per step, over all devices [8]"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per sequence (truncated / padded) [2048]"),
    lr: Optional[float] = typer.Option(None, help="peak learning rate (warmup, then cosine decay) [1e-4]"),
    warmup: Optional[int] = typer.Option(None, help="warmup steps [100]"),
    ttt_steps: Optional[int] = typer.Option(None, help="training-time-test steps unrolled [7]"),
    draft_vocab: Optional[int] = typer.Option(None, help="draft vocabulary size (the most frequent response tokens) [32000]"),
    aux_layers: Optional[str] = typer.Option(None, help="aux layer ids a,b,c, vLLM's convention [the data's, else 2, L/2, L-3]"),
    offline: Optional[bool] = typer.Option(None, "--offline/--online", help="read the target's states from the data (distilled with --dump-features) [online]"),
    compute_dtype: Optional[str] = typer.Option(None, help="the head's matmuls (its weights stay float32): float32 | bfloat16 [bfloat16 on accelerators, float32 on CPU]"),
    seed: Optional[int] = typer.Option(None, help="head initialisation, held-out rows and data order [0]"),
    eval_rows: Optional[int] = typer.Option(None, help="rows held out from training to evaluate the head on (OUT/eval_log.jsonl) [0]"),
    eval_every: Optional[int] = typer.Option(None, help="steps between evaluations of the held-out rows [--save-every]"),
    save_every: Optional[int] = typer.Option(None, help="steps between checkpoints [500]"),
    keep: Optional[int] = typer.Option(None, help="checkpoints kept [3]"),
    log_every: Optional[int] = typer.Option(None, help="steps between metric reports [10]"),
    resume: bool = typer.Option(False, help="insist on continuing a checkpoint in --out (one of the same config is continued anyway)"),
    wandb_project: Optional[str] = typer.Option(None, help="log to this Weights & Biases project [off]"),
    wandb_mode: Optional[str] = typer.Option(None, help="online | offline | disabled"),
    devices: Optional[int] = typer.Option(None, help="local devices to train on, data parallel [all]"),
    coordinator_address: Optional[str] = typer.Option(None, help="multi-host: jax.distributed coordinator HOST:PORT"),
    num_processes: Optional[int] = typer.Option(None, help="multi-host: number of processes"),
    process_id: Optional[int] = typer.Option(None, help="multi-host: this process's id"),
    stop_after: Optional[int] = typer.Option(None, hidden=True, help="stop after this many steps, as if killed (tests)"),
):
    """Train an EAGLE-3 head on distilled data (JAX, data parallel over every device); resumable. Writes
    checkpoints and OUT/head, the head in the speculators format vLLM loads (generate --drafter eagle3=OUT/head)."""
    from specdec.training.config import TrainConfig
    from specdec.training.trainer import train_eagle3

    cfg = TrainConfig.load(
        config, data=data, out=out, target=target, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
        warmup=warmup, ttt_steps=ttt_steps, parallel_drafting=ctx.info_name == "peagle", draft_vocab_size=draft_vocab, aux_layer_ids=aux_layers, offline=offline,
        compute_dtype=compute_dtype, seed=seed, eval_rows=eval_rows, eval_every=eval_every, save_every=save_every, keep=keep, log_every=log_every,
        wandb_project=wandb_project, wandb_mode=wandb_mode, devices=devices, coordinator_address=coordinator_address,
        num_processes=num_processes, process_id=process_id,
    )
    result = train_eagle3(cfg, resume=resume, stop_after=stop_after, console=err)
    m = result.metrics
    stats = f" · loss {m['loss']:.4f} · acc0 {m['acc_0']:.3f}" if m else ""
    if result.eval_metrics:
        stats += f" · held-out acc0 {result.eval_metrics['eval_acc_0']:.3f}"
    where = f"head in {result.head}" if result.head else f"checkpoint {result.checkpoint}"
    err.print(f"step {result.step}/{cfg.steps}{stats} · {where}", highlight=False, soft_wrap=True)


@train_app.command("eagle3-eval")
@user_errors
def eagle3_eval_cmd(
    head: Path = typer.Option(..., help="an EAGLE-3 head directory (the speculators format, or the older EAGLE layout)"),
    data: Path = typer.Option(..., help="distilled data (specdec distill) to evaluate on: every row"),
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP + " (the one the data was distilled from)"),
    batch_size: int = typer.Option(32, help="sequences per forward"),
    seq_len: int = typer.Option(384, help="tokens per sequence (truncated / padded)"),
    ttt_steps: int = typer.Option(7, help="draft steps evaluated (TTT steps)"),
    out: Optional[Path] = typer.Option(None, help="also write the metrics as JSON, with device, date and commit"),
):
    """Teacher-forced accuracy of an EAGLE-3 head at each draft step over distilled data, as training's held-out
    evaluation computes it; e.g. on the target's answers to the prompts the head is benchmarked on."""
    from rich.table import Table

    from specdec.evidence import git_commit, now_utc
    from specdec.training.trainer import evaluate_head

    if out is not None:
        check_output_file(out, "--out")
    metrics = evaluate_head(head, data, target, batch_size, seq_len, ttt_steps)
    # Accuracy counts the tokens in the draft vocabulary; over all tokens the rest are misses, as in drafting.
    table = Table("draft step", "accuracy", "over all tokens", "loss", "in draft vocab", "tokens")
    for j in range(ttt_steps):
        acc, coverage = metrics[f"eval_acc_{j}"], metrics[f"eval_coverage_{j}"]
        table.add_row(str(j), f"{acc:.3f}", f"{acc * coverage:.3f}", f"{metrics[f'eval_loss_{j}']:.3f}",
                      f"{coverage:.3f}", f"{metrics[f'eval_count_{j}']:,}")
    err.print(table)
    if out is not None:
        import jax

        record = {"head": str(head.resolve()), "data": str(data.resolve()), "device": jax.devices()[0].device_kind,
                  "date": now_utc(), "commit": git_commit(), "batch_size": batch_size, "seq_len": seq_len,
                  "metrics": metrics}
        out.write_text(json.dumps(record, indent=1) + "\n")
        err.print(f"wrote {out}", highlight=False, soft_wrap=True)


@app.command("export")
@user_errors
def export_cmd(
    checkpoint: Path = typer.Argument(..., help="a training checkpoint (OUT/checkpoints/step_N) or a training --out (its newest)"),
    out: Path = typer.Argument(..., help="the head directory to write (config.json + model.safetensors)"),
    overwrite: bool = typer.Option(False, help="write into a directory holding other files: replace only the head's files there"),
):
    """Export a training checkpoint as an EAGLE-3 head in the speculators format, which vLLM reads."""
    from specdec.training.checkpoint import export_head

    err.print(f"wrote {export_head(checkpoint, out, overwrite)}", highlight=False, soft_wrap=True)


@app.command("import-gguf")
@user_errors
def import_gguf_cmd(
    gguf: Path,
    out: Path,
    overwrite: bool = typer.Option(False, help="write into a directory holding other files: replace only the checkpoint's files there"),
):
    """Import a GGUF (Gemma 3) as a HF checkpoint directory: dequantised weights, config, tokenizer."""
    from specdec.models.gguf_import import import_gguf

    err.print(f"wrote {import_gguf(gguf, out, overwrite=overwrite)}", highlight=False, soft_wrap=True)


@app.command()
@user_errors
def inspect(target: Optional[Path] = typer.Option(None, help=TARGET_HELP)):
    """Print a checkpoint's resolved configuration, layer by layer."""
    from rich.table import Table

    from specdec.models.config import GemmaConfig
    from specdec.models.gguf_import import resolve_checkpoint

    path = resolve_checkpoint(target)
    cfg = GemmaConfig.from_file(path / "config.json")
    console = Console()
    console.print(
        f"{path}\n{cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"window {cfg.sliding_window}, heads {cfg.num_heads}"
    )
    table = Table("layer", "kind", "head_dim", "kv heads", "k_eq_v", "kv from", "mlp")
    for s in cfg.layers:
        table.add_row(str(s.index), s.kind, str(s.head_dim), str(s.num_kv_heads), str(s.k_eq_v), str(s.kv_source), str(s.intermediate_size))
    console.print(table)


def main() -> None:
    quiet_libraries()
    try:
        app()
    except SystemExit as done:
        if skip_teardown and not done.code:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        raise
