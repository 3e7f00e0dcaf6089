"""The Gemma 4 MTP assistant in JAX (semantics in specdec.drafters.mtp; the same math as mtp_torch): pure
functions over a dict of arrays under the stripped checkpoint names, reading the target's KV cache, built
from gemma_jax's norms, MLP and RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specdec.drafters.mtp import AssistantConfig, target_kv_layers
from specdec.drafters.stateful import JaxHostDriven
from specdec.models.config import SLIDING, GemmaConfig, rope_inv_freq
from specdec.models.gemma_jax import _apply_rope, _keys_from_stored, _linear, _mlp, _rms_norm, _rope_cos_sin

Params = dict
MASKED = float(np.finfo(np.float32).min)  # not -inf: a row with nothing to attend to (no hidden yet) stays finite


def target_embed(target_params, target_cfg: GemmaConfig, tokens):
    """The target's scaled token embeddings (what its forward feeds its first layer)."""
    table = target_params["embed_tokens.weight"]
    return jnp.take(table, tokens, axis=0) * jnp.asarray(target_cfg.hidden_size**0.5, table.dtype)


def target_kv(target_params, target_cfg: GemmaConfig, cache, kind: str, layer: int):
    """The keys and values [B, n_kv, S, hd] of the target's layer `layer` and the positions its slots hold [B, S].
    k_eq_v layers store V only; K is rebuilt as the target rebuilds it, with the target's RoPE."""
    keys, values, stored = cache["keys"][layer], cache["values"][layer], cache["slot_pos"][kind]
    if values is None:
        inv_freq = rope_inv_freq(target_cfg.rope[kind], target_cfg.layers[layer].head_dim)
        cos, sin = _rope_cos_sin(inv_freq, jnp.maximum(stored, 0), keys.dtype)
        k_norm = target_params[f"layers.{layer}.self_attn.k_norm.weight"]
        keys, values = _keys_from_stored(keys, k_norm, cos[:, None], sin[:, None]), keys
    return keys, values, stored


def visible(stored, position, window: int | None):
    """[B, S] bool: the stored positions a query at `position` [B] attends to: before it, and on sliding layers
    within the window the target's own query at position - 1 sees."""
    mask = (stored >= 0) & (stored < position[:, None])
    if window is not None:
        mask = mask & (stored >= position[:, None] - window)
    return mask


def _attention(params: Params, cfg: AssistantConfig, index: int, x, cos, sin, keys, values, mask):
    """x [B, H] -> the layer's attention output [B, H]: queries at the row's position over the target's keys."""
    text, spec = cfg.text, cfg.text.layers[index]
    p = f"layers.{index}.self_attn."
    B, hd, nkv = x.shape[0], spec.head_dim, keys.shape[1]
    q = _linear(x, params[p + "q_proj.weight"]).reshape(B, text.num_heads, hd)
    q = _apply_rope(_rms_norm(q, params[p + "q_norm.weight"], text), cos[:, None], sin[:, None])
    q = q.reshape(B, nkv, text.num_heads // nkv, hd)  # query head h uses KV head h // groups
    scores = jnp.einsum("bkgd,bksd->bkgs", q, keys).astype(jnp.float32)  # Gemma 4 attention scale: 1
    scores = jnp.where(mask[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, values).reshape(B, text.num_heads * hd)
    return _linear(out, params[p + "o_proj.weight"])


def _layer(params: Params, cfg: AssistantConfig, index: int, x, cos, sin, keys, values, mask):
    p = f"layers.{index}."
    norm = lambda name, v: _rms_norm(v, params[p + name + ".weight"], cfg.text)  # noqa: E731
    x = x + norm("post_attention_layernorm", _attention(params, cfg, index, norm("input_layernorm", x), cos, sin,
                                                        keys, values, mask))
    x = x + norm("post_feedforward_layernorm", _mlp(params, p + "mlp.", norm("pre_feedforward_layernorm", x)))
    return x * params[p + "layer_scalar"]


def head_logits(params: Params, cfg: AssistantConfig, normed):
    """The assistant's LM head over its final-normed state [B, H] -> float32 logits [B, V]. With ordered
    embeddings only the tokens of the top-k centroids get real logits; the others get the lowest of those
    minus 1. transformers takes that minimum over the whole batch; here it is per row, so a row's logits do
    not depend on the other rows (the same at batch 1)."""
    head = params[cfg.head_name]
    if not cfg.use_ordered_embeddings:
        return _linear(normed, head).astype(jnp.float32)
    centroid_logits = _linear(normed, params["masked_embedding.centroids.weight"])
    _, top = jax.lax.top_k(centroid_logits, cfg.centroid_intermediate_top_k)
    tokens = params["token_ordering"][top].reshape(normed.shape[0], -1)  # [B, top_k * V / C]
    selected = jnp.einsum("bh,bnh->bn", normed, head[tokens]).astype(jnp.float32)
    fill = selected.min(axis=-1, keepdims=True) - 1.0
    rows = jnp.arange(normed.shape[0])[:, None]
    return jnp.broadcast_to(fill, (normed.shape[0], cfg.text.vocab_size)).at[rows, tokens].set(selected)


def step(params: Params, cfg: AssistantConfig, embeds, hidden, rope: dict, kv: dict):
    """One draft step of every row: the target's scaled token embeddings and h [B, H_target], the queries'
    RoPE rows per kind (cos, sin [B, hd]), the target's (keys, values, mask) per kind. -> (float32 logits [B, V],
    the next step's h [B, H_target])."""
    x = _linear(jnp.concatenate([embeds, hidden], axis=-1), params["pre_projection.weight"])
    for spec in cfg.text.layers:
        x = _layer(params, cfg, spec.index, x, *rope[spec.kind], *kv[spec.kind])
    normed = _rms_norm(x, params["norm.weight"], cfg.text)
    return head_logits(params, cfg, normed), _linear(normed, params["post_projection.weight"])


class JaxMtp(JaxHostDriven):
    """The assistant drafting inside the JAX engine's decode loop (the torch twin: mtp_torch.TorchMtp, whose
    docstring describes the per-row state). `draft` and `observe` are pure functions of (the target's params,
    the assistant's params, its state; `draft` also of the target's cache), so the loop carries the state and
    jit takes the params as arguments. `begin`, `host_draft` and `host_observe` keep a state on the object for
    the host-driven cycle."""

    def __init__(self, assistant, target_cfg: GemmaConfig, batch: int, k: int, sampling=None, dtype=jnp.float32):
        from specdec.sampling import SamplingParams

        assistant.check_target(target_cfg, str(assistant.path))
        self.cfg, self.target_cfg, self.k, self.batch, self.dtype = assistant.cfg, target_cfg, k, batch, dtype
        self.sampling = sampling or SamplingParams()
        self.kv_layers = target_kv_layers(target_cfg)
        self.params = {n: jnp.asarray(a, dtype) for n, a in assistant.params.items()}
        if assistant.token_ordering is not None:
            ordering = assistant.token_ordering.reshape(self.cfg.num_centroids, -1)
            self.params["token_ordering"] = jnp.asarray(ordering, jnp.int32)

    @property
    def cache_key(self):
        """Equal for drafters whose compiled programs are interchangeable (the engine shares them). The configs
        hold dicts (not hashable): their reprs stand for them."""
        import dataclasses

        return ("mtp", repr(self.cfg), repr(self.target_cfg), self.k, self.batch,
                dataclasses.replace(self.sampling, seed=None), str(self.dtype))

    def init_state(self) -> dict:
        """A state of no request yet (begin and begin_rows start rows in it)."""
        from specdec.drafters.stateful import draft_key

        B = self.batch
        return dict(hidden=jnp.zeros((B, self.target_cfg.hidden_size), self.dtype), token=jnp.zeros(B, jnp.int32),
                    position=jnp.zeros(B, jnp.int32), ready=jnp.zeros(B, bool), key=draft_key(self.sampling.seed))

    def begin(self, target_params, prompts: list[list[int]], prompt_hidden) -> dict:
        """A fresh state with every row begun (begin_rows); also kept for the host-driven cycle."""
        self.state = self.begin_rows(target_params, self.init_state(), dict(enumerate(prompts)), prompt_hidden)
        return self.state

    def begin_rows(self, target_params, state: dict, prompts: dict[int, list[int]], prompt_hidden) -> dict:
        """`state` with some rows (row -> prompt) started from their prompts and the target's hidden states of their
        committed positions (prompt_hidden[row]: [P-1, 1, H]; see TorchMtp.begin_row), the other rows left as
        they are."""
        rows, prompts = np.asarray(list(prompts)), list(prompts.values())
        hidden = np.zeros((len(rows), self.target_cfg.hidden_size), np.float32)
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            if len(prompt) > 1:
                hidden[i] = np.asarray(prompt_hidden[row][-1, 0], np.float32)
        return dict(state, hidden=state["hidden"].at[rows].set(jnp.asarray(hidden, self.dtype)),
                    token=state["token"].at[rows].set(np.asarray([p[-1] for p in prompts], np.int32)),
                    position=state["position"].at[rows].set(np.asarray([len(p) - 1 for p in prompts], np.int32)),
                    ready=state["ready"].at[rows].set(np.asarray([len(p) > 1 for p in prompts])))

    def steps(self, target_params, params, state, target_cache):
        """Yield each draft step's (token [B], its distribution [B, V] or None when greedy, logits [B, V]):
        every step at the pending token's position, over the target's cache as it stands."""
        from specdec.acceptance.rule_jax import warp_probs
        from specdec.drafters.stateful import next_draft_keys

        _, step_key = next_draft_keys(state)
        text, position = self.cfg.text, state["position"]
        kv = {}
        for kind, layer in self.kv_layers.items():
            keys, values, stored = target_kv(target_params, self.target_cfg, target_cache, kind, layer)
            kv[kind] = (keys, values, visible(stored, position, text.sliding_window if kind == SLIDING else None))
        rope = {kind: _rope_cos_sin(rope_inv_freq(text.rope[kind], text.kind_head_dim(kind)), position, self.dtype)
                for kind in set(text.layer_types)}
        hidden = _rms_norm(state["hidden"], target_params["norm.weight"], self.target_cfg)
        token = state["token"]
        for j in range(self.k):
            embeds = target_embed(target_params, self.target_cfg, token).astype(self.dtype)
            logits, hidden = step(params, self.cfg, embeds, hidden, rope, kv)
            if self.sampling.greedy:
                token, q = jnp.argmax(logits, axis=-1).astype(jnp.int32), None
            else:
                q = warp_probs(logits, self.sampling)
                token = jax.random.categorical(step_key(j), jnp.log(q), axis=-1).astype(jnp.int32)
            yield token, q, logits

    def draft(self, target_params, params, state, target_cache):
        """-> (draft [B, k] target ids, draft_len [B] (0 for a row without a hidden state yet), draft probs
        [B, k, V] when sampled else None, state (only its key moves on: drafting writes nothing))."""
        from specdec.drafters.stateful import next_draft_keys

        tokens, probs, _ = zip(*self.steps(target_params, params, state, target_cache))
        draft_len = jnp.where(state["ready"], self.k, 0).astype(jnp.int32)
        state = dict(state, key=next_draft_keys(state)[0])
        return jnp.stack(tokens, axis=1), draft_len, (None if self.sampling.greedy else jnp.stack(probs, axis=1)), state

    def observe(self, params, state, hidden, emitted, count, start):
        """After a verify from positions `start` [B] whose first `count` [B] rows were kept (0: the row did not
        advance and keeps its state): the new pending token is emitted[count-1] at start + count, and h the
        verify's hidden row count-1 (hidden [B, >=k+1, 1, H])."""
        rows = jnp.arange(self.batch)
        last = jnp.maximum(count - 1, 0)
        advanced = count > 0
        return dict(state, hidden=jnp.where(advanced[:, None], hidden[rows, last, 0].astype(self.dtype), state["hidden"]),
                    token=jnp.where(advanced, emitted[rows, last].astype(jnp.int32), state["token"]),
                    position=jnp.where(advanced, (start + count).astype(jnp.int32), state["position"]),
                    ready=state["ready"] | advanced)
