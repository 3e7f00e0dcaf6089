"""The EAGLE-3 head in JAX (semantics and layout in specdec.drafters.eagle3): pure functions over a dict of
arrays under the vLLM/SGLang names, plus the target's embedding table passed alongside.

Two attention patterns share the projections (`_project`) and the rest of the layer (`_finish`):
- `step`: drafting against the head's own KV cache, one slot per absolute position. A forward writes its
  keys/values first and then attends to every slot at or before each query's position, so a forward over
  the rows a verify accepted (their features now known) both catches the cache up and yields the next
  draft, and stale slots past the context are never read.
- `ttt_logits`: training-time test. Step 0 runs every position of a sequence on the target's features;
  step j feeds each position the head's own output of step j-1, one token and one position on. A query of
  step j at base position t attends to step 0's keys at positions <= t and to steps 1..j's keys of the
  same t: exactly the cache drafting reads when it chains j drafts after position t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specdec.drafters.eagle3 import Eagle3Config
from specdec.drafters.stateful import JaxHostDriven

Params = dict


def rms_norm(x, weight, eps: float):
    """Llama's RMSNorm: normalised in float32, scaled by the weight in the input's dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def fuse(params: Params, taps):
    """The target's hidden states [..., 3, H] at the aux layers -> the head's feature [..., H]."""
    flat = taps.reshape(*taps.shape[:-2], -1).astype(params["fc.weight"].dtype)
    return flat @ params["fc.weight"].T


def _rope(x, positions, cfg: Eagle3Config):
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [B, T, 1, hd]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _project(params: Params, cfg: Eagle3Config, embeds, hidden, positions):
    """-> q [B, T, heads, hd], k, v [B, T, kv_heads, hd] (rotated), and the residual (the hidden input)."""
    p = "midlayer."
    x = jnp.concatenate([rms_norm(embeds, params[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                         rms_norm(hidden, params[p + "hidden_norm.weight"], cfg.rms_norm_eps)], axis=-1)
    B, T = x.shape[:2]
    q = (x @ params[p + "self_attn.q_proj.weight"].T).reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = (x @ params[p + "self_attn.k_proj.weight"].T).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = (x @ params[p + "self_attn.v_proj.weight"].T).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    return _rope(q, positions, cfg), _rope(k, positions, cfg), v, hidden


def _finish(params: Params, cfg: Eagle3Config, attn, residual):
    """Attention output [B, T, heads * hd] -> (the layer's output before the final norm [B, T, H], which the
    next draft step takes as its hidden input; float32 logits over the draft vocabulary [B, T, Vd])."""
    p = "midlayer."
    h = attn @ params[p + "self_attn.o_proj.weight"].T + residual
    x = rms_norm(h, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = (jax.nn.silu(x @ params[p + "mlp.gate_proj.weight"].T) * (x @ params[p + "mlp.up_proj.weight"].T))
    out = mlp @ params[p + "mlp.down_proj.weight"].T + h
    logits = rms_norm(out, params["norm.weight"], cfg.rms_norm_eps) @ params["lm_head.weight"].T
    return out, logits.astype(jnp.float32)


def _grouped(q, cfg: Eagle3Config):
    """q [B, T, heads, hd] -> [B, T, kv_heads, group, hd], scaled."""
    B, T = q.shape[:2]
    group = cfg.num_heads // cfg.num_kv_heads
    return q.reshape(B, T, cfg.num_kv_heads, group, cfg.head_dim) * (cfg.head_dim**-0.5)


# -- drafting: the head's KV cache ------------------------------------------------------------------------


def init_cache(cfg: Eagle3Config, batch: int, slots: int, dtype) -> dict:
    shape = (batch, slots, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def step(params: Params, cfg: Eagle3Config, embeds, hidden, positions, cache: dict):
    """Run rows [B, T] (token embeddings, hidden inputs) at positions [B, T] against the cache: write their
    keys/values, then attend to every slot at or before each row's position. -> (out [B, T, H], logits
    [B, T, Vd], cache)."""
    q, k, v, residual = _project(params, cfg, embeds, hidden, positions)
    rows = jnp.arange(k.shape[0])[:, None]
    cache = {"k": cache["k"].at[rows, positions].set(k, mode="drop"),
             "v": cache["v"].at[rows, positions].set(v, mode="drop")}
    scores = jnp.einsum("btkgd,bskd->bkgts", _grouped(q, cfg), cache["k"]).astype(jnp.float32)
    visible = jnp.arange(cache["k"].shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    attn = jnp.einsum("bkgts,bskd->btkgd", probs, cache["v"]).reshape(*q.shape[:2], -1)
    out, logits = _finish(params, cfg, attn, residual)
    return out, logits, cache


# -- training: the unrolled training-time test --------------------------------------------------------------


def shifted(x, j: int, fill=0):
    """x [B, N, ...] moved j positions left along N, the end filled: row t holds x[t + j]."""
    if j == 0:
        return x
    pad = jnp.full((x.shape[0], j, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, j:], pad], axis=1)


def ttt_logits(params: Params, cfg: Eagle3Config, embed_table, tokens, features, steps: int):
    """The training-time test over whole sequences. tokens [B, N]; features [B, N, H] (fused, `fuse`).
    -> float32 logits [steps, B, N, Vd]: step j at base position t reads the token at t+1+j and predicts
    the token at t+2+j (rows whose tokens run past N are junk; the loss masks them). A P-EAGLE head's steps after
    the first read mask rows (the mask token, the mask feature) in place of the token and its own last output, as
    it drafts: step j at base t is its mask row j at position t + j, seeing the real rows up to t and its own
    mask rows before it."""
    B, N = tokens.shape
    base = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    causal = (jnp.arange(N)[None, :] <= jnp.arange(N)[:, None])[None, None, None]  # [1, 1, 1, N(t), N(s)]
    hidden = features
    keys, values, all_logits = [], [], []
    if cfg.parallel:
        mask_embed = jnp.broadcast_to(embed_table[cfg.mask_token_id].astype(features.dtype), features.shape)
        mask_feature = jnp.broadcast_to(fuse(params, params["mask_hidden"].reshape(3, -1)).astype(features.dtype),
                                        features.shape)
    for j in range(steps):
        if cfg.parallel and j > 0:
            embeds, hidden = mask_embed, mask_feature
        else:
            embeds = jnp.take(embed_table, shifted(tokens, j + 1), axis=0).astype(features.dtype)
        q, k, v, residual = _project(params, cfg, embeds, hidden, base + j)
        keys.append(k)
        values.append(v)
        qg = _grouped(q, cfg)  # [B, N, kv, g, hd]
        first = jnp.einsum("btkgd,bskd->bkgts", qg, keys[0]).astype(jnp.float32)
        first = jnp.where(causal, first, -jnp.inf)
        own = [jnp.einsum("btkgd,btkd->bkgt", qg, kk).astype(jnp.float32)[..., None] for kk in keys[1:]]
        probs = jax.nn.softmax(jnp.concatenate([first, *own], axis=-1), axis=-1).astype(v.dtype)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs[..., :N], values[0])
        for i, vv in enumerate(values[1:]):
            attn = attn + probs[..., N + i].transpose(0, 3, 1, 2)[..., None] * vv[:, :, :, None]
        hidden, logits = _finish(params, cfg, attn.reshape(B, N, -1), residual)
        all_logits.append(logits)
    return jnp.stack(all_logits)


# -- drafting on the device: the head's state in the decode loop --------------------------------------------


def _bucket(n: int) -> int:
    """Prompt lengths rounded up to a power of two (at least 16): few compiled head prefills."""
    return max(16, 1 << (n - 1).bit_length())


class JaxEagle3(JaxHostDriven):
    """The head drafting inside the JAX engine's decode loop (the torch twin: eagle3_torch.TorchEagle3, whose
    docstring describes the per-row state). `draft` and `observe` are pure functions of (the target's
    params, the head's params, the head's state), so the loop carries the state and jit takes the params
    as arguments, not as constants. `begin`, `host_draft` and `host_observe` keep a state on the object
    for the host-driven cycle."""

    def __init__(self, head, batch: int, max_seq_len: int, k: int, sampling=None, dtype=jnp.float32):
        from specdec.drafters.eagle3 import draft_to_target
        from specdec.sampling import SamplingParams

        self.cfg, self.k, self.batch, self.dtype = head.cfg, k, batch, dtype
        self.sampling = sampling or SamplingParams()
        self.slots = max_seq_len + 2 * (k + 1)
        self.params = {n: jnp.asarray(a, dtype) for n, a in head.params.items()}
        self.params["draft_ids"] = jnp.asarray(draft_to_target(head.d2t), jnp.int32)
        self._start = jax.jit(self._start_rows, donate_argnums=2)

    @property
    def cache_key(self):
        """Equal for drafters whose compiled programs are interchangeable (the engine shares them)."""
        import dataclasses

        return ("eagle3", self.cfg, self.k, self.batch, self.slots, dataclasses.replace(self.sampling, seed=None),
                str(self.dtype))

    def init_state(self) -> dict:
        """A state of no request yet (begin and begin_rows start rows in it)."""
        from specdec.drafters.stateful import draft_key

        cfg, B = self.cfg, self.batch
        return dict(init_cache(cfg, B, self.slots, self.dtype),
                    feats=jnp.zeros((B, self.k + 1, cfg.hidden_size), self.dtype),
                    tokens=jnp.zeros((B, self.k + 1), jnp.int32),
                    count=jnp.zeros(B, jnp.int32), start=jnp.zeros(B, jnp.int32), key=draft_key(self.sampling.seed))

    def _start_rows(self, target_params, params, state, started, tokens, taps, count, last):
        """The rows `started` [B] (bool) begun, the other rows' state as it was: each started row's pairs (feature
        t, token t+1) for t < P-2 into the cache (positions past a row's pairs get junk that catching up
        overwrites before anything reads it); its last pair (feature P-2, the pending token in `last`) is the
        first to catch up on."""
        embed = target_params["embed_tokens.weight"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        feats = fuse(params, taps).astype(self.dtype)
        _, _, cache = step(params, self.cfg, jnp.take(embed, tokens, axis=0).astype(self.dtype), feats[:, :-1],
                           positions, {"k": state["k"], "v": state["v"]})
        rows = jnp.arange(tokens.shape[0])
        pairs = jnp.maximum(count - 1, 0)
        begun = dict(cache, feats=state["feats"].at[:, 0].set(feats[rows, pairs]), tokens=last, start=pairs,
                     count=jnp.minimum(count, 1))
        return dict(state, **{name: jnp.where(started.reshape(-1, *[1] * (value.ndim - 1)), value, state[name])
                              for name, value in begun.items()})

    def begin(self, target_params, prompts: list[list[int]], prompt_hidden) -> dict:
        """A fresh state with every row begun (begin_rows); also kept for the host-driven cycle."""
        self.state = self.begin_rows(target_params, self.init_state(), dict(enumerate(prompts)), prompt_hidden)
        return self.state

    def begin_rows(self, target_params, state: dict, prompts: dict[int, list[int]], prompt_hidden) -> dict:
        """`state` with some rows (row -> prompt) started from their prompts and the target's hidden states of their
        committed positions (prompt_hidden[row]: [P-1, 3, H]; see TorchEagle3.begin_row), the other rows left as
        they are. `state` is consumed."""
        pairs = max(len(p) - 1 for p in prompts.values())
        width = _bucket(pairs)
        started = np.zeros(self.batch, bool)
        tokens = np.zeros((self.batch, width), np.int32)
        taps = np.zeros((self.batch, width + 1, 3, self.cfg.hidden_size), np.float32)
        count = np.zeros(self.batch, np.int32)
        last = np.zeros((self.batch, self.k + 1), np.int32)
        for row, prompt in prompts.items():
            n = len(prompt) - 1  # committed positions, each with a feature
            started[row] = True
            tokens[row, : max(n - 1, 0)] = prompt[1:n]
            taps[row, :n] = np.asarray(prompt_hidden[row], np.float32)
            count[row] = n
            last[row, 0] = prompt[-1]
        return self._start(target_params, self.params, state, *jax.device_put((started, tokens, taps, count, last)))

    def compile_row_starts(self, target_params, longest_prompt: int) -> None:
        """Start a row of a throwaway state once per prompt bucket up to `longest_prompt` tokens: each bucket's head
        prefill is a program of its own, seconds to compile."""
        pairs = 1
        while True:
            hidden = {0: np.zeros((pairs, 3, self.cfg.hidden_size), np.float32)}
            self.begin_rows(target_params, self.init_state(), {0: [0] * (pairs + 1)}, hidden)
            if _bucket(pairs) >= _bucket(max(longest_prompt - 1, 1)):
                return
            pairs = _bucket(pairs) + 1  # the next bucket's fewest pairs

    def draft(self, target_params, params, state, target_cache=None):
        """-> (draft [B, k] target ids, draft_len [B], draft probs [B, k, V] when sampled else None, state).
        The target's cache is not read (the head keeps its own). A P-EAGLE head drafts all k in one forward
        (eagle3_torch.TorchEagle3._draft_parallel says how)."""
        from specdec.drafters.stateful import next_draft_keys

        next_key, step_key = next_draft_keys(state)
        embed = target_params["embed_tokens.weight"]
        rows, k = jnp.arange(self.batch), self.k
        offsets = jnp.arange(k + 1, dtype=jnp.int32)[None]
        last = jnp.maximum(state["count"] - 1, 0)
        cache = {"k": state["k"], "v": state["v"]}
        drafts, probs = [], []
        if self.cfg.parallel:
            real = state["start"][:, None] + jnp.where(offsets < state["count"][:, None], offsets, offsets + k - 1)
            masks = (state["start"] + state["count"])[:, None] + jnp.arange(k - 1, dtype=jnp.int32)[None]
            mask_feature = fuse(params, params["mask_hidden"].reshape(3, -1)).astype(self.dtype)
            tokens = jnp.concatenate([state["tokens"], jnp.full((self.batch, k - 1), self.cfg.mask_token_id, jnp.int32)], 1)
            feats = jnp.concatenate([state["feats"], jnp.broadcast_to(mask_feature, (self.batch, k - 1, mask_feature.shape[-1]))], 1)
            _, logits, cache = step(params, self.cfg, jnp.take(embed, tokens, axis=0).astype(self.dtype), feats,
                                    jnp.concatenate([real, masks], 1), cache)
            j = jnp.arange(k)[None]
            picked = jnp.take_along_axis(logits, jnp.where(j == 0, last[:, None], k + j)[..., None], axis=1)
            drafts = [self._pick(params, picked[:, i], step_key(i), probs) for i in range(k)]
        else:
            out, logits, cache = step(params, self.cfg, jnp.take(embed, state["tokens"], axis=0).astype(self.dtype),
                                      state["feats"], state["start"][:, None] + offsets, cache)
            hidden, logits, position = out[rows, last][:, None], logits[rows, last], state["start"] + last
            for j in range(k):
                token = self._pick(params, logits, step_key(j), probs)
                drafts.append(token)
                if j + 1 < k:
                    position = position + 1
                    embeds = jnp.take(embed, token[:, None], axis=0).astype(self.dtype)
                    hidden, logits, cache = step(params, self.cfg, embeds, hidden, position[:, None], cache)
                    logits = logits[:, 0]
        draft_len = jnp.where(state["count"] > 0, k, 0).astype(jnp.int32)
        state = dict(state, **cache, key=next_key)
        return jnp.stack(drafts, axis=1), draft_len, (jnp.stack(probs, axis=1) if probs else None), state

    def _pick(self, params, logits, key, probs: list):
        """A draft token [B] from draft-vocabulary logits [B, Vd]: the argmax, or a draw (with `key`) under the
        request's filters over the target vocabulary, as the target samples, its distribution appended to `probs`."""
        from specdec.acceptance.rule_jax import warp_probs

        if self.sampling.greedy:
            return params["draft_ids"][jnp.argmax(logits, axis=-1)]
        full = jnp.full((self.batch, self.cfg.vocab_size), -jnp.inf, jnp.float32).at[:, params["draft_ids"]].set(logits)
        q = warp_probs(full, self.sampling)
        probs.append(q)
        return jax.random.categorical(key, jnp.log(q), axis=-1).astype(jnp.int32)

    def observe(self, params, state, hidden, emitted, count, start):
        """After a verify from positions `start` [B] whose first `count` [B] rows were kept: their target hidden
        states [B, >=k+1, 3, H] and the tokens that follow them (emitted [B, k+1]) are next to catch up on."""
        return dict(state, feats=fuse(params, hidden[:, : self.k + 1]).astype(self.dtype),
                    tokens=emitted[:, : self.k + 1].astype(jnp.int32), count=count.astype(jnp.int32),
                    start=start.astype(jnp.int32))
