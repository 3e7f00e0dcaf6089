"""Acceptance rules in PyTorch; semantics in ``specdec.acceptance``. Token tensors are long.

CUDA-graph capturable: static shapes, no ``.item()``, no Python branch on tensor values (branches
only on K and on params, which are fixed for a captured graph). To capture ``accept_sampled`` with
your own generator, register it with the graph (``torch.cuda.CUDAGraph.register_generator_state``).
"""

from __future__ import annotations

import torch

from specdec.sampling import SamplingParams


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities the request samples from."""
    logits = logits.float()
    if params.greedy:
        return _one_hot(logits.argmax(dim=-1), logits.shape[-1])
    logits = logits / params.temperature
    if params.top_k > 0:
        logits = _top_k(logits, params.top_k)
    if params.top_p < 1:
        logits = _top_p(logits, params.top_p)
    if params.min_p > 0:
        logits = _min_p(logits, params.min_p)
    return torch.softmax(logits, dim=-1)


def accept_greedy(
    draft_tokens: torch.Tensor, draft_len: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B], next_token [B]): longest argmax-matching prefix, then the argmax."""
    target_tokens = target_logits.argmax(dim=-1)  # [B, K+1]; first max = lowest id on ties
    matches = (draft_tokens == target_tokens[:, :-1]) & _in_draft(draft_tokens, draft_len)
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_len: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B], next_token [B]) by lossless rejection sampling.

    draft_probs [B, K, V] is the distribution the drafts were sampled from; None for a
    deterministic drafter (a point mass on each draft token).
    """
    batch, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    p = warp_probs(target_logits, params)  # [B, K+1, V]

    p_of_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        draft_probs = draft_probs.float()
        q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    uniform = torch.rand((batch, k), generator=generator, device=p.device)
    accepted = (uniform * q_of_draft < p_of_draft) & _in_draft(draft_tokens, draft_len)
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)

    # The next token comes from row num_accepted: the residual there if a draft was rejected,
    # else (all draft_len drafts accepted) the bonus from p.
    p_next = p.gather(1, num_accepted[:, None, None].expand(batch, 1, vocab)).squeeze(1)
    weights = p_next
    if k > 0:
        rejected_row = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            rejected_token = draft_tokens.gather(1, rejected_row[:, None]).squeeze(1)
            q_next = _one_hot(rejected_token, vocab)
        else:
            index = rejected_row[:, None, None].expand(batch, 1, vocab)
            q_next = draft_probs.gather(1, index).squeeze(1)
        residual = (p_next - q_next).clamp_min(0)
        # A residual without mass means p == q there; p is then the right distribution.
        use_residual = (num_accepted < draft_len) & (residual.sum(dim=-1) > 0)
        weights = torch.where(use_residual[:, None], residual, p_next)
    return num_accepted, _sample(weights, generator)


def _in_draft(draft_tokens: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)
    return positions < draft_len[:, None]


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    # Comparison, not F.one_hot: its range check can sync with the host on CUDA.
    return (torch.arange(vocab, device=tokens.device) == tokens[..., None]).float()


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, with probability proportional to weights (Gumbel-max)."""
    uniform = torch.rand(weights.shape, generator=generator, device=weights.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))
    # log(0) = -inf, so tokens without weight are never chosen.
    return (weights.log() + gumbel).argmax(dim=-1)


def _top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    kth_largest = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, -torch.inf)


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # Descending stable sort puts lower ids first among equal logits; flipped, it is HF's ascending
    # order with higher ids lower.
    sorted_desc, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    cumulative_asc = torch.softmax(sorted_desc.flip(-1), dim=-1).cumsum(dim=-1)
    remove_asc = cumulative_asc <= 1 - top_p
    remove_asc[..., -1] = False  # the most likely token always stays
    remove = remove_asc.flip(-1).scatter(-1, order, remove_asc.flip(-1))
    return logits.masked_fill(remove, -torch.inf)


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    # min_p < 1, so the most likely token is never below the threshold.
    return logits.masked_fill(probs < threshold, -torch.inf)
