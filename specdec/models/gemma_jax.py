"""Gemma 3 / Gemma 4 text models in JAX: pure functions over a params pytree and a static KV cache.

The math, the order of float operations and the cache semantics mirror `gemma_torch` (read its module
docstring): sliding layers keep a ring of `window + decode_width(k_max) - 1` slots and full layers every
position, each a few more (GemmaConfig.cache_slots), each slot remembering the absolute position written there
(slot = position % slots).
A decode forward (`commit_first=True`) writes its keys/values layer by layer before attending over the
cache alone, each row to the stored positions <= its own (row invariance); a prefill forward sees cached
slots with position < its first position plus itself causally, and commits after the last layer (the last
`slots` tokens when the chunk is longer than a ring). k_eq_v layers store the normed raw K (which is
V) and rebuild K from it; KV-shared layers read their producer's cache and the producer's new keys/values.
In tensor-parallel parts (`Parts`), the forward runs inside shard_map, each part of each device as a device
holding that part alone: its own GEMMs, its own cache writes and attention over its KV heads, partial outputs
added in one order (sum_parts).

Params are the checkpoint's tensors under their stripped HF names (`layers.3.self_attn.q_proj.weight`), in
torch's [out, in] layout, or those with each layer's q/k/v and gate/up packed into one weight
(`pack_projections`); with FP8 weights (specdec.models.fp8), each linear's weight is an Fp8Weight, its values and
scales. `cfg` is not hashable (it holds a dict), so jit closes over it rather than taking it as a
static argument: `jax.jit(lambda p, t, pos, c: forward(p, cfg, t, pos, c), donate_argnums=3)`.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specdec.models import decode_attention_jax, decode_mlp_jax, decode_norms_jax
from specdec.models.checkpoint import expected_shapes, load_checkpoint
from specdec.models.config import FULL, SLIDING, GemmaConfig, LayerSpec, rope_inv_freq, vocab_rows
from specdec.models.decode_plan import MOST_SPLITS, reduction_splits
from specdec.models.fp8_jax import Fp8Weight
from specdec.models.fp8_jax import product as fp8_product
from specdec.models.fp8_jax import quantize_params
from specdec.models.memory import free_bytes

Params = dict[str, jax.Array]
Cache = dict[str, Any]  # {"keys": [per layer], "values": [per layer], "slot_pos": {kind: [B, S] int32}}
KINDS = (SLIDING, FULL)


def default_dtype():
    """bf16 on accelerators, fp32 on CPU (the parity tests' precision)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load_params(path: str | Path, dtype=None, pack: bool = False, fp8: bool = False) -> tuple[GemmaConfig, Params]:
    """Config and device arrays of a HF checkpoint directory, cast to `dtype` (default_dtype() if None) and,
    with `pack`, packed (pack_projections); with `fp8`, its linears in FP8 (fp8_params). Tensors are read
    memory-mapped and cast on the device."""
    cfg, tensors = load_checkpoint(path, framework="numpy")
    return cfg, to_device(tensors, dtype, pack, fp8=fp8, tied=cfg.tie_word_embeddings)


def to_device(tensors: dict[str, np.ndarray], dtype=None, pack: bool = False, fp8: bool = False,
              tied: bool = True) -> Params:
    """Host tensors as device arrays of `dtype` (default_dtype() if None), packed with `pack`: one transfer
    call for every tensor (they overlap) and one compiled cast, rather than a transfer and an eagerly
    dispatched cast per tensor. Packing in that program costs no pass and no memory of its own. `fp8`: the
    linears quantized from the checkpoint's values in that program (fp8_params; `tied`: the token table is the
    LM head)."""
    return _cast_params(jax.device_put(tensors), jnp.dtype(dtype or default_dtype()), pack, fp8, tied)


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _cast_params(params: Params, dtype, pack: bool, fp8: bool, tied: bool) -> Params:
    params = quantize_params(params, "embed_tokens.weight" if tied else None) if fp8 else params
    cast = {name: t if isinstance(t, Fp8Weight) else t.astype(dtype) for name, t in params.items()}
    return pack_projections(cast) if pack else cast


def to_device_shapes(tensors: dict[str, np.ndarray], dtype=None, pack: bool = False, fp8: bool = False,
                     tied: bool = True) -> Params:
    """What to_device returns for `tensors`, as shapes and dtypes (jax.ShapeDtypeStruct), moving nothing."""
    structs = {name: jax.ShapeDtypeStruct(t.shape, t.dtype) for name, t in tensors.items()}
    dtype = jnp.dtype(dtype or default_dtype())
    return jax.eval_shape(lambda t: _cast_params(t, dtype, pack, fp8, tied), structs)


def fp8_params(params: Params, cfg: GemmaConfig) -> Params:
    """params with their linears as FP8 weights (specdec.models.fp8_jax.quantize_params), a tied LM head as an FP8
    copy of the token table."""
    tied = cfg.tie_word_embeddings and "embed_tokens.weight" in params
    return _fp8_params(params, "embed_tokens.weight" if tied else None)


_fp8_params = jax.jit(quantize_params, static_argnums=1)


def is_fp8(params: Params) -> bool:
    """Whether params hold FP8 weights: their LM head always is one (a tied head's FP8 copy included)."""
    return isinstance(params.get("lm_head.weight"), Fp8Weight)


# Linears that read one input, in the order their packed weight stacks them.
PACKS = {"self_attn.": ("q_proj", "k_proj", "v_proj"), "mlp.": ("gate_proj", "up_proj")}


def packed_name(prefix: str, names) -> str:
    """`layers.3.self_attn.` + (q_proj, k_proj) -> `layers.3.self_attn.q_proj+k_proj.weight`."""
    return f"{prefix}{'+'.join(names)}.weight"


def pack_projections(params: Params, parts: int = 1, pack: Callable[[list], jax.Array] | None = None) -> Params:
    """Each layer's q/k/v (those it has) and gate/up weights as one [sum of out, in] weight under
    `packed_name`, as gemma_torch's Packed: at decode a GEMM of 16 rows costs a launch and, in XLA, a split of
    its reduction with a kernel that sums the parts, however small it is. The forward reads either form.
    In tensor-parallel `parts` (Parts), part 0's rows of every linear come first, then part 1's, ... ([parts * rows
    of a part, in]), so that a split by rows over any device count dividing `parts` leaves each device whole parts,
    each the matrix a device holding that part alone would pack; a single linear (a KV-shared layer's q_proj) is
    already in that order. `pack`: what packs one block's weights (pack_rows in `parts` by default)."""
    pack = pack or partial(pack_rows, parts=parts)
    params = dict(params)
    layers = {layer_prefix(name) for name in params} - {""}
    for layer in sorted(layers):
        for block, names in PACKS.items():
            members = [m for m in names if f"{layer}{block}{m}.weight" in params]
            if len(members) > 1:
                params[packed_name(layer + block, members)] = pack(
                    [params.pop(f"{layer}{block}{m}.weight") for m in members])
    return params


def pack_rows(weights: list, parts: int = 1) -> jax.Array:
    """[out_i, in] weights as one [sum of out_i, in]: in `parts`, each weight's rows of part 0, then of part 1, ...
    FP8 weights pack their values and their scales (a scale per row) alike."""
    if isinstance(weights[0], Fp8Weight):
        return Fp8Weight(*(pack_rows(list(field), parts) for field in zip(*weights)))
    chunks = [jnp.split(w, parts) for w in weights]
    return jnp.concatenate([chunk[part] for part in range(parts) for chunk in chunks])


@dataclasses.dataclass(frozen=True)
class Parts:
    """Tensor-parallel parts (config.check_tp_parts): every split weight computed as `count` GEMMs of a `count`-way
    split's shapes, `count / devices` of them on each device of mesh axis `axis`, and row-parallel partial outputs
    added in one order (sum_parts). A forward in parts runs inside shard_map (sharding_jax.forward_in_parts) on each
    device's blocks of the weights packed in parts (pack_projections), and of the cache split by KV head."""

    count: int
    devices: int
    axis: str = "tp"

    @property
    def local(self) -> int:
        """The parts each device computes."""
        return self.count // self.devices

    def splits_table(self, cfg: GemmaConfig, name: str) -> bool:
        """Whether token table `name` is split by vocabulary (when the parts divide it; else it is whole)."""
        return vocab_rows(cfg, name) % self.count == 0


def random_params(cfg: GemmaConfig, key: jax.Array, dtype=jnp.bfloat16, pack: bool = False,
                  place: Callable[[Params], Params] | None = None, fp8: bool = False) -> Params:
    """Random weights of every tensor the config needs, made on the device (benchmarks, sharding tests).
    Matrices ~ N(0, 1/fan_in); 1-D norms and scalars at their neutral value. `pack`: the same values with each
    layer packed (pack_projections) as it is made, so that no more than one layer's projections are held twice.
    `fp8`: each layer's linears then quantized (fp8_params) as it is made. `place`: where each layer's weights go
    once made (jax.device_get: host memory), so that the device holds one layer's at a time (a model larger than one
    device, for a mesh to split)."""
    neutral = 1.0 - cfg.norm_weight_offset  # Gemma 3 norms scale by (1 + w), Gemma 4 by w

    def make(i, shape):
        if len(shape) == 1:
            return jnp.full(shape, neutral, dtype)
        return _random_normal(jax.random.fold_in(key, i), shape, dtype, shape[-1] ** -0.5)

    params = {}
    named = enumerate(sorted(expected_shapes(cfg).items()))  # sorted names keep each layer's together
    for _, group in itertools.groupby(named, key=lambda item: layer_prefix(item[1][0])):
        made = {name: make(i, shape) for i, (name, shape) in group}
        made = pack_projections(made) if pack else made
        made = fp8_params(made, cfg) if fp8 else made
        params.update(place(made) if place else made)
    return params


def layer_prefix(name: str) -> str:
    """`layers.3.mlp.up_proj.weight` -> `layers.3.`; "" for a tensor of no layer."""
    return name[: name.index(".", len("layers.")) + 1] if name.startswith("layers.") else ""


@partial(jax.jit, static_argnums=(1, 2, 3))
def _random_normal(key, shape, dtype, std):
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def init_cache(cfg: GemmaConfig, batch: int, max_seq_len: int, k_max: int, dtype=None, lookahead: int = 0) -> Cache:
    """Empty cache: keys/values [B, n_kv, slots, head_dim] for layers owning a cache (values None for
    k_eq_v layers, both None for KV-shared layers), slot positions -1. `lookahead`: GemmaConfig.cache_slots."""
    dtype = dtype or default_dtype()
    cfg.check_cache_fits(batch, max_seq_len, k_max, jnp.dtype(dtype).itemsize, free_bytes("jax"),
                         jax.devices()[0].platform, lookahead)
    layout = cfg.kv_cache_shapes(batch, max_seq_len, k_max, lookahead)
    keys = [jnp.zeros(entry[0], dtype) if entry else None for entry in layout]
    values = [jnp.zeros(entry[0], dtype) if entry and entry[1] else None for entry in layout]
    slots = cfg.cache_slots(max_seq_len, k_max, lookahead)
    slot_pos = {kind: jnp.full((batch, n), -1, jnp.int32) for kind, n in slots.items()}
    return {"keys": keys, "values": values, "slot_pos": slot_pos}


def reset_cache(cache: Cache) -> Cache:
    """Every slot empty again (stale keys/values stay; the positions hide them)."""
    return dict(cache, slot_pos={kind: jnp.full_like(p, -1) for kind, p in cache["slot_pos"].items()})


# -- building blocks ----------------------------------------------------------------------------------


def _linear(x, weight):
    if isinstance(weight, Fp8Weight):  # scaled in float32, rounded once (specdec.models.fp8)
        return fp8_product(x, weight).astype(x.dtype)
    return x @ weight.T


def _rows(weight, start: int, stop: int):
    """weight[start:stop]: output rows, an FP8 weight's with their scales."""
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(weight.values[start:stop], weight.scale[start:stop])
    return weight[start:stop]


def _columns(weight, start: int, stop: int):
    """weight[:, start:stop]: a slice of the reduction; an FP8 weight keeps its rows' scales, the whole rows'."""
    if isinstance(weight, Fp8Weight):
        return Fp8Weight(weight.values[:, start:stop], weight.scale)
    return weight[:, start:stop]


# down_proj's slices in a decode forward, where its weight has at least DOWN_SPLIT_BYTES for each 8 of the forward's
# rows. In 4, XLA split each slice's GEMM in 4 again and added those in a kernel of its own (1.7 us a layer on E4B);
# in 8 it keeps them whole, and the residual-add kernel adds the 8. Plain cycles on an H200, 4 slices against 8, at
# 8 rows: E4B 0.45% shorter in 8 (a 52 MB weight), the whole 31B 1.1% (231 MB) and in FP8 4.0% (115 MB); E4B in FP8
# (26 MB) 1.2% longer, the 270M (2.6 MB) within its runs' spread. At 16 rows the add of 8 slices grows: E4B 0.6%
# longer, the 31B's first six layers still 1.8% shorter, 3.3% in FP8. 16 slices were slower on E4B: the add grew
# more than the kernel it absorbed (docs/journal).
DOWN_SPLITS, DOWN_SPLIT_BYTES = 8, 32 << 20


def _down_splits(down, rows: int) -> int:
    """The most slices a decode forward of `rows` rows splits down_proj's reduction into (_split_product)."""
    values = down.values if isinstance(down, Fp8Weight) else down
    return DOWN_SPLITS if values.nbytes >= DOWN_SPLIT_BYTES * max(1, rows // 8) else MOST_SPLITS


def _split_product(x, weight, multiple: int = 64, most: int = MOST_SPLITS):
    """x [B, T, K] by weight [N, K] as the products of its reduction's slices, [splits, B, T, N]: split as torch's
    are (reduction_splits, at most `most` slices of a multiple of `multiple`), in float32, for a kernel that adds
    them in order and rounds the sum as _linear's product rounds; one slice holds _linear's product itself. The
    slices are views: [B, T, splits, part] by [N, splits, part], as gemma_torch.split_products' are. An FP8
    weight's scales multiply each slice's float32 product."""
    B, T, reduction = x.shape
    columns = weight.shape[0]
    splits = reduction_splits(B * T, columns, reduction, multiple, most)
    if splits == 1:
        return _linear(x, weight)[None]
    values = weight.values.astype(x.dtype) if isinstance(weight, Fp8Weight) else weight
    partials = jax.lax.dot_general(x.reshape(B, T, splits, -1), values.reshape(columns, splits, -1),
                                   (((3,), (2,)), ((2,), (1,))), preferred_element_type=jnp.float32)
    return partials * weight.scale if isinstance(weight, Fp8Weight) else partials


def _split_linear(x, weight):
    """_linear's product as _split_product's slices, added in order in float32 and rounded once. XLA ran the 270M's
    gate/up (640 -> 4,096) as one GEMM in 8 x 64 tiles, 64 programs on 132 SMs: 4.2 us on an H200. In 4 slices of
    160 it takes 3.7, in 2 of 320 4.0 (docs/journal); q/k/v keeps slices of a multiple of 64, as its kernel
    adds 4 slices slower than 2."""
    partials = _split_product(x, weight, multiple=32)
    if partials.shape[0] == 1:
        return partials[0]
    return decode_attention_jax.summed_splits(lambda s: partials[s], partials.shape[0], x.dtype).astype(x.dtype)


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def _rms_norm(x, weight, cfg: GemmaConfig):
    """Gemma RMSNorm in float32: Gemma 3 scales by (1 + w) with rsqrt, Gemma 4 by w with pow(-0.5);
    weight None is Gemma 4's scale-free norm (v-norm, router)."""
    xf = x.astype(jnp.float32)
    mean_sq = jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps
    normed = xf * (mean_sq**-0.5 if cfg.is_gemma4 else jax.lax.rsqrt(mean_sq))
    if weight is not None:
        normed = normed * (cfg.norm_weight_offset + weight.astype(jnp.float32))
    return normed.astype(x.dtype)


def _rope_cos_sin(inv_freq: np.ndarray, positions, dtype):
    """cos, sin [..., head_dim] at integer positions: the rows gemma_torch reads from its float32 tables."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _apply_rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


# -- the chunk's context: rope and masks shared by every layer of a kind ---------------------------------


def _chunk_context(cfg: GemmaConfig, positions, cache: Cache, dtype, commit_first: bool) -> dict:
    """RoPE rows, masks and slots of a chunk. Committing first, the chunk's positions enter `cache` (a live
    copy the layers write into) now, and each row may attend to the stored positions <= its own. "arrivals": the
    per-layer gate kernel's zeroed counters, which each layer that runs it passes on (None before the first)."""
    B, T = positions.shape
    start = positions[:, :1]  # chunks are contiguous: positions[:, t] = start + t
    causal = jnp.tril(jnp.ones((T, T), bool))
    rows = jnp.arange(B)[:, None]
    ctx = {"cos": {}, "sin": {}, "cached_cos": {}, "cached_sin": {}, "mask": {}, "slots": {}, "attended": {},
           "commit_first": commit_first, "arrivals": None}
    for kind in KINDS:
        inv_freq = rope_inv_freq(cfg.rope[kind], cfg.kind_head_dim(kind))
        cos, sin = _rope_cos_sin(inv_freq, positions, dtype)
        ctx["cos"][kind], ctx["sin"][kind] = cos[:, :, None], sin[:, :, None]  # [B, T, 1, hd]
        if commit_first:
            slot = positions % cache["slot_pos"][kind].shape[1]
            ctx["slots"][kind] = (rows, slot)
            cache["slot_pos"][kind] = cache["slot_pos"][kind].at[rows, slot].set(positions, unique_indices=True)
        stored = cache["slot_pos"][kind]  # [B, S]
        if any(s.k_eq_v and s.kind == kind for s in cfg.layers):
            cos, sin = _rope_cos_sin(inv_freq, jnp.maximum(stored, 0), dtype)
            ctx["cached_cos"][kind], ctx["cached_sin"][kind] = cos[:, None], sin[:, None]  # [B, 1, S, hd]
        window = cfg.sliding_window if kind == SLIDING else None
        if commit_first:
            # The lowest and highest stored position each row attends: the mask's bounds, which decode_attention_jax
            # reads too. Empty slots hold -1.
            lowest = jnp.zeros_like(positions) if window is None else jnp.maximum(positions - window + 1, 0)
            ctx["attended"][kind] = (lowest, positions)
            cache_mask = (stored[:, None, :] >= lowest[:, :, None]) & (stored[:, None, :] <= positions[:, :, None])
        else:
            visible = (stored >= 0) & (stored < start)
            cache_mask = jnp.broadcast_to(visible[:, None, :], (B, T, stored.shape[1]))  # [B, T, S]
            chunk_mask = jnp.broadcast_to(causal[None], (B, T, T))
            if window is not None:
                cache_mask = cache_mask & (stored[:, None, :] > positions[:, :, None] - window)
                chunk_mask = chunk_mask & (positions[:, None, :] > positions[:, :, None] - window)
        mask = cache_mask if commit_first else jnp.concatenate([cache_mask, chunk_mask], axis=-1)
        ctx["mask"][kind] = mask[:, None, :, None]  # [B, 1, T, 1, S (+T)]
    return ctx


# -- attention --------------------------------------------------------------------------------------------


def _keys_from_stored(stored, k_norm_weight, cos, sin):
    """k_eq_v: K = RoPE(k_norm.weight * normed raw K), from the stored normed raw K ([B, n_kv, S, hd])."""
    k = (stored.astype(jnp.float32) * k_norm_weight.astype(jnp.float32)).astype(stored.dtype)
    return _apply_rope(k, cos, sin)


def _project(params: Params, prefix: str, names, x, sizes=None, parts: Parts | None = None, part: int = 0,
             split: bool = False) -> list:
    """x through the linears `prefix + name` in order, each giving `sizes[i]` features (None: as many each):
    one GEMM over their packed weight (pack_projections) when the params hold it, or with `split` its reduction's
    slices added (_split_linear). In `parts`: part `part` of this device's block (packed in parts), whose linears
    give sizes / parts.count features."""
    if parts is not None:
        block = params[packed_name(prefix, names) if len(names) > 1 else f"{prefix}{names[0]}.weight"]
        rows = block.shape[0] // parts.local
        packed = _rows(block, part * rows, (part + 1) * rows)
        sizes = None if sizes is None else [size // parts.count for size in sizes]
        x = _own_input(x, part)
    else:
        packed = params.get(packed_name(prefix, names))
        if packed is None:
            return [_linear(x, params[f"{prefix}{name}.weight"]) for name in names]
    product = _split_linear(x, packed) if split else _linear(x, packed)
    return jnp.split(product, len(names) if sizes is None else np.cumsum(sizes)[:-1], axis=-1)


def _own_input(x, part: int):
    """x as an input of part `part`'s GEMM alone. XLA's DotMerger (in its GPU pipeline) merges GEMMs that share an
    operand into one wider GEMM, which one device holding several parts would then run where a device holding one
    part runs its own; behind a barrier of its own, each part's GEMM keeps its operand."""
    return jax.lax.optimization_barrier((x, jnp.int32(part)))[0]


def _row_parallel(params: Params, name: str, inputs: list, parts: Parts | None):
    """The row-parallel linear `name` (o_proj, down_proj) over one input per part (in `parts`, each part's columns of
    this device's block, the partials then added by sum_parts; else the one input)."""
    weight = params[name]
    if parts is None:
        return _linear(inputs[0], weight)
    cols = weight.shape[1] // parts.local
    return sum_parts([_linear(x, _columns(weight, part * cols, (part + 1) * cols)) for part, x in enumerate(inputs)],
                     parts)


def sum_parts(partials: list, parts: Parts):
    """A row-parallel linear's output from its parts' partial outputs: every device's gathered in device order,
    added one by one in float32 and rounded once, so any device count adds the same partials in the same order (an
    all-reduce's order is the library's). Each partial is rounded to its dtype explicitly: where no gather stores the
    partials (one device), XLA's excess precision could otherwise feed a product's float32 to the sum unrounded (on
    the CPU the bits are the same without it; not yet checked on a GPU)."""
    stacked = jnp.stack(partials)
    rounded = jax.lax.reduce_precision(stacked.astype(jnp.float32), *_bits(stacked.dtype))
    gathered = jax.lax.all_gather(rounded, parts.axis, axis=0, tiled=True)  # [parts.count, ...]
    total = gathered[0]
    for part in range(1, parts.count):
        total = total + gathered[part]
    return total.astype(stacked.dtype)


def _bits(dtype) -> tuple[int, int]:
    """(exponent bits, mantissa bits) of a float dtype, for lax.reduce_precision."""
    info = jnp.finfo(dtype)
    return info.nexp, info.nmant


def _lookup(params: Params, cfg: GemmaConfig, name: str, tokens, parts: Parts | None):
    """Rows of token table `name` for `tokens`. Split by vocabulary over the devices, each device gives zeros for the
    tokens it does not hold and the sum across devices is every token's row, exactly."""
    table = params[name]
    if parts is None or not parts.splits_table(cfg, name):
        return jnp.take(table, tokens, axis=0)
    local = tokens - jax.lax.axis_index(parts.axis) * table.shape[0]
    held = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    return jax.lax.psum(jnp.where(held[..., None], rows, jnp.zeros((), rows.dtype)), parts.axis)


def _project_kv(params: Params, cfg: GemmaConfig, spec: LayerSpec, raw_k, raw_v, ctx):
    """New keys/values of this chunk, [B, n_kv, T, hd] each, and what the cache stores for them, from the
    k_proj (and v_proj) outputs [B, T, n_kv * hd]."""
    B, T, _ = raw_k.shape
    p = f"layers.{spec.index}.self_attn."
    kind = spec.kind
    raw_k = raw_k.reshape(B, T, -1, spec.head_dim)
    if spec.k_eq_v:
        v = _rms_norm(raw_k, None, cfg).transpose(0, 2, 1, 3)
        cos, sin = ctx["cos"][kind].transpose(0, 2, 1, 3), ctx["sin"][kind].transpose(0, 2, 1, 3)
        k = _keys_from_stored(v, params[p + "k_norm.weight"], cos, sin)
        return k, v, (v, None)
    k = _apply_rope(_rms_norm(raw_k, params[p + "k_norm.weight"], cfg), ctx["cos"][kind], ctx["sin"][kind])
    k = k.transpose(0, 2, 1, 3)
    v = raw_v.reshape(B, T, -1, spec.head_dim)
    if cfg.is_gemma4:
        v = _rms_norm(v, None, cfg)
    v = v.transpose(0, 2, 1, 3)
    return k, v, (k, v)


def _projections(spec: LayerSpec) -> tuple[str, ...]:
    """The linears a layer projects its input through for attention: q_proj, and k_proj and v_proj where it has them."""
    return ("q_proj",) + (("k_proj",) + (() if spec.k_eq_v else ("v_proj",)) if spec.owns_cache else ())


def _weights(params: Params, prefix: str, names) -> tuple:
    """The weights of the linears `prefix + name`, as params hold them: packed (pack_projections) or one by one."""
    packed = params.get(packed_name(prefix, names))
    return (packed,) if packed is not None else tuple(params.get(f"{prefix}{name}.weight") for name in names)


def _attention(params: Params, cfg: GemmaConfig, spec: LayerSpec, x, ctx, cache: Cache, shared_kv, writes,
               parts: Parts | None = None, split: bool = False, prefetch=()):
    """The layer's attention output: o_proj's product, or with `split` the slices of its reduction (_split_product).
    `prefetch`: weights the attention kernel reads into L2 on the side (decode_attention_jax.with_prefetch)."""
    B, T, _ = x.shape
    p = f"layers.{spec.index}.self_attn."
    hd, kind = spec.head_dim, spec.kind
    groups = cfg.num_heads // spec.num_kv_heads
    nkv = spec.num_kv_heads // (parts.count if parts else 1)  # of a part (in `parts`), else of the model
    names = _projections(spec)
    sizes = (cfg.num_heads * hd,) + (spec.num_kv_heads * hd,) * (len(names) - 1)
    fused = _fused_inputs(params, cfg, spec, names, x, ctx, cache, parts)
    queries, new_kv = [] if fused is None else [fused], []
    for part in range(parts.local if parts else 1) if fused is None else ():
        q, *kv = _project(params, p, names, x, sizes, parts, part)
        q = q.reshape(B, T, nkv * groups, hd)
        q = _apply_rope(_rms_norm(q, params[p + "q_norm.weight"], cfg), ctx["cos"][kind], ctx["sin"][kind])
        queries.append(q.reshape(B, T, nkv, groups, hd))  # query head h uses kv head h // groups
        if spec.owns_cache:
            new_kv.append(_project_kv(params, cfg, spec, kv[0], kv[1] if len(kv) > 1 else None, ctx))

    if spec.owns_cache and fused is None:
        if ctx["commit_first"]:
            # Each part writes its own heads: joined first, XLA would compute every part's keys in one wider
            # fusion, which on the CPU rounded otherwise than a device holding one part (float32).
            for part, (_, _, stored) in enumerate(new_kv):
                held = None if parts is None else (part * nkv, (part + 1) * nkv)
                _write_kv(cache, spec.index, ctx["slots"][kind], *stored, heads=held)
        else:  # one part at most (forward)
            k_new, v_new, stored = new_kv[0]
            writes[spec.index] = stored
            shared_kv[spec.index] = (k_new, v_new)
    elif not ctx["commit_first"]:
        k_new, v_new = shared_kv[spec.kv_source]
    outs = []
    for part, q in enumerate(queries):  # each part over its own heads, as a device holding that part alone
        heads = partial(_heads, part=part, nkv=nkv, count=len(queries))
        k_old, v_old = heads(cache["keys"][spec.kv_source]), cache["values"][spec.kv_source]
        if v_old is None:  # k_eq_v: the stored tensor is V; rebuild K at the stored positions
            v_old = k_old
            k_norm = params[f"layers.{spec.kv_source}.self_attn.k_norm.weight"]
            k_old = _keys_from_stored(k_old, k_norm, ctx["cached_cos"][kind], ctx["cached_sin"][kind])
        else:
            v_old = heads(v_old)
        if ctx["commit_first"] and decode_attention_jax.takes(q, k_old, cfg.attn_logit_softcapping):
            out = decode_attention_jax.attend(q, k_old, v_old, cache["slot_pos"][kind], *ctx["attended"][kind],
                                              cfg.attention_scale, prefetch)
        else:
            kv = [(k_old, v_old)] if ctx["commit_first"] else [(k_old, v_old), (heads(k_new), heads(v_new))]
            out = _attend(cfg, q, kv, ctx["mask"][kind])
        outs.append(out.reshape(B, T, -1))
    if split:
        return _split_product(outs[0], params[p + "o_proj.weight"])
    return _row_parallel(params, p + "o_proj.weight", outs, parts)


def _fused_inputs(params: Params, cfg: GemmaConfig, spec: LayerSpec, names, x, ctx, cache: Cache,
                  parts: Parts | None):
    """A decode forward's q [B, T, n_kv, groups, hd], normed and rotated, by decode_attention_jax.inputs, which also
    writes the layer's new keys and values into `cache`; None where that kernel does not take the layer (a prefill,
    tensor-parallel parts, k_eq_v, weights not packed, or shapes it does not take). The projection's reduction is
    split as torch's is (reduction_splits) and the kernel adds the splits: left to XLA, its own split is summed by a
    kernel of its own, since that sum cannot fuse into the kernel as it fused into q's norm."""
    B, T, _ = x.shape
    p, kind, hd = f"layers.{spec.index}.self_attn.", spec.kind, spec.head_dim
    weight = params.get(packed_name(p, names) if len(names) > 1 else f"{p}q_proj.weight")
    if (not ctx["commit_first"] or parts is not None or spec.k_eq_v or weight is None
            or not decode_attention_jax.takes_inputs(cfg.num_heads, spec.num_kv_heads, hd, x.dtype)):
        return None
    partials = _split_product(x, weight)
    index, writes = spec.index, spec.owns_cache
    q, keys, values = decode_attention_jax.inputs(
        partials.reshape(partials.shape[0], B, T, -1, hd), params[p + "q_norm.weight"],
        params[p + "k_norm.weight"] if writes else None, ctx["cos"][kind][:, :, 0], ctx["sin"][kind][:, :, 0],
        ctx["slots"][kind][1], cache["keys"][index] if writes else None, cache["values"][index] if writes else None,
        q_heads=cfg.num_heads, kv_heads=spec.num_kv_heads, eps=cfg.rms_norm_eps, weight_offset=cfg.norm_weight_offset,
        v_norm=cfg.is_gemma4, dtype=x.dtype)
    if writes:
        cache["keys"][index], cache["values"][index] = keys, values
    return q.reshape(B, T, spec.num_kv_heads, cfg.num_heads // spec.num_kv_heads, hd)


def _heads(t, *, part: int, nkv: int, count: int):
    """Part `part`'s KV heads of [B, n_kv, S, hd] (all of them when there is one part)."""
    return t if count == 1 else t[:, part * nkv : (part + 1) * nkv]


def _attend(cfg: GemmaConfig, q, kv: list, mask):
    """q [B, T, n_kv, groups, hd] over kv [(keys, values) [B, n_kv, S, hd]] -> [B, T, n_kv, groups, hd].

    Decode: the cache alone. Prefill: [cached slots | this chunk] without concatenating the cache; scores
    are joined for one softmax, then split again for the value products. A KV head's rows run by token, then
    query head, as in gemma_torch: XLA then lays the scores out slot-contiguous, and the softmax over them took
    2.4 us a sliding layer on an H100, against 5.0-5.3 us with rows by head."""
    scores = jnp.concatenate([jnp.einsum("btkgd,bksd->bktgs", q, k) for k, _ in kv], axis=-1)
    scores = scores * cfg.attention_scale
    if cfg.attn_logit_softcapping is not None:
        cap = cfg.attn_logit_softcapping
        scores = jnp.tanh(scores / cap) * cap
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    splits = np.cumsum([v.shape[2] for _, v in kv])[:-1]
    return sum(jnp.einsum("bktgs,bksd->btkgd", p_, v) for p_, (_, v) in zip(jnp.split(probs, splits, axis=-1), kv))


# -- feed-forward -----------------------------------------------------------------------------------------


def _mlp(params: Params, prefix: str, x, parts: Parts | None = None, split: bool = False, kernels: bool = False):
    """down_proj's product, or with `split` the slices of its reduction (_split_product), gate/up's then split too.
    `kernels` (a decode forward's): gate/up and its GELU in one kernel where decode_mlp_jax takes the weight."""
    packed = params.get(packed_name(prefix, PACKS["mlp."]))
    if kernels and decode_mlp_jax.takes(packed, x.shape[0] * x.shape[1], x.dtype):
        hidden = [decode_mlp_jax.gated(x, packed)]
    else:
        hidden = []
        for part in range(parts.local if parts else 1):
            gate, up = _project(params, prefix, PACKS["mlp."], x, parts=parts, part=part, split=split)
            hidden.append(_gelu(gate) * up)
    if split:
        down = params[prefix + "down_proj.weight"]
        return _split_product(hidden[0], down, most=_down_splits(down, x.shape[0] * x.shape[1]))
    return _row_parallel(params, prefix + "down_proj.weight", hidden, parts)


def _route(params: Params, cfg: GemmaConfig, prefix: str, x):
    """x [N, H] -> routing weights [N, k] and expert ids [N, k]."""
    normed = _rms_norm(x, None, cfg) * params[prefix + "router.scale"] * cfg.hidden_size**-0.5
    probs = jax.nn.softmax(_linear(normed, params[prefix + "router.proj.weight"]).astype(jnp.float32), axis=-1)
    weights, index = jax.lax.top_k(probs, cfg.top_k_experts)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights * params[prefix + "router.per_expert_scale"][index], index


def _experts(params: Params, prefix: str, x, weights, index):
    """x [N, H], weights/index [N, k] -> [N, H]. Experts are gathered per token while that reads fewer
    weights than running every expert densely (gemma_torch's rule); shapes are static either way."""
    gate_up, down = params[prefix + "experts.gate_up_proj"], params[prefix + "experts.down_proj"]
    n, k = index.shape
    num_experts = gate_up.shape[0]
    if n * k < num_experts:
        gate, up = jnp.split(jnp.einsum("nh,nkih->nki", x, gate_up[index]), 2, axis=-1)
        out = jnp.einsum("nki,nkhi->nkh", _gelu(gate) * up, down[index])
        return (out * weights[..., None].astype(out.dtype)).sum(axis=1)
    dense_weights = jnp.zeros((n, num_experts), weights.dtype).at[jnp.arange(n)[:, None], index].set(weights)
    gate, up = jnp.split(jnp.einsum("nh,eih->nei", x, gate_up), 2, axis=-1)
    out = jnp.einsum("nei,ehi->neh", _gelu(gate) * up, down)
    return jnp.einsum("neh,ne->nh", out, dense_weights.astype(out.dtype))


def _read_ahead(*weights) -> tuple:
    """decode_attention_jax.prefetched of weights as they are stored: an FP8 weight's values, as bytes."""
    return decode_attention_jax.prefetched(*(
        jax.lax.bitcast_convert_type(w.values, jnp.uint8) if isinstance(w, Fp8Weight) else w for w in weights))


def _decoder_layer(params: Params, cfg: GemmaConfig, spec: LayerSpec, x, per_layer, ctx, cache, shared_kv,
                   writes, parts: Parts | None = None, normed=None, next_norm=None, next_weights=()):
    """-> (x after the layer, x through `next_norm` or None). `per_layer`: every layer's per-layer inputs [B, T,
    layers, P] (Gemma 4's E models), else None. `normed`: x through this layer's input norm, where the layer before
    computed it, else None. `next_norm`: the weight of the next layer's input norm, or None. `next_weights`: the next
    layer's q/k/v weights.

    A decode forward that takes decode_norms_jax runs each residual add with the norms around it in one kernel:
    the one after attention, and the layer's last (after down_proj, or after the per-layer projection), which also
    norms x for the next layer where there is one and no MoE block. With per-layer inputs, the add after down_proj
    runs there too, with no norm after it: the per-layer gate takes x itself. Gate/up and its GELU run as one kernel
    (decode_mlp_jax) where it takes the weight, the last layer's too, and so do the per-layer gate, its GELU and its
    product with the layer's per-layer input (per_layer_gated). Spare programs of two kernels read
    weights of up to 8 MB into L2 for the products ahead (decode_attention_jax.prefetched): attention's partials the
    layer's o_proj, gate/up and down, and the layer's last kernel the next layer's q/k/v. XLA's products wait on
    entry for the kernel before them, so they cannot load their weights early; from L2 they start sooner (a 270M
    cycle 2.8% shorter on an H200, docs/journal)."""
    p = f"layers.{spec.index}."
    norm = lambda name, v: _rms_norm(v, params[p + name + ".weight"], cfg)  # noqa: E731
    kernel = ctx["commit_first"] and parts is None and decode_norms_jax.takes(cfg.hidden_size, x.dtype)
    closes = kernel and next_norm is not None and not cfg.enable_moe_block
    residual_norms = partial(decode_norms_jax.residual_norms, eps=cfg.rms_norm_eps,
                             weight_offset=cfg.norm_weight_offset)
    scale = params[p + "layer_scalar"] if cfg.is_gemma4 else None
    residual = x
    ahead = _read_ahead(params[p + "self_attn.o_proj.weight"],
                                            *_weights(params, p + "mlp.", PACKS["mlp."]),
                                            params[p + "mlp.down_proj.weight"]) if closes else ()
    attn = _attention(params, cfg, spec, norm("input_layernorm", x) if normed is None else normed, ctx, cache,
                      shared_kv, writes, parts, split=kernel, prefetch=ahead)
    if kernel:
        x, h = residual_norms(attn, residual, params[p + "post_attention_layernorm.weight"],
                              params[p + "pre_feedforward_layernorm.weight"])
    else:
        x = residual + norm("post_attention_layernorm", attn)
        h = norm("pre_feedforward_layernorm", x)
    residual = x
    if closes:
        down = _mlp(params, p + "mlp.", h, split=True, kernels=True)
        post_norm = params[p + "post_feedforward_layernorm.weight"]
        if not cfg.has_per_layer_inputs:
            return residual_norms(down, residual, post_norm, next_norm, scale, prefetch=_read_ahead(*next_weights))
        x, _ = residual_norms(down, residual, post_norm, None)
    else:
        h = _mlp(params, p + "mlp.", h, parts, kernels=kernel)
        if cfg.enable_moe_block:
            flat = residual.reshape(-1, residual.shape[-1])
            weights, index = _route(params, cfg, p, flat)
            moe_out = _experts(params, p, norm("pre_feedforward_layernorm_2", flat), weights, index)
            moe_out = moe_out.reshape(residual.shape)
            h = norm("post_feedforward_layernorm_1", h) + norm("post_feedforward_layernorm_2", moe_out)
        x = residual + norm("post_feedforward_layernorm", h)
    if cfg.has_per_layer_inputs:
        gate = params[p + "per_layer_input_gate.weight"]
        if kernel and decode_mlp_jax.takes_per_layer_gate(gate, x.shape[0] * x.shape[1], x.dtype):
            gated, ctx["arrivals"] = decode_mlp_jax.per_layer_gated(x, gate, per_layer, spec.index, ctx["arrivals"])
        else:
            gated = _gelu(_linear(x, gate)) * per_layer[:, :, spec.index]
        if closes:
            return residual_norms(_split_product(gated, params[p + "per_layer_projection.weight"]), x,
                                  params[p + "post_per_layer_input_norm.weight"], next_norm, scale,
                                  prefetch=_read_ahead(*next_weights))
        x = x + norm("post_per_layer_input_norm", _linear(gated, params[p + "per_layer_projection.weight"]))
    if cfg.is_gemma4:
        x = x * scale
    return x, None


# -- the model --------------------------------------------------------------------------------------------


def _per_layer_inputs(params: Params, cfg: GemmaConfig, tokens, embeds, parts: Parts | None = None):
    B, T = tokens.shape
    p = cfg.hidden_size_per_layer_input
    dtype = embeds.dtype
    token_part = _lookup(params, cfg, "embed_tokens_per_layer.weight", tokens, parts) * jnp.asarray(p**0.5, dtype)
    token_part = token_part.reshape(B, T, cfg.num_layers, p)
    context = _linear(embeds, params["per_layer_model_projection.weight"]) * cfg.hidden_size**-0.5
    context = _rms_norm(context.reshape(B, T, cfg.num_layers, p), params["per_layer_projection_norm.weight"], cfg)
    return (context + token_part) * 2.0**-0.5


def _write_kv(cache: Cache, index: int, slots, k, v, heads: tuple[int, int] | None = None) -> None:
    """Decode: store layer `index`'s new keys (and values) [B, n_kv, T, hd] at their slots in the live cache (with
    `heads`, as its KV heads first..last)."""
    rows, slot = slots
    held = slice(None) if heads is None else slice(*heads)
    cache["keys"][index] = cache["keys"][index].at[rows, held, slot].set(k.transpose(0, 2, 1, 3), unique_indices=True)
    if v is not None:
        cache["values"][index] = cache["values"][index].at[rows, held, slot].set(v.transpose(0, 2, 1, 3),
                                                                                   unique_indices=True)


def _commit(cfg: GemmaConfig, cache: Cache, writes: dict, positions, x, counts=None) -> Cache:
    """Write this chunk's keys/values and positions into their slots (the last `slots` tokens when the
    chunk is longer than a ring); with `counts` [B], each row's first counts[b] tokens only.

    The slots are made to depend on the final hidden states x, which every read of the old cache feeds: XLA
    then orders the in-place writes after those reads instead of copying the whole cache to write it early.
    A row whose hidden states are not finite commits nothing (its slots point past the end and are dropped).
    """
    B, T = positions.shape
    rows = jnp.arange(B)[:, None]
    kept = jnp.isfinite(x).all(axis=(1, 2))[:, None]
    if counts is not None:
        if T > min(p.shape[1] for p in cache["slot_pos"].values()):
            raise ValueError(f"a chunk of {T} tokens with counts is longer than a ring: its last slots' tokens may "
                             "be pads")
        kept = kept & (jnp.arange(T) < counts[:, None])
    keys, values, slot_pos = list(cache["keys"]), list(cache["values"]), dict(cache["slot_pos"])
    for kind in KINDS:
        n = slot_pos[kind].shape[1]
        pos = positions[:, -n:]
        slot = jnp.where(kept[:, -n:], pos % n, n)
        scatter = dict(mode="drop", unique_indices=True)
        for index, (k, v) in writes.items():
            if cfg.layers[index].kind != kind:
                continue
            # [B, n_kv, T', hd] -> [B, T', n_kv, hd], the shape of cache[rows, :, slot]
            keys[index] = keys[index].at[rows, :, slot].set(k[:, :, -n:].transpose(0, 2, 1, 3), **scatter)
            if v is not None:
                values[index] = values[index].at[rows, :, slot].set(v[:, :, -n:].transpose(0, 2, 1, 3), **scatter)
        slot_pos[kind] = slot_pos[kind].at[rows, slot].set(pos, **scatter)
    return {"keys": keys, "values": values, "slot_pos": slot_pos}


def forward(
    params: Params,
    cfg: GemmaConfig,
    tokens,
    positions,
    cache: Cache,
    hidden_layers: tuple[int, ...] = (),
    last_only: bool = False,
    commit_first: bool = False,
    parts: Parts | None = None,
    head_barrier: bool = False,
    counts=None,
):
    """Run tokens [B, T] at positions [B, T] (contiguous per row) against the cache and commit them.
    Returns (float32 logits [B, T, V] ([B, 1, V] with last_only), the hidden states after `hidden_layers`
    [B, T, len(hidden_layers), H] or None, the new cache). `commit_first` runs it as a decode forward
    (module docstring); it needs T <= decode_width(k_max) of the cache's ring. `parts`: in tensor-parallel parts,
    inside shard_map (Parts); decode forwards only. `head_barrier`: final_logits' `barrier`. `counts` [B], a
    prefill forward's: each row commits its first counts[b] tokens and computes the rest (pads) without storing
    them, so pads take no slot (T at most the smallest cache's slots)."""
    if parts is not None and not commit_first:
        raise ValueError("a forward in tensor-parallel parts commits first (a decode forward)")
    if counts is not None and commit_first:
        raise ValueError("a decode forward commits every token first: counts are a prefill forward's")
    dtype = params["embed_tokens.weight"].dtype
    x = _lookup(params, cfg, "embed_tokens.weight", tokens, parts) * jnp.asarray(cfg.hidden_size**0.5, dtype)
    per_layer = _per_layer_inputs(params, cfg, tokens, x, parts) if cfg.has_per_layer_inputs else None
    if commit_first:  # a live copy: the layers write their slots into it as they go
        cache = {"keys": list(cache["keys"]), "values": list(cache["values"]), "slot_pos": dict(cache["slot_pos"])}
    ctx = _chunk_context(cfg, positions, cache, dtype, commit_first)
    shared_kv: dict = {}
    writes: dict = {}
    taps = {}
    normed = None  # x through the next layer's input norm, where a layer computed it
    for spec, after in itertools.zip_longest(cfg.layers, cfg.layers[1:]):
        next_norm = None if after is None else params[f"layers.{after.index}.input_layernorm.weight"]
        next_weights = () if after is None else _weights(params, f"layers.{after.index}.self_attn.",
                                                         _projections(after))
        x, normed = _decoder_layer(params, cfg, spec, x, per_layer, ctx, cache, shared_kv, writes, parts, normed,
                                   next_norm, next_weights)
        if spec.index in hidden_layers:
            taps[spec.index] = x
    new_cache = cache if commit_first else _commit(cfg, cache, writes, positions, x, counts)
    hidden = jnp.stack([taps[i] for i in hidden_layers], axis=2) if hidden_layers else None
    logits = final_logits(params, cfg, x[:, -1:] if last_only else x, parts=parts, barrier=head_barrier)
    return logits, hidden, new_cache


def final_logits(params: Params, cfg: GemmaConfig, hidden, vocab_ids=None, parts: Parts | None = None,
                 barrier: bool = False):
    """The model's output head: hidden [..., H] (the state after the last layer, before the final norm) ->
    float32 logits [..., V], or [..., len(vocab_ids)] over only those target ids (the LM head's rows gathered
    first, so a reduced vocabulary never materialises the full [..., V] logits). Final norm, LM head
    (tied to the embedding or not), final softcap: what `forward` returns. In `parts`, the head is one GEMM per
    vocabulary part, gathered in order.

    `barrier`: the head's product leaves through an optimization barrier, so that what reads the logits (a slice
    of their rows, an argmax) cannot change how XLA computes them, and a row's logits do not depend on their
    reader (the decode forwards' row invariance). The float32 cast and the softcap, elementwise, come after it:
    the cast then fuses into the reader, rather than writing every row's float32 logits (a 4 us kernel on the
    270M's decode forward)."""
    x = _rms_norm(hidden, params["norm.weight"], cfg)
    own_head = not cfg.tie_word_embeddings or is_fp8(params)  # a tied head's FP8 copy is its own
    head = params["lm_head.weight"] if own_head else params["embed_tokens.weight"]
    if vocab_ids is not None:
        head = jax.tree.map(lambda t: jnp.take(t, vocab_ids, axis=0), head)
    if parts is None:
        logits = _linear(x, head)
    else:
        size = head.shape[0] // parts.local
        per_part = [_rows(head, part * size, (part + 1) * size) for part in range(parts.local)]
        logits = jnp.concatenate([_linear(_own_input(x, part), rows) for part, rows in enumerate(per_part)], axis=-1)
        logits = jax.lax.all_gather(logits.astype(jnp.float32), parts.axis, axis=logits.ndim - 1, tiled=True)
    if barrier:
        logits = jax.lax.optimization_barrier(logits)
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits
