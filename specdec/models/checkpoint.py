"""Checkpoints: Hugging Face directories of safetensors (one file, or shards with an index).

Tensors are kept under their HF names with the leading `model.` (or `model.language_model.` of multimodal
Gemma 4 checkpoints) stripped: `embed_tokens.weight`, `layers.3.self_attn.q_proj.weight`, `norm.weight`,
`lm_head.weight`. `expected_shapes` is the one spec of what a config's weights look like; loading checks
every name and shape against it, and errors name the tensor and the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from safetensors import SafetensorError, safe_open

from specdec.errors import SpecdecError
from specdec.models.config import GemmaConfig, tp_split_axis

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MULTIMODAL_PREFIX = "model.language_model."
# Weights a KV-shared layer may carry in released checkpoints but never uses.
_SHARED_LAYER_UNUSED = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")


def expected_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the text model needs, with its shape, under the stripped HF names."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.has_per_layer_inputs:
        ple = cfg.num_layers * cfg.hidden_size_per_layer_input
        shapes["embed_tokens_per_layer.weight"] = (cfg.vocab_size_per_layer_input, ple)
        shapes["per_layer_model_projection.weight"] = (ple, h)
        shapes["per_layer_projection_norm.weight"] = (cfg.hidden_size_per_layer_input,)
    for spec in cfg.layers:
        p = f"layers.{spec.index}."
        hd, nkv = spec.head_dim, spec.num_kv_heads
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * hd, h)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * hd)
        if spec.owns_cache:
            shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
            if not spec.k_eq_v:
                shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        inter = spec.intermediate_size
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if cfg.is_gemma4:
            shapes[p + "layer_scalar"] = (1,)
        if cfg.has_per_layer_inputs:
            ple_dim = cfg.hidden_size_per_layer_input
            shapes[p + "per_layer_input_gate.weight"] = (ple_dim, h)
            shapes[p + "per_layer_projection.weight"] = (h, ple_dim)
            shapes[p + "post_per_layer_input_norm.weight"] = (h,)
        if cfg.enable_moe_block:
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            shapes[p + "router.proj.weight"] = (e, h)
            shapes[p + "router.scale"] = (h,)
            shapes[p + "router.per_expert_scale"] = (e,)
            shapes[p + "experts.gate_up_proj"] = (e, 2 * mi, h)
            shapes[p + "experts.down_proj"] = (e, h, mi)
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                shapes[p + norm + ".weight"] = (h,)
    return shapes


def _shard_files(directory: Path) -> dict[str, Path]:
    """Map each stored tensor name to its file."""
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise SpecdecError(f"{index}: unreadable index ({e})") from None
        return {name: directory / fname for name, fname in weight_map.items()}
    single = directory / SINGLE_NAME
    if not single.exists():
        raise SpecdecError(f"{directory}: no {SINGLE_NAME} or {INDEX_NAME}")
    return {name: single for name in _tensor_names(single)}


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="numpy") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise SpecdecError(f"{file}: unreadable safetensors file ({e})") from None


def _strip(stored: Iterable[str]) -> dict[str, str]:
    """stripped name -> stored name, keeping only the text model."""
    stored = list(stored)
    multimodal = any(n.startswith(MULTIMODAL_PREFIX) for n in stored)
    out = {}
    for name in stored:
        if name == "lm_head.weight":
            out[name] = name
        elif multimodal:
            if name.startswith(MULTIMODAL_PREFIX):
                out[name[len(MULTIMODAL_PREFIX):]] = name
        elif name.startswith("model."):
            out[name[len("model."):]] = name
    return out


def load_checkpoint(
    path: str | Path, framework: str = "pt", dtype: Any = None, device: str | None = None,
    shard: tuple[int, int] | None = None,
) -> tuple[GemmaConfig, dict[str, Any]]:
    """Read config.json and the weights of a HF directory; tensors come back as `framework` arrays
    ("pt": torch, "flax": jax, "numpy") cast to `dtype` when given, torch tensors on `device` when given
    (moved first, then cast there: a GPU casts a checkpoint in milliseconds, a CPU thread in seconds).
    Safetensors are memory-mapped. `shard` = (rank, tp): only device `rank`'s slice of each tensor that
    tensor parallelism over tp devices splits (config.tp_split_axis), read without the rest; the config
    returned is still the whole model's (its .shard(tp) describes the slices)."""
    directory = Path(path)
    if not directory.is_dir():
        raise SpecdecError(f"{directory}: not a checkpoint directory")
    cfg = GemmaConfig.from_file(directory / "config.json")
    files = _shard_files(directory)
    names = _strip(files)
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in names]
    if missing:
        raise SpecdecError(f"{directory}: missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = [n for n in names if n not in expected and not _unused_by_design(cfg, n)]
    if unexpected:
        raise SpecdecError(f"{files[names[unexpected[0]]]}: unexpected tensor {names[unexpected[0]]!r} for this config")

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[names[name]], []).append(name)
    tensors: dict[str, Any] = {}
    for file, wanted in by_file.items():
        if framework == "numpy":
            views = numpy_views(file)
            for name in wanted:
                t = views[names[name]]
                if t.shape != expected[name]:
                    raise SpecdecError(f"{file}: tensor {names[name]!r} has shape {t.shape}, config expects {expected[name]}")
                t = t[shard_index(cfg, name, t.shape, shard)]
                tensors[name] = t.astype(dtype) if dtype is not None else t
            continue
        try:
            with safe_open(str(file), framework=framework) as f:
                for name in wanted:
                    stored = names[name]
                    shape = tuple(f.get_slice(stored).get_shape())
                    if shape != expected[name]:
                        raise SpecdecError(f"{file}: tensor {stored!r} has shape {shape}, config expects {expected[name]}")
                    index = shard_index(cfg, name, shape, shard)
                    t = f.get_tensor(stored) if index == (...,) else f.get_slice(stored)[index]
                    if device is not None:
                        t = t.to(device)
                    tensors[name] = _cast(t, dtype, framework) if dtype is not None else t
        except (SafetensorError, OSError) as e:
            raise SpecdecError(f"{file}: unreadable safetensors file ({e})") from None
    return cfg, tensors


# safetensors dtype names -> numpy dtypes (BF16: see _numpy_dtype)
_NUMPY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def numpy_views(file: Path) -> dict[str, Any]:
    """Every tensor of a safetensors file as a read-only numpy view of the memory-mapped file: no copy (the
    device transfer reads the page cache directly; safetensors' numpy reader copies every tensor first, a
    second per GB, and knows no bf16). Layout (the format's spec): an 8-byte little-endian header length,
    the JSON header {name: {dtype, shape, data_offsets}}, then the data."""
    import numpy as np

    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if not 0 < header_len <= file.stat().st_size - 8:  # not a safetensors file: do not read a bogus length
                raise ValueError(f"a header of {header_len} bytes in a file of {file.stat().st_size}")
            header = json.loads(f.read(header_len))
        data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
        views = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _numpy_dtype(entry["dtype"])
            begin, end = entry["data_offsets"]
            views[name] = data[begin:end].view(dtype).reshape(entry["shape"])
        return views
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecdecError(f"{file}: unreadable safetensors file ({e})") from None


def shard_index(cfg: GemmaConfig, name: str, shape: tuple[int, ...], shard: tuple[int, int] | None) -> tuple:
    """The index of device `rank`'s slice of a tensor under tensor parallelism (everything if not split)."""
    axis = None if shard is None else tp_split_axis(cfg, name, shard[1])
    if axis is None:
        return (...,)
    rank, tp = shard
    size = shape[axis] // tp
    return (slice(None),) * axis + (slice(rank * size, (rank + 1) * size),)


def _numpy_dtype(name: str):
    if name == "BF16":  # numpy has none; ml_dtypes' is JAX's own
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _NUMPY_DTYPES[name]


def _unused_by_design(cfg: GemmaConfig, name: str) -> bool:
    if not name.startswith("layers."):
        return False
    idx, rest = name[len("layers."):].split(".", 1)
    # A layer past the config's count is unexpected (weights of a deeper model), not unused.
    return int(idx) < cfg.num_layers and not cfg.layers[int(idx)].owns_cache and rest in _SHARED_LAYER_UNUSED


def _cast(t, dtype, framework):
    if framework == "pt":
        return t.to(dtype)
    return t.astype(dtype)


def save_checkpoint(path: str | Path, config: dict[str, Any], tensors: dict[str, Any], max_shard_bytes: int = 2 << 30) -> Path:
    """Write a HF directory: config.json plus safetensors (sharded with an index above `max_shard_bytes`).
    `tensors` are numpy arrays under stripped names; they are stored under HF names (`model.` prefix).
    Written into a temporary directory and renamed into place, so a killed write leaves nothing half-done."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    stored = {(n if n == "lm_head.weight" else "model." + n): a for n, a in tensors.items()}
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, arr in stored.items():
        if size and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / SINGLE_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if path.exists():
        old = path.with_name(path.name + ".old")
        os.replace(path, old)
        os.replace(tmp, path)
        _rmtree(old)
    else:
        os.replace(tmp, path)
    return path


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


def checkpoint_fingerprint(path: str | Path) -> str:
    """A short hash that names one checkpoint's weights: its config.json, and for each safetensors file
    its size, header (names, shapes, dtypes) and 64 blocks of 64 KiB spread through the data. Reading a
    few MiB, not the whole file, keeps it fast for multi-GB checkpoints while any retrained or re-cast
    weights still change it. Draft heads and distilled data record it, so a head is refused by a target
    it was not trained for."""
    import hashlib

    directory = Path(path)
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for file in sorted(set(_shard_files(directory).values())):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header_len, 1 << 24)))
            block = 1 << 16
            for i in range(64):
                f.seek(max(0, (size - block) * i // 63))
                digest.update(f.read(block))
    return digest.hexdigest()[:16]
