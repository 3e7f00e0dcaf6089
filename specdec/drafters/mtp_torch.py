"""The Gemma 4 MTP assistant in PyTorch, for drafting (semantics in specdec.drafters.mtp; the same math as
mtp_jax, checked against it and against transformers in tests): functions over a dict of tensors under the
stripped checkpoint names, reading the target engine's live KV cache. CUDA-graph capturable: static shapes,
in-place updates of preallocated buffers, no host synchronisation.

Beside a tensor-parallel target each device holds the query heads that read its KV heads and its share of
the MLP columns (config.tp_split_axis, as the target's layers), and sums o_proj's and down_proj's outputs
across the target's group."""

from __future__ import annotations

import numpy as np
import torch

from specdec.drafters.mtp import AssistantConfig, mtp_taps, target_kv_layers
from specdec.errors import SpecdecError
from specdec.models.config import SLIDING, tp_split_axis, vocab_rows
from specdec.models.gemma_torch import KVCache, apply_rope, dense_linear, gelu_mlp, rms_norm, rope_tables, sum_across

MASKED = torch.finfo(torch.float32).min  # not -inf: a row with nothing to attend to (no hidden yet) stays finite


def target_kv(target_model, cache: KVCache, kind: str, layer: int):
    """The keys and values [B, n_kv, S, hd] of the target's layer `layer` and the positions its slots hold [B, S].
    k_eq_v layers store V only; K is rebuilt as the target rebuilds it, with the target's RoPE tables."""
    keys, values, stored = cache.keys[layer], cache.values[layer], cache.slot_pos[kind]
    if values is None:
        cos, sin = getattr(target_model, f"cos_{kind}"), getattr(target_model, f"sin_{kind}")
        at = stored.clamp(min=0)
        keys, values = target_model.layers[layer].self_attn._keys_from_stored(
            keys, cos[at].to(keys.dtype)[:, None], sin[at].to(keys.dtype)[:, None]), keys
    return keys, values, stored


def visible(stored: torch.Tensor, position: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, S] bool: the stored positions a query at `position` [B] attends to: before it, and on sliding layers
    within the window the target's own query at position - 1 sees."""
    mask = (stored >= 0) & (stored < position[:, None])
    if window is not None:
        mask = mask & (stored >= position[:, None] - window)
    return mask


def _attention(params: dict, cfg: AssistantConfig, index: int, x, cos, sin, keys, values, mask, tp_group=None):
    """x [B, H] -> the layer's attention output [B, H]: queries at the row's position over the target's keys."""
    text, spec = cfg.text, cfg.text.layers[index]
    p = f"layers.{index}.self_attn."
    B, hd, nkv = x.shape[0], spec.head_dim, keys.shape[1]
    heads = params[p + "q_proj.weight"].shape[0] // hd  # this device's, beside a tensor-parallel target
    q = dense_linear(x, params[p + "q_proj.weight"]).view(B, heads, hd)
    q = apply_rope(rms_norm(q, params[p + "q_norm.weight"], text), cos[:, None], sin[:, None])
    q = q.view(B, nkv, heads // nkv, hd)  # query head h uses KV head h // groups
    scores = torch.einsum("bkgd,bksd->bkgs", q, keys).float()  # Gemma 4 attention scale: 1
    scores = scores.masked_fill(~mask[:, None, None], MASKED)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.einsum("bkgs,bksd->bkgd", probs, values).reshape(B, heads * hd)
    return sum_across(dense_linear(out, params[p + "o_proj.weight"]), tp_group)


def _layer(params: dict, cfg: AssistantConfig, index: int, x, cos, sin, keys, values, mask, tp_group=None):
    p = f"layers.{index}."
    norm = lambda name, v: rms_norm(v, params[p + name + ".weight"], cfg.text)  # noqa: E731
    x = x + norm("post_attention_layernorm", _attention(params, cfg, index, norm("input_layernorm", x), cos, sin,
                                                        keys, values, mask, tp_group))
    mlp = gelu_mlp(norm("pre_feedforward_layernorm", x), *(params[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
    x = x + norm("post_feedforward_layernorm", sum_across(mlp, tp_group))
    return x * params[p + "layer_scalar"]


def head_logits(params: dict, cfg: AssistantConfig, normed: torch.Tensor) -> torch.Tensor:
    """The assistant's LM head over its final-normed state [B, H] -> float32 logits [B, V]. With ordered
    embeddings only the tokens of the top-k centroids get real logits; the others get the lowest of those
    minus 1. transformers takes that minimum over the whole batch; here it is per row, so a row's logits do
    not depend on the other rows (the same at batch 1)."""
    head = params[cfg.head_name]
    if not cfg.use_ordered_embeddings:
        return dense_linear(normed, head).float()
    centroids = dense_linear(normed, params["masked_embedding.centroids.weight"])
    top = torch.topk(centroids, cfg.centroid_intermediate_top_k, dim=-1).indices
    tokens = params["token_ordering"][top].flatten(1)  # [B, top_k * V / C]
    selected = torch.einsum("bh,bnh->bn", normed, head[tokens]).float()
    fill = selected.amin(dim=-1, keepdim=True) - 1.0
    return fill.expand(-1, cfg.text.vocab_size).scatter(-1, tokens, selected)


def step(params: dict, cfg: AssistantConfig, embeds, hidden, rope: dict, kv: dict, tp_group=None):
    """One draft step of every row: the target's scaled token embeddings and h [B, H_target], the queries'
    RoPE rows per kind (cos, sin [B, hd]), the target's (keys, values, mask) per kind; `tp_group`: the
    tensor-parallel target's, `params` then this device's slices (module docstring). -> (float32 logits [B, V],
    the next step's h [B, H_target])."""
    x = dense_linear(torch.cat([embeds, hidden], dim=-1), params["pre_projection.weight"])
    for spec in cfg.text.layers:
        x = _layer(params, cfg, spec.index, x, *rope[spec.kind], *kv[spec.kind], tp_group)
    normed = rms_norm(x, params["norm.weight"], cfg.text)
    return head_logits(params, cfg, normed), dense_linear(normed, params["post_projection.weight"])


class TorchMtp:
    """The assistant drafting on the device for one TorchEngine, as static buffers a FusedCycle captures into
    its CUDA graph. Per row: the pending token, its position p, the target's hidden state at p - 1 (after
    layer L-1, before the final norm) and whether there is one yet (a prompt of one token has none: the row
    drafts nothing until its first verify). `draft` reads the engine's live cache."""

    def __init__(self, assistant, target_engine, k: int, sampling=None):
        from specdec.sampling import SamplingParams

        engine = target_engine
        if tuple(engine.hidden_layers) != mtp_taps(engine.cfg):
            raise SpecdecError(f"the verifier returns hidden layers {engine.hidden_layers}, the assistant reads "
                               f"{mtp_taps(engine.cfg)}")
        assistant.check_target(engine.cfg, str(assistant.path))
        self.cfg, self.engine, self.k, self.batch = assistant.cfg, engine, k, engine.batch
        self.sampling = sampling or SamplingParams()
        device, dtype = engine.device, engine.model.dtype
        self.tp_group = engine.model.tp_group
        split = _device_slice(self.cfg, self.tp_group)
        self.params = {n: torch.tensor(np.asarray(a[split(n, a.shape)]), dtype=dtype, device=device)
                       for n, a in assistant.params.items()}
        if assistant.token_ordering is not None:
            ordering = assistant.token_ordering.reshape(self.cfg.num_centroids, -1)
            self.params["token_ordering"] = torch.tensor(ordering, dtype=torch.long, device=device)
        self.kv_layers = target_kv_layers(engine.cfg)
        text = self.cfg.text
        tables = {kind: rope_tables(text.rope[kind], text.kind_head_dim(kind), engine.max_seq_len)
                  for kind in set(text.layer_types)}
        self.rope = {kind: (cos.to(device), sin.to(device)) for kind, (cos, sin) in tables.items()}
        self.hidden = torch.zeros(self.batch, engine.cfg.hidden_size, dtype=dtype, device=device)
        self.token = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.position = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.ready = torch.zeros(self.batch, dtype=torch.bool, device=device)
        self.generator = None if self.sampling.greedy else torch.Generator(device=device)

    def state(self) -> list[torch.Tensor]:
        """What a cycle advances."""
        return [self.hidden, self.token, self.position, self.ready]

    @torch.inference_mode()
    def begin(self, prompts: list[list[int]], prompt_hidden: list[torch.Tensor]) -> None:
        """Start every row (begin_row) and the sampling generator from the request's seed."""
        if self.generator is not None:
            from specdec.drafters.stateful import draft_seed

            self.generator.manual_seed(draft_seed(self.sampling.seed))
        for row, (prompt, hidden) in enumerate(zip(prompts, prompt_hidden)):
            self.begin_row(row, prompt, hidden)

    @torch.inference_mode()
    def begin_row(self, row: int, prompt: list[int], prompt_hidden: torch.Tensor) -> None:
        """Start one row from its prompt, the other rows left as they are: the pending token is its last, h the
        target's hidden state of the last committed position (prompt_hidden: [P-1, 1, H], the committed prompt
        positions)."""
        self.token[row], self.position[row] = prompt[-1], len(prompt) - 1
        self.ready[row] = len(prompt) > 1
        if len(prompt) > 1:
            self.hidden[row] = prompt_hidden[-1, 0]

    def steps(self):
        """Yield each draft step's (token [B], its distribution [B, V] or None when greedy, logits [B, V]):
        every step at the pending token's position, over the target's cache as it stands."""
        from specdec.acceptance.rule_torch import _sample, greedy_token, warp_probs

        text, model = self.cfg.text, self.engine.model
        kv = {}
        for kind, layer in self.kv_layers.items():
            keys, values, stored = target_kv(model, self.engine.cache, kind, layer)
            kv[kind] = (keys, values, visible(stored, self.position, text.sliding_window if kind == SLIDING else None))
        at = self.position.clamp(max=self.engine.max_seq_len - 1)
        dtype = self.hidden.dtype
        rope = {kind: (cos[at].to(dtype), sin[at].to(dtype)) for kind, (cos, sin) in self.rope.items()}
        hidden, token = model.norm(self.hidden), self.token
        for _ in range(self.k):
            logits, hidden = step(self.params, self.cfg, model._embed(token), hidden, rope, kv, self.tp_group)
            if self.generator is None:
                token, q = greedy_token(logits), None
            else:
                q = warp_probs(logits, self.sampling)
                token = _sample(q, self.generator)
            yield token, q, logits

    def draft(self):
        """-> (draft [B, k] target ids, draft_len [B] (0 for a row without a hidden state yet), draft probs
        [B, k, V] when sampled else None)."""
        tokens, probs, _ = zip(*self.steps())
        draft_len = torch.where(self.ready, self.k, 0)
        return torch.stack(tokens, dim=1), draft_len, (None if self.generator is None else torch.stack(probs, dim=1))

    def observe(self, hidden: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor, start: torch.Tensor) -> None:
        """After a verify from positions `start` [B] whose first `count` [B] rows were kept (0: the row did not
        advance and keeps its state): the new pending token is emitted[count-1] at start + count, and h the
        verify's hidden row count-1 (hidden [B, >=k+1, 1, H])."""
        rows = torch.arange(self.batch, device=count.device)
        last = (count - 1).clamp(min=0)
        advanced = count > 0
        self.hidden.copy_(torch.where(advanced[:, None], hidden[rows, last, 0], self.hidden))
        self.token.copy_(torch.where(advanced, emitted[rows, last], self.token))
        self.position.copy_(torch.where(advanced, start + count, self.position))
        self.ready.logical_or_(advanced)


def _device_slice(cfg: AssistantConfig, tp_group):
    """-> (name, shape) -> the index of this device's slice of an assistant tensor beside a target split over
    `tp_group` (everything without a group): its layers' heads and MLP columns split as the target's are
    (config.tp_split_axis), so a device's query heads are those of its KV heads; its own token table stays
    whole (the centroid-masked head gathers rows of it by token)."""
    if tp_group is None:
        return lambda name, shape: (...,)
    from specdec.models.checkpoint import shard_index
    from specdec.models.config import check_tensor_parallel
    from specdec.models.gemma_torch import group_shard

    shard = group_shard(tp_group)
    check_tensor_parallel(cfg.text, shard[1])

    def split(name, shape):
        if vocab_rows(cfg.text, name) is not None or tp_split_axis(cfg.text, name, shard[1]) is None:
            return (...,)
        return shard_index(cfg.text, name, shape, shard)

    return split
