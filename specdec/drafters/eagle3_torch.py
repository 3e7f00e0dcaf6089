"""The EAGLE-3 head in PyTorch, for drafting (semantics in specdec.drafters.eagle3; the same math as
eagle3_jax.step, checked against it in tests): functions over a dict of tensors under the vLLM/SGLang
names, the target's embedding table passed alongside. CUDA-graph capturable: static shapes, in-place
cache writes, no host synchronisation."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specdec.drafters.eagle3 import Eagle3Config
from specdec.models.gemma_torch import dense_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fuse(params: dict, taps: torch.Tensor) -> torch.Tensor:
    """The target's hidden states [..., 3, H] at the aux layers -> the head's feature [..., H]."""
    return dense_linear(taps.flatten(-2).to(params["fc.weight"].dtype), params["fc.weight"])


def rope_inv_freq(cfg: Eagle3Config, device) -> torch.Tensor:
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim))


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # [B, T, 1, hd]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def step(params: dict, cfg: Eagle3Config, inv_freq: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
         positions: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor):
    """Run rows [B, T] (token embeddings, hidden inputs) at positions [B, T]: write their keys/values into
    the cache [B, S, kv_heads, hd] (slot = position), then attend to every slot at or before each row's
    position. -> (the output before the final norm [B, T, H], float32 draft-vocab logits [B, T, Vd])."""
    p = "midlayer."
    eps = cfg.rms_norm_eps
    x = torch.cat([rms_norm(embeds, params[p + "input_layernorm.weight"], eps),
                   rms_norm(hidden, params[p + "hidden_norm.weight"], eps)], dim=-1)
    B, T = x.shape[:2]
    group = cfg.num_heads // cfg.num_kv_heads
    q = dense_linear(x, params[p + "self_attn.q_proj.weight"]).view(B, T, cfg.num_kv_heads, group, cfg.head_dim)
    k = dense_linear(x, params[p + "self_attn.k_proj.weight"]).view(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = dense_linear(x, params[p + "self_attn.v_proj.weight"]).view(B, T, cfg.num_kv_heads, cfg.head_dim)
    q = _rope(q.flatten(2, 3), positions, inv_freq).view_as(q) * (cfg.head_dim**-0.5)
    k = _rope(k, positions, inv_freq)
    slots = positions.clamp(max=cache_k.shape[1] - 1)  # past the cache: junk rows only (never read)
    rows = torch.arange(B, device=x.device)[:, None]
    cache_k.index_put_((rows, slots), k)
    cache_v.index_put_((rows, slots), v)
    scores = torch.einsum("btkgd,bskd->bkgts", q, cache_k).float()
    visible = torch.arange(cache_k.shape[1], device=x.device)[None, None, :] <= positions[:, :, None]
    scores = scores.masked_fill(~visible[:, None, None], -torch.inf)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    attn = torch.einsum("bkgts,bskd->btkgd", probs, cache_v).reshape(B, T, -1)
    h = dense_linear(attn, params[p + "self_attn.o_proj.weight"]) + hidden
    x = rms_norm(h, params[p + "post_attention_layernorm.weight"], eps)
    gate, up = (dense_linear(x, params[p + f"mlp.{name}_proj.weight"]) for name in ("gate", "up"))
    mlp = F.silu(gate) * up
    out = dense_linear(mlp, params[p + "mlp.down_proj.weight"]) + h
    logits = dense_linear(rms_norm(out, params["norm.weight"], eps), params["lm_head.weight"]).float()
    return out, logits


class TorchEagle3:
    """The head drafting on the device for one engine: its KV cache and the rows of the last verify still to
    catch up on, as static buffers, so a FusedCycle captures `draft` and `observe` into its CUDA graph.

    Per row: `start` is the position of the first row to catch up on, `count` how many (0: nothing to draft
    from yet), `feats`/`tokens` their fused target features and the tokens that follow them. A draft first
    runs the head over those rows (writing their keys/values; the last real row's output is the first
    draft), then chains k-1 single-row steps on its own outputs. A P-EAGLE head (cfg.parallel) runs its k-1 mask
    rows in that same forward instead: one forward a cycle, whatever k."""

    def __init__(self, head, embed, device, batch: int, max_seq_len: int, k: int, sampling=None,
                 dtype=torch.float32, compile: bool = False):
        """`embed`: tokens -> the target's token embeddings, unscaled (GemmaModel.token_embeddings).
        `compile`: run the head's step under torch.compile, as an engine that compiles its forward does
        (eager, a step is some forty small kernels; compiled, the cycle's drafting takes half the time)."""
        from specdec.drafters.eagle3 import draft_to_target
        from specdec.engines.verifier_torch import compiled
        from specdec.sampling import SamplingParams

        self._step_fn = compiled(step) if compile else step

        self.cfg, self.k, self.batch = head.cfg, k, batch
        self.sampling = sampling or SamplingParams()
        self.params = {n: torch.tensor(np.asarray(a), dtype=dtype, device=device) for n, a in head.params.items()}
        self.embed = embed
        self.draft_ids = torch.as_tensor(draft_to_target(head.d2t), device=device)
        self.inv_freq = rope_inv_freq(head.cfg, device)
        slots = max_seq_len + 2 * (k + 1)
        shape = (batch, slots, head.cfg.num_kv_heads, head.cfg.head_dim)
        self.cache_k = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_v = torch.zeros(shape, dtype=dtype, device=device)
        self.feats = torch.zeros(batch, k + 1, head.cfg.hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(batch, k + 1, dtype=torch.long, device=device)
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.generator = None if self.sampling.greedy else torch.Generator(device=device)
        if head.cfg.parallel:  # the mask rows' inputs, the same every cycle
            mask_feature = fuse(self.params, self.params["mask_hidden"].view(3, -1))
            self.mask_feats = mask_feature.expand(batch, k - 1, -1).contiguous()
            self.mask_tokens = torch.full((batch, k - 1), head.cfg.mask_token_id, dtype=torch.long, device=device)

    def state(self) -> list[torch.Tensor]:
        """What a cycle advances (the cache is only written past the context: rolled back like the target's)."""
        return [self.feats, self.tokens, self.count, self.start]

    def _step(self, tokens, hidden, positions, rows=slice(None), step_fn=None):
        embeds = self.embed(tokens).to(hidden.dtype)
        return (step_fn or self._step_fn)(self.params, self.cfg, self.inv_freq, embeds, hidden, positions,
                                          self.cache_k[rows], self.cache_v[rows])

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
        """Start one row from its prompt and the target's hidden states of its committed prompt positions
        [P-1, 3, H], the other rows left as they are: the head's cache over the pairs (feature t, token t+1) for
        t < P-2; the last pair is the first to catch up on."""
        device = self.tokens.device
        if len(prompt) < 2:  # nothing committed, no feature: this row drafts from its next verify on
            self.count[row], self.start[row] = 0, 0
            return
        feats = fuse(self.params, prompt_hidden.to(device))
        n = len(prompt) - 2  # pairs before the last
        if n:
            tokens = torch.tensor(prompt[1 : n + 1], device=device)[None]
            # eager: a prompt's length would be one more compilation (once per request, outside the graph)
            self._step(tokens, feats[None, :n], torch.arange(n, device=device)[None], slice(row, row + 1), step)
        self.feats[row, 0] = feats[n]
        self.tokens[row, 0] = prompt[-1]
        self.count[row], self.start[row] = 1, n

    def draft(self):
        """-> (draft [B, k] target ids, draft_len [B], draft probs [B, k, V] when sampled else None)."""
        if self.cfg.parallel:
            return self._draft_parallel()
        B = self.batch
        rows = torch.arange(B, device=self.tokens.device)
        offsets = torch.arange(self.k + 1, device=self.tokens.device)
        out, logits = self._step(self.tokens, self.feats, self.start[:, None] + offsets)
        last = (self.count - 1).clamp(min=0)
        hidden, logits, position = out[rows, last][:, None], logits[rows, last], self.start + last
        drafts, probs = [], []
        for j in range(self.k):
            token = self._pick(logits, probs)
            drafts.append(token)
            if j + 1 < self.k:
                position = position + 1
                hidden, logits = self._step(token[:, None], hidden, position[:, None])
                logits = logits[:, 0]
        return self._drafted(drafts, probs)

    def _draft_parallel(self):
        """P-EAGLE: one forward over the rows to catch up on and k-1 mask rows placed right after each row's last
        real one; draft j is the output of the row at the last real position + j. A row's unused catch-up rows sit
        after its mask rows, where nothing reads them (the next cycle's rows overwrite their keys and values)."""
        k, device = self.k, self.tokens.device
        offsets = torch.arange(k + 1, device=device)[None]
        real = self.start[:, None] + torch.where(offsets < self.count[:, None], offsets, offsets + k - 1)
        masks = (self.start + self.count)[:, None] + torch.arange(k - 1, device=device)[None]
        _, logits = self._step(torch.cat([self.tokens, self.mask_tokens], 1), torch.cat([self.feats, self.mask_feats], 1),
                               torch.cat([real, masks], 1))
        last = (self.count - 1).clamp(min=0)
        j = torch.arange(k, device=device)[None]
        rows = torch.where(j == 0, last[:, None], k + j)  # mask row j - 1 is row k + j of the forward
        logits = logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))
        probs: list[torch.Tensor] = []
        return self._drafted([self._pick(logits[:, i], probs) for i in range(k)], probs)

    def _pick(self, logits: torch.Tensor, probs: list) -> torch.Tensor:
        """A draft token [B] from draft-vocabulary logits [B, Vd]: the argmax, or a draw under the request's filters
        over the target vocabulary (as the target samples), its distribution appended to `probs`."""
        from specdec.acceptance.rule_torch import _sample, greedy_token, warp_probs

        if self.generator is None:
            return self.draft_ids[greedy_token(logits)]
        full = logits.new_full((self.batch, self.cfg.vocab_size), -torch.inf)
        full[:, self.draft_ids] = logits
        q = warp_probs(full, self.sampling)
        probs.append(q)
        return _sample(q, self.generator)

    def _drafted(self, drafts: list, probs: list):
        draft_len = torch.where(self.count > 0, self.k, 0)
        return torch.stack(drafts, dim=1), draft_len, (torch.stack(probs, dim=1) if probs else None)

    def observe(self, hidden: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor, start: torch.Tensor) -> None:
        """After a verify from positions `start` [B] whose first `count` [B] rows were kept: their target
        hidden states [B, >=k+1, 3, H] and the tokens that follow them (emitted [B, k+1]) are next to catch up on."""
        self.feats.copy_(fuse(self.params, hidden[:, : self.k + 1]))
        self.tokens.copy_(emitted[:, : self.k + 1])
        self.count.copy_(count)
        self.start.copy_(start)
