"""`specdec`: generate, validate, import-gguf, inspect."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from specdec.errors import SpecdecError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Lossless speculative decoding for Gemma models.")
err = Console(stderr=True)

TARGET_HELP = "checkpoint directory (HF layout); default: the embedded Gemma 3 270M"


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
    drafter: str = typer.Option("ngram", help="ngram | none"),
    engine: str = typer.Option("torch", help="torch | jax"),
    k: int = typer.Option(4, "-k", "--k", help="draft tokens per cycle"),
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
    fused: Optional[bool] = typer.Option(None, help="n-gram draft+verify+accept in one CUDA graph (default: on CUDA, greedy)"),
    compare_plain: bool = typer.Option(False, help="also time a plain decode first and report the speedup"),
):
    """Generate text, streaming it, then print tau, acceptance and tok/s."""
    import specdec
    from specdec.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    if k < 0:
        raise SpecdecError(f"-k must be >= 0, got {k}")
    loaded = specdec.load(target, engine=engine, device=device, dtype=dtype, k_max=max(k, 1), max_seq_len=max_seq_len)
    out = sys.stdout
    out.write(prompt)
    out.flush()

    def on_text(_row: int, text: str) -> None:
        out.write(text)
        out.flush()

    _, result = specdec.generate(
        prompt, loaded, drafter=drafter, k=k, max_new_tokens=max_new_tokens, sampling=sampling,
        stop_strings=stop, chat=chat, on_text=on_text, fused=fused, compare_plain=compare_plain,
    )
    out.write("\n")
    s = result.stats
    per_pos = " ".join(f"{a:.2f}" for a in s.per_position_acceptance)
    err.print(
        f"[dim]{engine} · drafter {drafter if k else 'none'} · k={s.k} · {s.kept} tokens in {s.wall_s:.2f}s · "
        f"{s.tok_s:.1f} tok/s · tau {s.tau:.2f} · acceptance {s.acceptance_rate:.2f}"
        + (f" [{per_pos}]" if per_pos else "")
        + (f" · {s.speedup:.2f}x plain decode ({s.baseline_tok_s:.1f} tok/s)" if s.speedup else "") + "[/dim]",
        highlight=False,
    )


@app.command()
@user_errors
def validate(
    target: Optional[Path] = typer.Option(None, help=TARGET_HELP),
    engine: str = typer.Option("torch", help="torch | jax | all"),
    prompt: str = typer.Option("def fibonacci(n):", help="completion prompt the model gates decode from"),
    tokens: int = typer.Option(640, help="tokens per decode (past the sliding-window ring wrap)"),
    k_max: int = typer.Option(8, help="greedy and self-draft gates run K = 1 .. k_max"),
    draws: int = typer.Option(100_000, help="draws per case of the sampling gate"),
    self_draft: bool = typer.Option(True, help="run the self-draft gate (the target as its own drafter)"),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (torch engine)"),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16"),
    evidence: Path = typer.Option(Path("specdec-validate.json"), help="JSON evidence file to write"),
):
    """Run the lossless gates; print a pass/fail table and write a JSON evidence file. Exit 1 on a failure."""
    import json

    from rich.table import Table

    from specdec import gates
    from specdec.evidence import git_commit, now_utc

    engines = ["torch", "jax"] if engine == "all" else [engine]
    context = tokens + len(prompt) + 64  # the prompt's tokens are fewer than its characters
    eut = []
    tokenizer = None
    for name in engines:
        loaded = _load_for_gates(name, target, device, dtype, k_max, context)
        tokenizer = loaded.tokenizer
        eut += loaded.engines
    prompt_ids = tokenizer.encode(prompt)
    results = gates.run_gates(eut, prompt_ids, tokens, k_max, draws, self_draft, progress=lambda m: err.print(f"[dim]{m}[/dim]"))

    table = Table("gate", "result", "detail")
    for r in results:
        # Scalars only: the full detail (per-position statistics, hashes) is in the evidence file.
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.detail.items()
                 if isinstance(v, (int, float, str)) and len(str(v)) < 24}
        table.add_row(r.name, "[green]pass[/green]" if r.passed else "[red]FAIL[/red]", ", ".join(f"{k}={v}" for k, v in shown.items()))
    Console().print(table)
    record = {
        "date": now_utc(), "commit": git_commit(),
        "target": str(target or "embedded gemma-3-270m"), "prompt": prompt, "tokens": tokens,
        "passed": all(r.passed for r in results),
        "gates": [{"name": r.name, "passed": r.passed, "detail": r.detail} for r in results],
    }
    evidence.write_text(json.dumps(record, indent=1, default=str))
    passed = sum(r.passed for r in results)
    err.print(f"{passed}/{len(results)} gates passed; evidence in {evidence}")
    if passed != len(results):
        raise typer.Exit(1)


def _load_for_gates(engine, target, device, dtype, k_max, context):
    """A loaded target plus the engine configurations its gates run on."""
    from types import SimpleNamespace

    import specdec
    from specdec import gates

    loaded = specdec.load(target, engine=engine, device=device, dtype=dtype, k_max=k_max, max_seq_len=context)
    if engine == "torch":
        return SimpleNamespace(tokenizer=loaded.tokenizer, engines=gates.torch_engines(loaded.engine.model))
    return SimpleNamespace(tokenizer=loaded.tokenizer, engines=gates.jax_engines(loaded.engine))


@app.command("import-gguf")
@user_errors
def import_gguf_cmd(gguf: Path, out: Path):
    """Import a GGUF (Gemma 3) as a HF checkpoint directory: dequantised weights, config, tokenizer."""
    from specdec.models.gguf_import import import_gguf

    err.print(f"wrote {import_gguf(gguf, out)}")


@app.command()
@user_errors
def inspect(target: Optional[Path] = typer.Option(None, help=TARGET_HELP)):
    """Print a checkpoint's resolved configuration, layer by layer."""
    from rich.table import Table

    from specdec.api import resolve_checkpoint
    from specdec.models.config import GemmaConfig

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
    app()
