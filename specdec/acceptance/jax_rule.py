"""Acceptance rules in JAX; semantics in ``specdec.acceptance``.

Pure functions whose random draws are keyed by each row's seed and position. jit them with ``params``
static (SamplingParams is hashable); K is static through the shapes, so they also run inside
``lax.while_loop``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec.acceptance import KEYED_MIX, KEYED_STEP
from specdec.sampling import SamplingParams


def warp_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """[..., V] logits -> [..., V] float32 probabilities the request samples from."""
    logits = logits.astype(jnp.float32)
    if params.greedy:
        return _one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
    logits = logits / params.temperature
    if params.top_k > 0:
        logits = _top_k(logits, params.top_k)
    if params.top_p < 1:
        logits = _top_p(logits, params.top_p)
    if params.min_p > 0:
        logits = _min_p(logits, params.min_p)
    return jax.nn.softmax(logits, axis=-1)


def accept_greedy(
    draft_tokens: jax.Array, draft_len: jax.Array, target_logits: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """-> (num_accepted [B], next_token [B]): longest argmax-matching prefix, then the argmax."""
    target_tokens = jnp.argmax(target_logits, axis=-1)  # [B, K+1]; first max = lowest id on ties
    matches = (draft_tokens == target_tokens[:, :-1]) & _in_draft(draft_tokens, draft_len)
    num_accepted = jnp.cumprod(matches.astype(jnp.int32), axis=-1).sum(axis=-1)
    next_token = jnp.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token


def accept_sampled(
    draft_tokens: jax.Array,
    draft_len: jax.Array,
    draft_probs: jax.Array | None,
    target_logits: jax.Array,
    params: SamplingParams,
    uniform: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """-> (num_accepted [B], next_token [B]) by lossless rejection sampling.

    draft_probs [B, K, V] is the distribution the drafts were sampled from; None for a
    deterministic drafter (a point mass on each draft token). uniform [B, K+1]: each row's keyed draws
    (keyed_uniform of its seed at its pending token's position).
    """
    k = draft_tokens.shape[1]
    vocab = target_logits.shape[-1]
    p = warp_probs(target_logits, params)  # [B, K+1, V]

    p_of_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_of_draft = jnp.ones_like(p_of_draft)
    else:
        draft_probs = draft_probs.astype(jnp.float32)
        q_of_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    accepted = (uniform[:, :k] * q_of_draft < p_of_draft) & _in_draft(draft_tokens, draft_len)
    num_accepted = jnp.cumprod(accepted.astype(jnp.int32), axis=-1).sum(axis=-1)

    # The next token comes from row num_accepted: the residual there if a draft was rejected,
    # else (all draft_len drafts accepted) the bonus from p.
    p_next = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]
    weights = p_next
    if k > 0:
        rejected_row = jnp.minimum(num_accepted, k - 1)
        if draft_probs is None:
            rejected_token = jnp.take_along_axis(draft_tokens, rejected_row[:, None], axis=1)[:, 0]
            q_next = _one_hot(rejected_token, vocab)
        else:
            q_next = jnp.take_along_axis(draft_probs, rejected_row[:, None, None], axis=1)[:, 0]
        residual = jnp.maximum(p_next - q_next, 0)
        # A residual without mass means p == q there; p is then the right distribution.
        use_residual = (num_accepted < draft_len) & (residual.sum(axis=-1) > 0)
        weights = jnp.where(use_residual[:, None], residual, p_next)
    return num_accepted, _inverse_cdf(weights, uniform[:, k])


def keyed_uniform(seeds: jax.Array, positions: jax.Array, n: int) -> jax.Array:
    """[B, n] float32 uniforms in [0, 1): lane j of row b is a hash of (seeds[b] (two 32-bit words), positions[b],
    j), the shared rule's (specdec.acceptance), in uint32 arithmetic."""
    lanes = jnp.broadcast_to(jnp.arange(n, dtype=jnp.uint32), (positions.shape[0], n))
    seeds = seeds.astype(jnp.uint32)
    v = [jnp.broadcast_to(seeds[:, :1], lanes.shape), jnp.broadcast_to(seeds[:, 1:], lanes.shape),
         jnp.broadcast_to(positions.astype(jnp.uint32)[:, None], lanes.shape), lanes]
    v = [x * jnp.uint32(KEYED_STEP[0]) + jnp.uint32(KEYED_STEP[1]) for x in v]
    for round_ in range(2):
        if round_:
            v = [x ^ (x >> 16) for x in v]
        for i, (a, b) in enumerate(KEYED_MIX):
            v[i] = v[i] + v[a] * v[b]
    return (v[0] >> 8).astype(jnp.float32) * 2.0**-24


def _inverse_cdf(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """One token per row [B, V], with probability proportional to weights, from one uniform [B] (torch_rule's)."""
    cumulative = jnp.where(weights > 0, jnp.cumsum(weights, axis=-1), -1.0)
    total = cumulative.max(axis=-1, keepdims=True)
    return jnp.argmax(cumulative >= uniform[:, None] * total, axis=-1)


def _in_draft(draft_tokens: jax.Array, draft_len: jax.Array) -> jax.Array:
    return jnp.arange(draft_tokens.shape[1]) < draft_len[:, None]


def _one_hot(tokens: jax.Array, vocab: int) -> jax.Array:
    return (jnp.arange(vocab) == tokens[..., None]).astype(jnp.float32)


def _top_k(logits: jax.Array, top_k: int) -> jax.Array:
    kth_largest = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
    return jnp.where(logits < kth_largest, -jnp.inf, logits)


def _top_p(logits: jax.Array, top_p: float) -> jax.Array:
    # Descending stable sort puts lower ids first among equal logits; flipped, it is HF's ascending
    # order with higher ids lower.
    order = jnp.argsort(logits, axis=-1, descending=True, stable=True)
    sorted_asc = jnp.flip(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    cumulative_asc = jnp.cumsum(jax.nn.softmax(sorted_asc, axis=-1), axis=-1)
    remove_asc = (cumulative_asc <= 1 - top_p).at[..., -1].set(False)  # the most likely stays
    remove = jnp.put_along_axis(
        jnp.zeros_like(remove_asc), order, jnp.flip(remove_asc, axis=-1), axis=-1, inplace=False
    )
    return jnp.where(remove, -jnp.inf, logits)


def _min_p(logits: jax.Array, min_p: float) -> jax.Array:
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p * probs.max(axis=-1, keepdims=True)
    # min_p < 1, so the most likely token is never below the threshold.
    return jnp.where(probs < threshold, -jnp.inf, logits)
