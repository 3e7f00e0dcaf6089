"""Self-distillation: the target writes again the responses an EAGLE-3 head learns from.

A draft head is judged by how often the *target* agrees with it, so it should learn the target's own
outputs, not a dataset's human or other-model answers. Each prompt is continued by the target on our
engines, B prompts a batch, by speculative n-gram decoding: lossless, so greedy responses are exactly the
target's plain greedy decode, only sooner; sampled ones follow its distribution (seeded per batch).

The output directory is a `datasets` dataset (`datasets.load_from_disk(out)`), written whole to a
neighbouring directory first and then renamed into place, with `manifest.json` beside its files:
  input_ids    list<int32>                   prompt + response token ids
  loss_mask    list<int8>                    0 over the prompt, 1 over the response; same length
  source       string                        where the prompt came from ("chats.jsonl:12",
                                             "corpus:stdlib:json/decoder.py#0")
and with `dump_features` (offline training, no target needed then):
  hidden       Array3D((None, A, H), float16)  per position, the target's states after the engine layers
                                             `engine_taps(aux_layer_ids)`: the inputs of the A aux layers
                                             (vLLM's convention; default 2, L/2, L-3), in that order
  last_hidden  Array2D((None, H), float16)    per position, the state after the final layer, before the norm
(`with_format("numpy")` reads them back as int64/float32; `with_format("arrow")` keeps the stored types.)
Both come from one forward over the whole row from an empty cache. Gemma's residual stream outgrows
float16 at a few places (Gemma 3 270M: one channel of the BOS position, up to ~1e5, from layer 7 on):
those values are saturated at +-65504 and counted in the manifest (`saturated_features`), or
`feature_dtype="float32"` stores them exactly at twice the size. The manifest records the prompt
sources, the target (path, `checkpoint_fingerprint`), the settings, counts, and every skipped row with why.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from specdec.api import ENGINES, Target, load, make_cycle, resolve_checkpoint
from specdec.data.sources import Prompt, Row, collect_prompts
from specdec.errors import SpecdecError
from specdec.evidence import now_utc
from specdec.generate import StopCondition, run_cycles
from specdec.models.config import GemmaConfig, decode_width, round_up
from specdec.models.memory import accelerator_free_bytes
from specdec.sampling import SamplingParams

FEATURE_BUCKET = 64  # feature forwards are padded to a multiple of this: few shapes for XLA to compile
CPU_BATCH = 4  # the default batch on a CPU, where a forward's cost grows with its rows
MAX_AUTO_BATCH = 256  # the largest default batch on an accelerator (the largest measured: 32k tok/s, 270M, H200)


@dataclass(frozen=True)
class DistillSettings:
    prompt_tokens: int = 128  # of a `text` row (specdec.data.sources)
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    batch: int | None = None  # None: default_batch for the engine's device
    engine: str = "torch"
    k: int = 4  # n-gram draft tokens per cycle: speed only
    max_seq_len: int = 2048
    dump_features: bool = False
    aux_layer_ids: tuple[int, ...] | None = None  # None: default_aux_layer_ids of the target
    feature_dtype: str = "float16"  # or "float32"

    def check(self) -> None:
        for name in ("prompt_tokens", "max_new_tokens", "batch", "max_seq_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SpecdecError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.k < 0:
            raise SpecdecError(f"k must be >= 0, got {self.k}")
        if self.engine not in ENGINES:
            raise SpecdecError(f"unknown engine {self.engine!r} (choose from {', '.join(ENGINES)})")
        if self.feature_dtype not in ("float16", "float32"):
            raise SpecdecError(f"feature dtype must be float16 or float32, got {self.feature_dtype!r}")
        if self.max_prompt_len(decode_width(self.k)) < 1:
            raise SpecdecError(f"max-new-tokens {self.max_new_tokens} leaves no room for a prompt in a context of "
                               f"{self.max_seq_len} (max-seq-len) beside the {decode_width(self.k) - 1} positions kept "
                               f"for drafts of k={self.k}")

    def max_prompt_len(self, width: int) -> int:
        """The longest prompt that fits the context with the response, for decode forwards `width` rows wide
        (specdec.generate.check_context)."""
        return self.max_seq_len - self.max_new_tokens - width + 1


def default_batch(cfg: GemmaConfig, settings: DistillSettings, free_bytes: int | None) -> int:
    """The batch when none is given: CPU_BATCH on a CPU (`free_bytes` None); on an accelerator with
    `free_bytes` free, the largest power of two up to MAX_AUTO_BATCH whose bf16 KV cache takes at most half
    of what the target's bf16 weights leave."""
    if free_bytes is None:
        return CPU_BATCH
    from specdec.models.checkpoint import expected_shapes

    weights = 2 * sum(math.prod(shape) for shape in expected_shapes(cfg).values())
    per_row = 2 * sum(math.prod(entry[0]) * (2 if entry[1] else 1)
                      for entry in cfg.kv_cache_shapes(1, settings.max_seq_len, settings.k) if entry)
    room = (free_bytes - weights) // 2
    batch = 1
    while batch * 2 <= MAX_AUTO_BATCH and batch * 2 * per_row <= room:
        batch *= 2
    return batch


def check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise SpecdecError(f"{out}: already exists (pass --overwrite to replace it)")


def distill(target: Target | str | Path | None, rows: Iterable[Row], out: str | Path,
            settings: DistillSettings = DistillSettings(), source: dict | None = None, num_prompts: int | None = None,
            overwrite: bool = False, console=None) -> dict:
    """Read prompts from `rows` (up to `num_prompts`), have the target answer them, write the dataset and its
    manifest to `out`; -> the manifest. `source` describes the rows for the manifest. `target` is a checkpoint
    directory (None: the embedded default), loaded as `settings` say, or a loaded Target, whose engine then
    fixes the engine, batch and context of the settings."""
    from specdec.models.checkpoint import checkpoint_fingerprint
    from specdec.models.tokenizer import Tokenizer

    loaded = target if isinstance(target, Target) else None
    if loaded is not None:
        settings = dataclasses.replace(settings, engine=loaded.engine_name, batch=loaded.engine.batch,
                                       max_seq_len=loaded.engine.max_seq_len)
        if settings.k > loaded.engine.k_max:
            raise SpecdecError(f"k={settings.k} is above the loaded engine's k_max ({loaded.engine.k_max})")
    settings.check()
    if num_prompts is not None and num_prompts < 1:
        raise SpecdecError(f"num-prompts must be >= 1, got {num_prompts}")
    out = Path(out)
    check_out_dir(out, overwrite)
    # Everything about the input is checked, and the prompts read, before the weights load.
    path = loaded.path if loaded else resolve_checkpoint(target)
    config = loaded.config if loaded else GemmaConfig.from_file(path / "config.json")
    aux_layer_ids, hidden_layers = feature_layers(config.num_layers, settings.aux_layer_ids)
    tokenizer = loaded.tokenizer if loaded else Tokenizer.from_dir(path)
    width = loaded.engine.width if loaded else decode_width(settings.k)
    prompts, skipped = collect_prompts(rows, tokenizer, settings.prompt_tokens, num_prompts,
                                       settings.max_prompt_len(width))
    if not prompts:
        first = f" (first: {skipped[0].source}: {skipped[0].reason})" if skipped else ""
        raise SpecdecError(f"no usable prompts: {len(skipped)} rows skipped{first}")
    # The engine prefills a batch one forward per run of rows of equal prompt length (it never pads a row), and
    # prompts cut back to a line boundary rarely match their neighbours: in length order a batch of 256 takes a
    # few prefill forwards instead of about one a row, which was 2/3 of distillation's time on an H200.
    prompts.sort(key=lambda p: len(p.ids))
    if settings.batch is None:
        settings = dataclasses.replace(settings, batch=default_batch(config, settings, accelerator_free_bytes(settings.engine)))
    target = loaded or load(path, engine=settings.engine, batch=settings.batch, k_max=settings.k,
                            max_seq_len=settings.max_seq_len)
    capture = FeatureCapture(target, hidden_layers, settings.max_seq_len) if settings.dump_features else None

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        counts, generation = _generate(target, prompts, settings, capture, staging / "rows.arrow", console)
        manifest = {
            "format": "specdec-distill/1",
            "created": now_utc(),
            "target": {"path": str(path), "fingerprint": checkpoint_fingerprint(path),
                       "model_type": target.config.model_type, "num_layers": target.config.num_layers,
                       "hidden_size": target.config.hidden_size, "vocab_size": target.config.vocab_size},
            "source": source or {},
            "settings": {**dataclasses.asdict(settings), "drafter": "ngram", "eos_ids": list(tokenizer.eos_ids),
                         "aux_layer_ids": list(aux_layer_ids) if capture else None,
                         "hidden_layers": list(hidden_layers) if capture else None},
            "counts": {**counts, "skipped": len(skipped)},
            "generation": generation,
            "skipped": [dataclasses.asdict(s) for s in skipped],
        }
        _save(staging, out, manifest, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def feature_layers(num_layers: int, aux_layer_ids: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The aux layers (vLLM's convention) and the engine's hidden_layers to tap: theirs, then the last layer."""
    from specdec.drafters.eagle3 import default_aux_layer_ids, engine_taps

    aux = tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(num_layers)
    if not all(1 <= a < num_layers for a in aux):
        raise SpecdecError(f"aux layers {','.join(map(str, aux))} must lie in 1..{num_layers - 1} "
                           f"(the target has {num_layers} layers)")
    return aux, engine_taps(aux) + (num_layers - 1,)


def _generate(target, prompts: list[Prompt], settings: DistillSettings, capture, arrow_path: Path, console):
    """Answer the prompts a full batch at a time (the last padded with copies of its first prompt, whose
    results are dropped) and write each row; -> (counts, generation stats)."""
    from datasets.arrow_writer import ArrowWriter
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from specdec.progress import LoggedProgress

    B = settings.batch
    sampling = SamplingParams(temperature=settings.temperature, seed=settings.seed)
    stop = StopCondition(settings.max_new_tokens, target.tokenizer.eos_ids)
    cycle = make_cycle(target, "ngram", settings.k, sampling)
    counts = {"rows": 0, "prompt_tokens": 0, "response_tokens": 0, "tokens": 0, "ended_on_eos": 0,
              "saturated_features": 0}
    emitted = cycles = 0
    start = time.perf_counter()
    progress = LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              TimeRemainingColumn(), console=console or Console(stderr=True))
    # Rows with features are large (T x 4 x H halves): write them out a batch at a time.
    writer = ArrowWriter(features=dataset_features(capture, settings.feature_dtype), path=str(arrow_path),
                         writer_batch_size=B if capture else None)
    with progress, writer:
        task = progress.add_task("distilling", total=len(prompts))
        for index, first in enumerate(range(0, len(prompts), B)):
            group = prompts[first:first + B]
            ids = [p.ids for p in group] + [group[0].ids] * (B - len(group))
            if not sampling.greedy:  # each batch its own draws, reproducible from the seed
                batch_seed = int(np.random.SeedSequence([settings.seed, index]).generate_state(1)[0])
                cycle = make_cycle(target, "ngram", settings.k, dataclasses.replace(sampling, seed=batch_seed))
            result = run_cycles(cycle, ids, cycle.k, stop)
            emitted, cycles = emitted + result.stats.emitted, cycles + result.stats.cycles
            sequences = [p + r for p, r in zip(ids, result.tokens)]
            features = capture(sequences) if capture else None
            for b, prompt in enumerate(group):
                response = result.tokens[b]
                row = {"input_ids": np.asarray(sequences[b], np.int32),
                       "loss_mask": np.asarray([0] * len(prompt.ids) + [1] * len(response), np.int8),
                       "source": prompt.source}
                if features is not None:
                    stored, saturated = store_features(features[b, : len(sequences[b])], settings.feature_dtype)
                    row["hidden"], row["last_hidden"] = stored[:, :-1], stored[:, -1]
                    counts["saturated_features"] += saturated
                writer.write(row)
                counts["rows"] += 1
                counts["prompt_tokens"] += len(prompt.ids)
                counts["response_tokens"] += len(response)
                counts["ended_on_eos"] += bool(response) and response[-1] in stop.eos_ids
            progress.advance(task, len(group))
        writer.finalize()
    counts["tokens"] = counts["prompt_tokens"] + counts["response_tokens"]
    seconds = time.perf_counter() - start
    return counts, {"seconds": round(seconds, 3), "tau": emitted / cycles if cycles else 0.0,
                    "response_tok_s": counts["response_tokens"] / seconds if seconds else 0.0}


def dataset_features(capture: "FeatureCapture | None", feature_dtype: str = "float16"):
    import datasets

    features = {"input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8")),
                "source": datasets.Value("string")}
    if capture is not None:
        taps, hidden = len(capture.hidden_layers) - 1, capture.hidden_size
        features["hidden"] = datasets.Array3D((None, taps, hidden), feature_dtype)
        features["last_hidden"] = datasets.Array2D((None, hidden), feature_dtype)
    return datasets.Features(features)


def store_features(x: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    """float32 states as stored, and how many values float16 had to saturate (module docstring)."""
    if dtype == "float32":
        return x, 0
    limit = float(np.finfo(np.float16).max)
    return np.clip(x, -limit, limit).astype(np.float16), int(np.count_nonzero(np.abs(x) > limit))


def _save(staging: Path, out: Path, manifest: dict, overwrite: bool) -> None:
    """The written rows as a save_to_disk directory with the manifest, renamed into place at `out`."""
    import datasets

    datasets.disable_progress_bars()
    built = staging / "dataset"
    datasets.Dataset.from_file(str(staging / "rows.arrow")).save_to_disk(str(built))
    (built / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if out.exists() and overwrite:
        out.rename(staging / "replaced")
    check_out_dir(out, overwrite=False)  # nothing appeared there meanwhile
    built.rename(out)


class FeatureCapture:
    """The target's hidden states after `hidden_layers` over whole sequences: one forward per batch from an
    empty cache, the rows padded at the end (causal attention: pads change no earlier position)."""

    def __init__(self, target, hidden_layers: tuple[int, ...], max_seq_len: int):
        self.target, self.hidden_layers, self.max_seq_len = target, hidden_layers, max_seq_len
        self.hidden_size = target.config.hidden_size
        engine = target.engine
        if target.engine_name == "torch":
            self.cache = engine.model.allocate_cache(engine.batch, engine.k_max, max_seq_len)
        else:
            import jax

            from specdec.models import gemma_jax

            def hidden(params, tokens, positions, cache):
                return gemma_jax.forward(params, target.config, tokens, positions, cache, hidden_layers=hidden_layers,
                                         last_only=True)[1]

            self.forward = jax.jit(hidden)  # compiled once per batch shape (FEATURE_BUCKET)

    def __call__(self, sequences: list[list[int]]) -> np.ndarray:
        """float32 [B, T, len(hidden_layers), H], T the longest sequence padded up to a bucket."""
        cfg = self.target.config
        longest = max(len(s) for s in sequences)
        width = min(round_up(longest, FEATURE_BUCKET), self.max_seq_len)
        tokens = np.full((len(sequences), width), cfg.pad_token_id, np.int64)
        for b, s in enumerate(sequences):
            tokens[b, : len(s)] = s
        positions = np.broadcast_to(np.arange(width), tokens.shape)
        engine = self.target.engine
        if self.target.engine_name == "torch":
            import torch

            self.cache.reset()
            as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=engine.device)  # noqa: E731
            with torch.inference_mode():
                _, hidden = engine.model(as_t(tokens), as_t(positions), self.cache, hidden_layers=self.hidden_layers,
                                         last_only=True)
            return hidden.float().cpu().numpy()
        import jax.numpy as jnp

        from specdec.models import gemma_jax

        cache = gemma_jax.init_cache(cfg, len(sequences), self.max_seq_len, engine.k_max,
                                     engine.params["embed_tokens.weight"].dtype)
        hidden = self.forward(engine.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache)
        return np.asarray(hidden, np.float32)
