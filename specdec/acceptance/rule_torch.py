"""Acceptance rules in PyTorch; semantics in ``specdec.acceptance``. Token tensors are long.

CUDA-graph capturable: static shapes, no ``.item()``, no Python branch on tensor values (branches
only on K and on params' static parts, which are fixed for a captured graph). The random draws are
integer arithmetic on the row's seed and position (``keyed_uniform``): no generator state to register.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.acceptance import KEYED_MIX, KEYED_STEP
from specdec.sampling import SamplingParams

_WORD = 0xFFFFFFFF


@dataclass(frozen=True, eq=False)
class RowSampling:
    """Per-row settings of a batch whose rows sample differently (a server's requests), as tensors [B]:
    temperature (0: a greedy row), top_k (0: off), top_p_rest (SamplingParams.top_p_rest; 0: off), min_p (0: off).
    `filters` (static) names the filters any row uses, so the others cost nothing; a row with a filter off is left
    as it is."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p_rest: torch.Tensor
    min_p: torch.Tensor
    filters: frozenset[str]

    @classmethod
    def of(cls, rows: list[SamplingParams], device=None) -> "RowSampling":
        as_t = lambda name, dtype: torch.tensor([getattr(r, name) for r in rows], dtype=dtype, device=device)  # noqa: E731
        return cls(as_t("temperature", torch.float32), as_t("top_k", torch.long), as_t("top_p_rest", torch.float32),
                   as_t("min_p", torch.float32), frozenset().union(*(r.filters for r in rows)))

    SETTINGS = ("temperature", "top_k", "top_p_rest", "min_p")  # the per-row tensors

    def first(self, rows: int, filters: frozenset[str]) -> "RowSampling":
        """The first `rows` rows' settings (views), applying `filters`."""
        return RowSampling(*(getattr(self, name)[:rows] for name in self.SETTINGS), filters)


ARGMAX_BLOCK = 1024  # logits per block of greedy_token's first pass


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: the greedy rule's token, the argmax with ties to the lowest id (torch.argmax's first
    maximum). Compiled, it runs in two passes, each block of ARGMAX_BLOCK logits' maximum, then the first block
    holding the largest: inductor does not split an arg reduction, so one program read each row's 262,144 logits
    (28 us on an H200 for a plain cycle's one row). Eager torch.argmax splits its reduction itself."""
    vocab = logits.shape[-1]
    if not torch.compiler.is_compiling() or vocab <= ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    pad = -vocab % ARGMAX_BLOCK  # -inf after the last id: it takes no tie from a real logit
    padded = torch.nn.functional.pad(logits, (0, pad), value=-torch.inf) if pad else logits
    blocks = padded.unflatten(-1, (-1, ARGMAX_BLOCK))
    within = blocks.argmax(dim=-1)  # [..., blocks]: each block's first maximum
    block = blocks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # the first block holding the largest (NaN too)
    return (block * ARGMAX_BLOCK + within.gather(-1, block)).squeeze(-1)


def warp_probs(logits: torch.Tensor, params: SamplingParams | RowSampling) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities the request samples from; with RowSampling, row b
    of the leading dimension as its own settings say (bitwise what SamplingParams of those settings give)."""
    if isinstance(params, SamplingParams) and params.greedy:
        return _one_hot(greedy_token(logits), logits.shape[-1])
    probs, greedy_rows = _sampled_probs(logits, params)
    if greedy_rows is None:
        return probs
    return torch.where(greedy_rows, _one_hot(greedy_token(logits), logits.shape[-1]), probs)


def _sampled_probs(logits: torch.Tensor, params: SamplingParams | RowSampling):
    """-> (warp_probs of sampled settings, the greedy rows [B, 1, ...] of RowSampling or None); a greedy row's
    probabilities are those of temperature 1, for the caller to replace."""
    logits = logits.float()
    if isinstance(params, SamplingParams):
        greedy_rows = None
        top_k, top_p_rest, min_p = params.top_k, params.top_p_rest, params.min_p
        # A tensor on the logits' device, as RowSampling's is: CUDA divides by a Python float (a CPU scalar) as a
        # multiply by its reciprocal, which rounds differently.
        temperature = logits.new_full((), params.temperature)
    else:  # per row, shaped to broadcast over the dimensions after the first
        shape = (-1,) + (1,) * (logits.dim() - 1)
        temperature, top_k, top_p_rest, min_p = (t.view(shape) for t in
                                                  (params.temperature, params.top_k, params.top_p_rest, params.min_p))
        greedy_rows = temperature == 0
        temperature = torch.where(greedy_rows, 1.0, temperature)
    warped = logits / temperature
    if "top_k" in params.filters:
        warped = _top_k(warped, top_k)
    if "top_p" in params.filters:
        warped = _top_p(warped, top_p_rest)
    if "min_p" in params.filters:
        warped = _min_p(warped, min_p)
    return torch.softmax(warped, dim=-1), greedy_rows


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] float32 uniforms in [0, 1): lane j of row b is a hash of (seeds[b] (two 32-bit words), positions[b],
    j), the shared rule's (specdec.acceptance). 32-bit words held in int64: products are split so that none
    overflows, and shifts of non-negative values are logical."""
    lanes = torch.arange(n, device=positions.device).expand(positions.shape[0], n)
    v = [seeds[:, :1].expand_as(lanes), seeds[:, 1:].expand_as(lanes), positions[:, None].long().expand_as(lanes),
         lanes]
    v = [(_mul32(x, KEYED_STEP[0]) + KEYED_STEP[1]) & _WORD for x in v]
    for round_ in range(2):
        if round_:
            v = [x ^ (x >> 16) for x in v]
        for i, (a, b) in enumerate(KEYED_MIX):
            v[i] = (v[i] + _mul32(v[a], v[b])) & _WORD
    return (v[0] >> 8).float() * 2.0**-24


def _mul32(a, b) -> torch.Tensor:
    """a * b mod 2^32 for 32-bit words in int64, each partial product below 2^49."""
    b_low, b_high = b & 0xFFFF, b >> 16
    return (a * b_low + (((a * b_high) & 0xFFFF) << 16)) & _WORD


def accept_greedy(
    draft_tokens: torch.Tensor, draft_len: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B], next_token [B]): longest argmax-matching prefix, then the argmax."""
    target_tokens = greedy_token(target_logits)  # [B, K+1]
    matches = (draft_tokens == target_tokens[:, :-1]) & _in_draft(draft_tokens, draft_len)
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_len: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams | RowSampling,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B], next_token [B]) by lossless rejection sampling.

    draft_probs [B, K, V] is the distribution the drafts were sampled from; None for a
    deterministic drafter (a point mass on each draft token). uniform [B, K+1]: each row's keyed draws
    (keyed_uniform of its seed at its pending token's position). Greedy rows of RowSampling take
    accept_greedy's tokens.
    """
    if isinstance(params, SamplingParams) and params.greedy:
        return accept_greedy(draft_tokens, draft_len, target_logits)
    batch, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    p, greedy_rows = _sampled_probs(target_logits, params)  # [B, K+1, V]

    p_of_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        draft_probs = draft_probs.float()
        q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accepted = (uniform[:, :k] * q_of_draft < p_of_draft) & _in_draft(draft_tokens, draft_len)
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)

    # The next token comes from row num_accepted: the residual there if a draft was rejected,
    # else (all draft_len drafts accepted) the bonus from p.
    p_next = p.gather(1, num_accepted[:, None, None].expand(batch, 1, vocab)).squeeze(1)
    weights = p_next
    if k > 0:
        rejected_row = num_accepted.clamp(max=k - 1)
        if draft_probs is None:  # max(0, p - point mass at x): p with x zeroed, in one scatter
            rejected_token = draft_tokens.gather(1, rejected_row[:, None])
            residual = p_next.scatter(1, rejected_token, 0.0)
        else:
            index = rejected_row[:, None, None].expand(batch, 1, vocab)
            residual = (p_next - draft_probs.gather(1, index).squeeze(1)).clamp_min(0)
        # A residual without mass means p == q there; p is then the right distribution.
        use_residual = (num_accepted < draft_len) & (residual.sum(dim=-1) > 0)
        weights = torch.where(use_residual[:, None], residual, p_next)
    next_token = _inverse_cdf(weights, uniform[:, k])
    if greedy_rows is None:
        return num_accepted, next_token
    greedy = accept_greedy(draft_tokens, draft_len, target_logits)
    rows = greedy_rows.view(-1)
    return torch.where(rows, greedy[0], num_accepted), torch.where(rows, greedy[1], next_token)


def _in_draft(draft_tokens: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)
    return positions < draft_len[:, None]


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    # Comparison, not F.one_hot: its range check can sync with the host on CUDA.
    return (torch.arange(vocab, device=tokens.device) == tokens[..., None]).float()


INVERSE_CDF_BLOCK = 1024  # tokens summed per block: a scan along 262,144 tokens in 16 rows would run in 16 blocks


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row [B, V], with probability proportional to weights, from one uniform [B] (the shared
    rule's): the first token with weight whose cumulative weight reaches uniform * total. Tokens without weight
    are never drawn, however the sums round. The cumulative weight is summed by blocks of INVERSE_CDF_BLOCK
    tokens, then over the blocks' totals: a scan that runs in parallel."""
    batch, vocab = weights.shape
    pad = -vocab % INVERSE_CDF_BLOCK
    padded = (torch.nn.functional.pad(weights, (0, pad)) if pad else weights).reshape(batch, -1, INVERSE_CDF_BLOCK)
    within = padded.cumsum(dim=-1)
    before = torch.nn.functional.pad(within[..., -1].cumsum(dim=-1)[:, :-1], (1, 0))  # earlier blocks' total
    cumulative = (within + before[..., None]).view(batch, -1)[:, :vocab]
    cumulative = torch.where(weights > 0, cumulative, -1.0)
    total = cumulative.amax(dim=-1, keepdim=True)
    return (cumulative >= uniform[:, None] * total).to(torch.uint8).argmax(dim=-1)


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, with probability proportional to weights (Gumbel-max)."""
    uniform = torch.rand(weights.shape, generator=generator, device=weights.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
    # log(0) = -inf, so tokens without weight are never chosen.
    return (weights.log() + gumbel).argmax(dim=-1)


def _top_k(logits: torch.Tensor, top_k) -> torch.Tensor:
    """top_k: an int (a partial sort), or per row (0: off; a whole sort, the same k-th value)."""
    if not isinstance(top_k, torch.Tensor):
        kth_largest = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth_largest, -torch.inf)
    vocab = logits.shape[-1]
    kth = (torch.where(top_k > 0, top_k, vocab).clamp(max=vocab) - 1).expand(*logits.shape[:-1], 1)
    kth_largest = torch.sort(logits, dim=-1, descending=True).values.gather(-1, kth)
    return logits.masked_fill(logits < kth_largest, -torch.inf)


def _top_p(logits: torch.Tensor, rest) -> torch.Tensor:
    """Drop the least likely tokens summing to at most rest (SamplingParams.top_p_rest): a float, or per row (0: off)."""
    # Descending stable sort puts lower ids first among equal logits; flipped, it is HF's ascending
    # order with higher ids lower.
    sorted_desc, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    cumulative_asc = torch.softmax(sorted_desc.flip(-1), dim=-1).cumsum(dim=-1)
    remove_asc = cumulative_asc <= rest
    remove_asc[..., -1] = False  # the most likely token always stays
    remove = remove_asc.flip(-1).scatter(-1, order, remove_asc.flip(-1))
    if isinstance(rest, torch.Tensor):
        remove &= rest > 0
    return logits.masked_fill(remove, -torch.inf)


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    # min_p < 1, so the most likely token is never below the threshold.
    return logits.masked_fill(probs < threshold, -torch.inf)
