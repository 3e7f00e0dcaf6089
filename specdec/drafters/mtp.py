"""Gemma 4 MTP assistants (transformers' `Gemma4AssistantForCausalLM`): the assistant's config, its checkpoint,
and the checks that it fits a target. The math is written once per framework: `mtp_torch` (drafting in the
PyTorch engine) and `mtp_jax` (drafting in the JAX engine).

The assistant is a few Gemma 4 decoder layers that own no KV cache: each layer projects queries only and
attends to the TARGET's keys/values, those of the target's last cache-owning layer of the same kind (sliding /
full; `target_kv_layers`). One draft step, for a row whose pending token t sits at position p:
  x      = pre_projection([target embedding of t, scaled by sqrt(H_target) || h])       (2 H_target -> H)
  x      = the assistant's decoder layers on x: q_proj, q_norm, RoPE at p (the assistant's own RoPE), attention
           (scale 1.0, query heads grouped over the target layer's KV heads), o_proj; the usual Gemma 4 norms,
           MLP and layer_scalar; no per-layer inputs, no MoE
  normed = the assistant's final norm of x
  logits = lm_head(normed) (lm_head tied to the assistant's own embed_tokens unless tie_word_embeddings is
           off), or with `use_ordered_embeddings` the centroid-masked head: only the tokens of the top-k
           centroids get real logits, the rest a fill below them; no final softcapping (transformers has none)
  h'     = post_projection(normed), the h of the next step
The first step's h is the target's final-normed hidden state at position p-1; the engines return the states
after layer L-1 before the final norm (`mtp_taps`), and the assistant applies the target's final norm itself.
Every draft step of a cycle runs at the same position p and sees the same target keys/values (as
transformers' SinglePositionMultiTokenCandidateGenerator drives it).

Semantics in our engines. A row has positions 0..n-1 committed in the target's cache and its pending token
(emitted, not in the cache) at p = n. The cache may hold junk at slots of positions >= n (rejected drafts, pad
rows), so the assistant's masks come from the stored slot positions: full layers see the stored positions s
with 0 <= s <= p-1, sliding layers those with p-window <= s <= p-1 (window: the assistant's sliding_window),
exactly what the target's own query at p-1 sees. (transformers' flipped bidirectional sliding mask takes one
more position at the far edge, and its slicing of the shared KV states is only well defined in the first
round after prefill, where the two agree whenever the context fits the window.) The assistant never writes
the target's cache. On k_eq_v target layers the cache stores V (the normed raw K) and K is rebuilt from it
as the target does: RoPE(target k_norm.weight * stored) at the stored positions, with the target's RoPE.

After a verify from `start` (the old pending position) whose first `count` rows were kept, the new pending
token is emitted[count-1] at start + count, and h comes from the verify's hidden row count-1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError
from specdec.models.config import GemmaConfig

MODEL_TYPE = "gemma4_assistant"
# Weights transformers may store for the assistant's KV-shared layers, which never use them.
_SHARED_LAYER_UNUSED = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight",
                        "self_attn.v_norm.weight")


def mtp_taps(target_cfg: GemmaConfig) -> tuple[int, ...]:
    """The engines' hidden_layers an assistant drafts from: the state after the last layer (before the
    final norm, which the assistant applies)."""
    return (target_cfg.num_layers - 1,)


def target_kv_layers(target_cfg: GemmaConfig) -> dict[str, int]:
    """kind -> the target layer whose cache the assistant's layers of that kind read: the last layer of the
    kind that owns a cache (transformers' "store" layers)."""
    return {spec.kind: spec.index for spec in target_cfg.layers if spec.owns_cache}


@dataclass(frozen=True)
class AssistantConfig:
    text: GemmaConfig  # the assistant's decoder, read as a Gemma 4 text model whose layers own no cache
    backbone_hidden_size: int  # the target's hidden size
    use_ordered_embeddings: bool = False
    num_centroids: int = 0
    centroid_intermediate_top_k: int = 0
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "AssistantConfig":
        if raw.get("model_type") != MODEL_TYPE:
            raise SpecdecError(f"{source}: model_type {raw.get('model_type')!r} is not a Gemma 4 assistant "
                               f"({MODEL_TYPE!r})")
        if not isinstance(raw.get("text_config"), dict):
            raise SpecdecError(f"{source}: a Gemma 4 assistant needs a 'text_config'")
        # Every layer of an assistant is KV-shared with the target; our parser needs a producer per kind,
        # and the layers' own KV shapes are not read, so it reads them as owning one.
        text = GemmaConfig.from_dict(dict(raw["text_config"], num_kv_shared_layers=0, model_type="gemma4_text"),
                                     source)
        for what in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
            if getattr(text, what):
                raise SpecdecError(f"{source}: a Gemma 4 assistant has no {what} (got {getattr(text, what)})")
        try:
            cfg = cls(text=text, backbone_hidden_size=int(raw["backbone_hidden_size"]),
                      use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
                      num_centroids=int(raw.get("num_centroids") or 0),
                      centroid_intermediate_top_k=int(raw.get("centroid_intermediate_top_k") or 0),
                      tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
        except KeyError as e:
            raise SpecdecError(f"{source}: missing field {e.args[0]!r}") from None
        if cfg.use_ordered_embeddings:
            c, k = cfg.num_centroids, cfg.centroid_intermediate_top_k
            if c <= 0 or text.vocab_size % c:
                raise SpecdecError(f"{source}: {c} centroids do not divide the vocabulary of {text.vocab_size}")
            if not 0 < k <= c:
                raise SpecdecError(f"{source}: centroid_intermediate_top_k {k} outside 1..{c}")
        return cfg

    @property
    def head_name(self) -> str:
        """The LM head's tensor: tied to the assistant's own embedding unless tie_word_embeddings is off."""
        return "embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every float tensor the assistant needs, under the stripped names (`model.` removed), with its shape."""
        t, h, hb = self.text, self.text.hidden_size, self.backbone_hidden_size
        shapes = {self.head_name: (t.vocab_size, h), "norm.weight": (h,),
                  "pre_projection.weight": (h, 2 * hb), "post_projection.weight": (hb, h)}
        for spec in t.layers:
            p, q = f"layers.{spec.index}.", t.num_heads * spec.head_dim
            for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                shapes[p + norm + ".weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.q_norm.weight"] = (spec.head_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
            shapes[p + "layer_scalar"] = (1,)
        if self.use_ordered_embeddings:
            shapes["masked_embedding.centroids.weight"] = (self.num_centroids, h)
        return shapes


@dataclass
class Assistant:
    cfg: AssistantConfig
    params: dict  # numpy float32 arrays under cfg.shapes()'s names
    token_ordering: np.ndarray | None  # [V] int64 (use_ordered_embeddings): centroid c's tokens at c*V/C..(c+1)*V/C-1
    path: Path | None = field(default=None, compare=False)

    def check_target(self, target_cfg: GemmaConfig, source: str) -> None:
        """Refuse a target the assistant cannot draft for, naming what differs."""
        cfg, text = self.cfg, self.cfg.text
        if cfg.backbone_hidden_size != target_cfg.hidden_size:
            raise SpecdecError(f"{source}: assistant made for a target of hidden size {cfg.backbone_hidden_size}, "
                               f"this target has {target_cfg.hidden_size}")
        if text.vocab_size != target_cfg.vocab_size:
            raise SpecdecError(f"{source}: assistant vocabulary of {text.vocab_size} tokens, the target's has "
                               f"{target_cfg.vocab_size}")
        producers = target_kv_layers(target_cfg)
        for spec in text.layers:
            if spec.kind not in producers:
                raise SpecdecError(f"{source}: assistant layer {spec.index} attends to {spec.kind} keys, "
                                   "the target has none")
            theirs = target_cfg.layers[producers[spec.kind]]
            if spec.head_dim != theirs.head_dim:
                raise SpecdecError(f"{source}: assistant layer {spec.index} has head_dim {spec.head_dim}, the target's "
                                   f"{spec.kind} layer {theirs.index} {theirs.head_dim}")
            if text.num_heads % theirs.num_kv_heads:
                raise SpecdecError(f"{source}: the assistant's {text.num_heads} heads are not a multiple of the "
                                   f"{theirs.num_kv_heads} KV heads of the target's {spec.kind} layer {theirs.index}")
        if any(s.kind == "sliding_attention" for s in text.layers) and text.sliding_window > target_cfg.sliding_window:
            raise SpecdecError(f"{source}: assistant window of {text.sliding_window} positions, wider than the "
                               f"target's {target_cfg.sliding_window} (its cache keeps no more)")


def load_assistant(path: str | Path) -> Assistant:
    """Read an assistant directory as transformers saves it (config.json of model_type gemma4_assistant;
    model.safetensors or shards with an index), in float32 whatever the stored dtype. Every expected tensor's
    name and shape is checked; the unused K/V weights of shared layers, and lm_head when tied, are ignored."""
    from specdec.models.checkpoint import _shard_files, numpy_views

    directory = Path(path)
    config_file = directory / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise SpecdecError(f"{directory}: not a Gemma 4 assistant directory (no config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"{config_file}: unreadable config ({e})") from None
    cfg = AssistantConfig.from_dict(raw, str(config_file))
    files = {_strip(name): (name, file) for name, file in _shard_files(directory).items()}
    expected = cfg.shapes()
    if cfg.use_ordered_embeddings:
        expected["masked_embedding.token_ordering"] = (cfg.text.vocab_size,)
    for name in files:
        if name not in expected and not _ignored(name):
            stored, file = files[name]
            raise SpecdecError(f"{file}: unexpected tensor {stored!r} for this config")
    tensors, views = {}, {}
    for name, shape in expected.items():
        if name not in files:
            raise SpecdecError(f"{directory}: missing tensor {_stored_name(name)!r}")
        stored, file = files[name]
        if file not in views:
            views[file] = numpy_views(file)
        tensor = views[file][stored]
        if tuple(tensor.shape) != shape:
            raise SpecdecError(f"{file}: tensor {stored!r} has shape {tuple(tensor.shape)}, config expects {shape}")
        tensors[name] = tensor
    ordering = None
    if cfg.use_ordered_embeddings:
        ordering = tensors.pop("masked_embedding.token_ordering").astype(np.int64)
        if not np.array_equal(np.sort(ordering), np.arange(cfg.text.vocab_size)):
            stored, file = files["masked_embedding.token_ordering"]
            raise SpecdecError(f"{file}: tensor {stored!r} is not a permutation of the vocabulary")
    params = {name: t.astype(np.float32) for name, t in tensors.items()}
    return Assistant(cfg, params, ordering, directory)


def _strip(stored: str) -> str:
    return stored.removeprefix("model.")


def _stored_name(name: str) -> str:
    """The name transformers stores a stripped name under (the decoder's tensors sit under `model.`)."""
    top_level = name.startswith(("lm_head.", "pre_projection.", "post_projection.", "masked_embedding."))
    return name if top_level else "model." + name


def _ignored(name: str) -> bool:
    """Tensors transformers may save that the assistant never reads."""
    if name in ("lm_head.weight", "embed_tokens.weight"):  # whichever is not the head
        return True
    layer = name.removeprefix("layers.")
    return layer != name and layer.split(".", 1)[-1] in _SHARED_LAYER_UNUSED
