"""GemmaConfig: the text model of a Gemma 3 / Gemma 4 checkpoint, read from its Hugging Face config.json.

Everything both frameworks need to build the model is resolved here once (per-layer head sizes, which
layer owns which KV cache, RoPE tables' parameters), so gemma_torch and gemma_jax share one spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from specdec.errors import SpecdecError
from specdec.models.decode_plan import whole_splits

SLIDING = "sliding_attention"
FULL = "full_attention"
SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma4_text", "gemma4")


ROW_MULTIPLE = 8


def decode_width(k_max: int) -> int:
    """Rows of every decode forward of an engine with drafts of up to k_max tokens: k_max + 1, rounded up
    to a multiple of 8. One fixed width makes each row's arithmetic independent of how many real tokens
    the forward holds; the multiple of 8 keeps every row on the same path of the matmul kernels (fp32 CPU
    GEMMs compute the last row of a 9-row product differently from the others)."""
    return round_up(k_max + 1, ROW_MULTIPLE)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Tensor parallelism, one spec for both engines: which dimension of which weight splits over the devices.
COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")
ROW_PARALLEL = ("o_proj.weight", "mlp.down_proj.weight")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def vocab_rows(cfg: "GemmaConfig", name: str) -> int | None:
    """The vocabulary a token table indexes: the embedding (and the LM head: its rows are the logits), the
    per-layer input embedding; None for other tensors."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return cfg.vocab_size
    if name == "embed_tokens_per_layer.weight":
        return cfg.vocab_size_per_layer_input
    return None


def tp_split_axis(cfg: "GemmaConfig", name: str, tp: int) -> int | None:
    """The dimension of checkpoint tensor `name` that tensor parallelism over `tp` devices splits: heads and
    MLP columns by output row (0); o_proj and down_proj by input column (1), so each device's partial output
    is summed across devices; token tables (embeddings, the LM head) by vocabulary row (0) when the
    vocabulary divides, so each device reads its share of the LM head's bytes per step (lookups are summed
    across devices, logits gathered); MoE experts by expert (0) when they divide; None (whole on every
    device) for the rest: norms, the per-layer input projection, the router."""
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    vocab = vocab_rows(cfg, name)
    if vocab is not None:
        return 0 if vocab % tp == 0 else None
    if name.endswith(EXPERTS) and cfg.num_experts % tp == 0:
        return 0
    return None


def check_tensor_parallel(cfg: "GemmaConfig", tp: int, splitter: str | None = None) -> None:
    """Every split dimension must divide evenly over `tp` devices: one line naming what does not, after `splitter`
    (default: the mesh of `tp` devices; gemma_torch's parts name themselves)."""
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"{cfg.num_heads} attention heads")
    for spec in cfg.layers:
        if spec.owns_cache and spec.num_kv_heads % tp:
            problems.append(f"{spec.num_kv_heads} KV heads of layer {spec.index}")
        if spec.intermediate_size % tp:
            problems.append(f"MLP width {spec.intermediate_size} of layer {spec.index}")
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        splitter = splitter or f"a tensor-parallel mesh of {tp} devices does not divide"
        raise SpecdecError(f"{splitter} {problems[0]}{more}")


def check_tp_parts(cfg: "GemmaConfig", parts: int, devices: int) -> None:
    """Tensor-parallel parts (gemma_torch.GemmaModel's and verifier_jax.JaxEngine's `tp_parts`). In bf16 a split
    changes the arithmetic: a row-parallel linear's halves are rounded before they are added, and a GEMM of half the
    width may be tiled or split differently by the GEMM library, so 2 devices do not emit the greedy tokens 1 device
    emits. With `parts` P, every split weight (heads, MLP columns, the LM head's vocabulary) is computed as P GEMMs
    of a P-way split's shapes on any device count N that divides P, each device running P / N of them, and the
    row-parallel partial outputs are added in one fixed order (sum_parts). Every N then runs the same GEMMs on the
    same operands. Compiled, each engine also keeps the roundings its compiler could drop where its fused kernels end
    at other places on 1 and N devices (torch: verifier_torch._configure_compile; JAX: sum_parts rounds each partial
    explicitly). It costs more launches (P / N GEMMs where there was one) and a gather of the partial outputs in
    place of an all-reduce. One line for what cannot be split so."""
    if parts < 1 or parts % devices:
        raise SpecdecError(f"tensor-parallel parts must be a positive multiple of the {devices} device(s), got {parts}")
    if cfg.enable_moe_block:
        raise SpecdecError("tensor-parallel parts do not cover MoE experts (their outputs are summed per device)")
    if cfg.vocab_size % parts:
        raise SpecdecError(f"{parts} tensor-parallel parts do not divide the vocabulary of {cfg.vocab_size}")
    check_tensor_parallel(cfg, parts, f"{parts} tensor-parallel parts do not divide")


# JAX on GPUs: XLA times candidate algorithms for each GEMM of a program and keeps the fastest, and picked another
# for a part's product on 1 H200 than on 2: other logits. With no timing (autotune level 0) it picks by shape, and 1
# and 2 H200s computed the same bits, but its untimed Triton GEMMs made the 2-GPU step 3.7x slower; with cuBLAS for
# every GEMM as well, 1 and 2 H200s computed the same bits at 1.05x the step without parts (docs/journal,
# issue 11). XLA reads them when JAX starts.
PARTS_GPU_XLA_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=false")


def with_parts_xla_flags(xla_flags: str) -> str:
    """XLA_FLAGS with PARTS_GPU_XLA_FLAGS, which JAX in tensor-parallel parts needs on GPUs, each once."""
    given = xla_flags.split()
    return " ".join(given + [flag for flag in PARTS_GPU_XLA_FLAGS if flag not in given])


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"  # default | linear | proportional
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer looks like, resolved from the config."""

    index: int
    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # no v_proj: V is the parameter-free RMS norm of the raw K projection
    kv_source: int  # layer whose cache this layer reads (itself unless KV-shared)
    intermediate_size: int

    @property
    def owns_cache(self) -> bool:
        return self.kv_source == self.index


@dataclass(frozen=True)
class GemmaConfig:
    model_type: str  # gemma3_text | gemma4_text (a gemma4 checkpoint reads as its text_config)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict[str, RopeSpec]
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    # Gemma 4
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    layers: tuple[LayerSpec, ...] = field(default=(), compare=False)

    @property
    def is_gemma4(self) -> bool:
        return self.model_type == "gemma4_text"

    @property
    def norm_weight_offset(self) -> float:
        """Gemma 3 RMSNorm scales by (1 + w); Gemma 4 by w."""
        return 0.0 if self.is_gemma4 else 1.0

    @property
    def attention_scale(self) -> float:
        if self.is_gemma4:
            return 1.0
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def has_per_layer_inputs(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    def layer(self, i: int) -> LayerSpec:
        return self.layers[i]

    def kind_head_dim(self, kind: str) -> int:
        """head_dim of the layers of a kind (Gemma 4's full layers have their own)."""
        return next((s.head_dim for s in self.layers if s.kind == kind), self.head_dim)

    def cache_slots(self, max_seq_len: int, k_max: int, lookahead: int = 0) -> dict[str, int]:
        """KV-cache slots per layer kind: full layers hold every position; sliding layers a ring of
        window + decode_width(k_max) - 1, so neither a rejected draft nor a pad row written past the
        committed length overwrites a position still inside a query's window (docs/design.md, "Rules that keep
        it lossless"). `lookahead` more slots for a cache whose decode forwards chain that many positions
        past the committed length before it catches up (a model drafter's draft steps).

        Both are rounded up to whole splits of the decode attention's blocks (decode_plan.whole_splits), a
        multiple of 64: the JAX engine's attention kernels take no other cache (at 333 slots the 270M's JAX
        cycle ran XLA's attention, 0.600 ms against 0.527 at 384, H200); rows of a multiple of 8 slots are
        16-byte aligned, as cuBLAS's fast kernels need (a 527-slot ring ran the 270M's attention products on an
        sm75 fallback, ~6 us each, H200); and XLA split the value product's reduction over a ring in chunks of
        a multiple of 8, padding a 528-slot one to 576 twice a sliding layer and step (H100)."""
        full = whole_splits(max_seq_len)
        ring = whole_splits(self.sliding_window + decode_width(k_max) - 1 + lookahead)
        return {FULL: full, SLIDING: min(ring, full)}

    def kv_cache_shapes(self, batch: int, max_seq_len: int, k_max: int,
                        lookahead: int = 0) -> list[tuple[tuple[int, ...], bool] | None]:
        """Per layer: the shape [B, n_kv, slots, head_dim] of its keys and whether it stores values too
        (not for k_eq_v layers, whose one tensor is V); None for KV-shared layers, which own no cache."""
        slots = self.cache_slots(max_seq_len, k_max, lookahead)
        return [
            ((batch, s.num_kv_heads, slots[s.kind], s.head_dim), not s.k_eq_v) if s.owns_cache else None
            for s in self.layers
        ]

    def check_cache_fits(self, batch: int, max_seq_len: int, k_max: int, itemsize: int, free_bytes: int | None,
                         where: str, lookahead: int = 0) -> None:
        """Refuse, in one line, a KV cache (kv_cache_shapes at `itemsize` bytes an element) larger than the memory
        free where it goes, before the allocator fails with a traceback; free_bytes None: unknown, not checked."""
        need = sum(int(np.prod(shape)) * (2 if values else 1) * itemsize
                   for shape, values in filter(None, self.kv_cache_shapes(batch, max_seq_len, k_max, lookahead)))
        if free_bytes is not None and need > free_bytes:
            raise SpecdecError(
                f"a KV cache of {batch} rows x {max_seq_len} positions needs {need / 2**30:.1f} GiB, but {where} has "
                f"{free_bytes / 2**30:.1f} GiB free: ask for fewer rows (--max-num-seqs, --batch) or a shorter "
                "context (--max-model-len, --max-seq-len)")

    def shard(self, tp: int) -> "GemmaConfig":
        """The config one of `tp` tensor-parallel devices builds: its share of the attention heads, KV heads
        and MLP columns (tp_split_axis says which slice of each weight it holds); the rest is whole."""
        check_tensor_parallel(self, tp)
        layers = tuple(replace(s, num_kv_heads=s.num_kv_heads // tp, intermediate_size=s.intermediate_size // tp)
                       for s in self.layers)
        return replace(self, num_heads=self.num_heads // tp, num_kv_heads=self.num_kv_heads // tp,
                       num_global_kv_heads=self.num_global_kv_heads and self.num_global_kv_heads // tp,
                       intermediate_size=self.intermediate_size // tp, layers=layers)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "GemmaConfig":
        if not isinstance(raw, dict):
            raise SpecdecError(f"{source}: not a JSON object of settings (a {type(raw).__name__})")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise SpecdecError(
                f"{source}: unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if model_type == "gemma4":
            if not isinstance(raw.get("text_config"), dict):
                raise SpecdecError(f"{source}: model_type 'gemma4' needs a 'text_config' object")
            raw = dict(raw["text_config"], model_type="gemma4_text")
            model_type = "gemma4_text"
        for key in _INTEGER_FIELDS:
            value = raw.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or isinstance(value, float) and not value.is_integer()):
                raise SpecdecError(f"{source}: {key} must be an integer, got {value!r}")
        try:
            return _parse(raw, model_type, source)
        except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong kind deeper in, e.g. a rope entry
            raise SpecdecError(f"{source}: malformed config ({e})") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "GemmaConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecdecError(f"{path}: no config.json") from None
        except (OSError, json.JSONDecodeError) as e:
            raise SpecdecError(f"{path}: unreadable config ({e})") from None
        return cls.from_dict(raw, str(path))


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """float32 inverse frequencies over head_dim/2 pairs (rotate-half layout). Proportional RoPE rotates
    the first partial_rotary_factor of the pairs, with frequencies taken over the full head_dim, and
    leaves the rest."""
    f32 = np.float32
    rotated = int(spec.partial_rotary_factor * head_dim // 2) if spec.rope_type == "proportional" else head_dim // 2
    exponents = np.arange(0, 2 * rotated, 2).astype(f32) / f32(head_dim)
    inv = (f32(1.0) / (f32(spec.theta) ** exponents)).astype(f32)
    inv = np.concatenate([inv, np.zeros(head_dim // 2 - rotated, f32)])
    return (inv / f32(spec.factor)).astype(f32)


# Read as integers: a value of another kind is refused by name rather than failing where it is used.
_INTEGER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "sliding_window", "sliding_window_pattern",
                   "max_position_embeddings", "bos_token_id", "pad_token_id", "num_kv_shared_layers",
                   "hidden_size_per_layer_input", "vocab_size_per_layer_input", "num_experts", "top_k_experts",
                   "moe_intermediate_size")


def _required(raw: dict, key: str, source: str):
    if raw.get(key) is None:
        raise SpecdecError(f"{source}: missing field {key!r}")
    return raw[key]


def _rope_specs(raw: dict, model_type: str, source: str) -> dict[str, RopeSpec]:
    params = raw.get("rope_parameters")
    if params is None:  # older Gemma 3 configs: rope_theta + rope_local_base_freq + rope_scaling
        full = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 1_000_000.0)}
        if raw.get("rope_scaling"):
            full.update(raw["rope_scaling"])
        params = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10_000.0)}}
        if model_type == "gemma4_text":
            params = {
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
            }
    specs = {}
    for kind in (SLIDING, FULL):
        p = params.get(kind)
        if p is None:
            raise SpecdecError(f"{source}: rope_parameters has no {kind!r}")
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "linear", "proportional"):
            raise SpecdecError(f"{source}: unsupported rope_type {rope_type!r} for {kind}")
        specs[kind] = RopeSpec(
            theta=float(_required(p, "rope_theta", f"{source} rope_parameters.{kind}")),
            rope_type=rope_type,
            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)),
            factor=float(p.get("factor", 1.0)),
        )
    return specs


def _global_overrides(raw: dict, layer_types: list[str]) -> tuple[int | None, int | None]:
    """Full-attention layers' head_dim and KV heads: `global_head_dim` / `num_global_key_value_heads` as in
    released checkpoints, or the `per_layer_config` that transformers writes when it saves a config."""
    per_layer = raw.get("per_layer_config")
    if per_layer:
        first_full = layer_types.index(FULL)
        entry = per_layer.get(str(first_full), per_layer.get(first_full, {}))
        return entry.get("head_dim"), entry.get("num_key_value_heads")
    global_kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
    return raw.get("global_head_dim", 512), global_kv


def _kv_sources(layer_types: list[str], num_shared: int, source: str) -> list[int]:
    """KV-shared layers (the last `num_shared`) read the cache of the last non-shared layer of their kind."""
    n = len(layer_types)
    first_shared = n - num_shared
    sources = list(range(n))
    for i in range(first_shared, n):
        producers = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
        if not producers:
            raise SpecdecError(f"{source}: KV-shared layer {i} ({layer_types[i]}) has no earlier layer of its kind")
        sources[i] = producers[-1]
    return sources


def _parse(raw: dict, model_type: str, source: str) -> GemmaConfig:
    req = lambda key: _required(raw, key, source)  # noqa: E731
    num_layers = int(req("num_hidden_layers"))
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise SpecdecError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    for t in layer_types:
        if t not in (SLIDING, FULL):
            raise SpecdecError(f"{source}: unsupported layer type {t!r}")

    eos = raw.get("eos_token_id", 1)
    eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
    is4 = model_type == "gemma4_text"
    head_dim = int(req("head_dim"))
    num_kv_heads = int(req("num_key_value_heads"))
    intermediate = int(req("intermediate_size"))

    kwargs: dict[str, Any] = {}
    global_head_dim = global_kv_heads = None
    k_eq_v = False
    num_shared = 0
    if is4:
        if FULL in layer_types:
            global_head_dim, global_kv_heads = _global_overrides(raw, layer_types)
        k_eq_v = bool(raw.get("attention_k_eq_v", False))
        num_shared = int(raw.get("num_kv_shared_layers") or 0)
        moe = bool(raw.get("enable_moe_block", False))
        kwargs.update(
            global_head_dim=global_head_dim,
            num_global_kv_heads=global_kv_heads,
            attention_k_eq_v=k_eq_v,
            hidden_size_per_layer_input=int(raw.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=int(raw.get("vocab_size_per_layer_input") or 0),
            num_kv_shared_layers=num_shared,
            use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
            enable_moe_block=moe,
        )
        if moe:
            kwargs.update(
                num_experts=int(req("num_experts")),
                top_k_experts=int(req("top_k_experts")),
                moe_intermediate_size=int(req("moe_intermediate_size")),
            )
    else:
        kwargs.update(
            query_pre_attn_scalar=float(req("query_pre_attn_scalar")),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        )

    sources = _kv_sources(layer_types, num_shared, source)
    layers = []
    for i, kind in enumerate(layer_types):
        is_full = kind == FULL
        shared = sources[i] != i
        layers.append(
            LayerSpec(
                index=i,
                kind=kind,
                head_dim=int(global_head_dim) if (is4 and is_full and global_head_dim) else head_dim,
                num_kv_heads=int(global_kv_heads) if (is4 and is_full and global_kv_heads) else num_kv_heads,
                k_eq_v=k_eq_v and is_full,
                kv_source=sources[i],
                intermediate_size=intermediate * (2 if is4 and shared and kwargs["use_double_wide_mlp"] else 1),
            )
        )

    return GemmaConfig(
        model_type=model_type,
        vocab_size=int(req("vocab_size")),
        hidden_size=int(req("hidden_size")),
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=int(req("num_attention_heads")),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        sliding_window=int(req("sliding_window")),
        rope=_rope_specs(raw, model_type, source),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        hidden_activation=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
        bos_token_id=int(raw.get("bos_token_id", 2)),
        eos_token_ids=eos,
        pad_token_id=int(raw.get("pad_token_id") or 0),
        layers=tuple(layers),
        **kwargs,
    )
