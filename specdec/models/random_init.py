"""Small random-weight Hugging Face checkpoints of every Gemma variant specdec supports, for tests.

transformers builds each model (so tensor names and config.json are exactly what it writes); every
parameter and buffer is then redrawn from a seeded generator, norms and scalars included, so that a
wrong offset or a skipped scale cannot hide behind an initial value of 0 or 1.
Needs the `dev` extra (transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 8  # tiny, so short test sequences run past the window and wrap the ring

_COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=WINDOW, max_position_embeddings=4096, rms_norm_eps=1e-6,
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "gemma3": dict(
        family="gemma3", num_hidden_layers=6, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        query_pre_attn_scalar=24, final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}},
    ),
    "gemma4_dense": dict(  # 31B-shaped: k_eq_v globals with their own head_dim and KV heads
        family="gemma4", num_hidden_layers=6, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
    ),
    "gemma4_e": dict(  # E2B/E4B-shaped: per-layer inputs, KV sharing, double-wide MLP on shared layers
        family="gemma4", num_hidden_layers=8, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, SLIDING, SLIDING, FULL],
        global_head_dim=32, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
        num_kv_shared_layers=3, use_double_wide_mlp=True, final_logit_softcapping=30.0,
    ),
    "gemma4_moe": dict(  # 26B-A4B-shaped: MoE block beside the dense MLP
        family="gemma4", num_hidden_layers=6, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
    ),
}
MULTIMODAL_VARIANT = "gemma4_multimodal"  # gemma4_dense saved as a multimodal checkpoint


def build_hf_model(variant: str, seed: int = 0, **overrides):
    """The transformers model of a variant (config fields `overrides` changed) with every tensor redrawn
    (fp32, eval mode)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig

    spec = {**_COMMON, **VARIANTS[variant], **overrides}  # overrides may change a common field too
    family = spec.pop("family")
    if family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**spec))
    else:
        model = Gemma4ForCausalLM(Gemma4TextConfig(**spec))
    # Gemma 3 norms scale by (1 + w): centre those at 0; Gemma 4 norms and scalars at 1.
    redraw(model, torch.Generator().manual_seed(seed), norm_centre=0.0 if family == "gemma3" else 1.0)
    return model.eval()


def redraw(model, gen, norm_centre: float = 1.0) -> None:
    """Every float parameter and buffer of a transformers model drawn anew: norm weights around
    `norm_centre`, scalars around 1, the rest N(0, 0.15^2); RoPE frequencies and embedding scales kept."""
    import torch

    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name or name.endswith("embed_scale"):
                continue
            if name.endswith("norm.weight") or name.endswith("layer_scalar") or name.endswith("scale"):
                centre = norm_centre if name.endswith("norm.weight") else 1.0
                t.copy_(centre + 0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(0.15 * torch.randn(t.shape, generator=gen))


def write_random_checkpoint(variant: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a variant (config fields `overrides` changed) as a HF directory; `gemma4_multimodal` writes
    gemma4_dense in the multimodal layout (`model.language_model.` names, a `gemma4` config wrapping
    `text_config`, and a vision tensor to ignore)."""
    out_dir = Path(out_dir)
    if variant == MULTIMODAL_VARIANT:
        return _write_multimodal(out_dir, seed)
    model = build_hf_model(variant, seed, **overrides)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _write_multimodal(out_dir: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    model = build_hf_model("gemma4_dense", seed)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        tensors["model.language_model." + name[len("model."):]] = t.contiguous()
    tensors["model.vision_tower.patch_embedder.input_proj.weight"] = torch.zeros(4, 4)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    text_config = model.config.to_dict()
    (out_dir / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text_config}, indent=2))
    return out_dir


def all_variants() -> list[str]:
    return [*VARIANTS, MULTIMODAL_VARIANT]


# -- Gemma 4 MTP assistants ---------------------------------------------------------------------------------

ASSISTANT_HIDDEN = 32
_ASSISTANT_SHAPES = ("num_key_value_heads", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v")


def assistant_buildable():
    """A context in which transformers can build a Gemma 4 assistant. transformers 5.23's
    Gemma4TextConfig.kv_sharing_modes raises when every layer is KV-shared (none is left to produce a
    cache of its kind), which every assistant is; inside, such a config reads 'reuse' for every layer, as
    the assistant's layers are (they read the target's KV states)."""
    import contextlib

    from transformers import Gemma4TextConfig

    if not hasattr(Gemma4TextConfig, "kv_sharing_modes"):  # older transformers (5.17) build assistants as they are
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def patched():
        original = Gemma4TextConfig.kv_sharing_modes

        def modes(config):
            if config.num_kv_shared_layers == config.num_hidden_layers:
                return ["reuse"] * config.num_hidden_layers
            return original.fget(config)

        Gemma4TextConfig.kv_sharing_modes = property(modes)
        try:
            yield
        finally:
            Gemma4TextConfig.kv_sharing_modes = original

    return patched()


def write_random_assistant(target_variant: str, out_dir: str | Path, seed: int = 0,
                           ordered_embeddings: bool = False) -> Path:
    """Write a transformers Gemma4AssistantForCausalLM drafting for a Gemma 4 variant: 2 layers (sliding,
    full) of hidden size 32 whose query heads fit the variant's KV layers; with `ordered_embeddings`, 32
    centroids of which 4 are kept and a seeded random token ordering. Every float tensor redrawn (`redraw`)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    target = VARIANTS[target_variant]
    if target["family"] != "gemma4":
        raise ValueError(f"assistants draft for Gemma 4 targets, not {target_variant}")
    shapes = {key: target[key] for key in _ASSISTANT_SHAPES if key in target}
    text = dict(_COMMON, hidden_size=ASSISTANT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                layer_types=[SLIDING, FULL], hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, **shapes)
    ordered = dict(num_centroids=32, centroid_intermediate_top_k=4) if ordered_embeddings else {}
    config = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text), backbone_hidden_size=_COMMON["hidden_size"],
                                   use_ordered_embeddings=ordered_embeddings, **ordered)
    with assistant_buildable():
        model = Gemma4AssistantForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    redraw(model, gen)
    if ordered_embeddings:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(_COMMON["vocab_size"], generator=gen))
    out_dir = Path(out_dir)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    return out_dir
