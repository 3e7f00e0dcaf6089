"""Acceptance rules in JAX; semantics in ``specdec.acceptance``.

Pure functions whose random draws are keyed by each row's seed and position. jit them with ``params``
static (SamplingParams is hashable), or pass RowSampling (per-row settings) as an argument; K is static through
the shapes, so they also run inside ``lax.while_loop``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specdec.acceptance import KEYED_MIX, KEYED_STEP
from specdec.sampling import SamplingParams


@functools.partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_k", "top_p_rest", "min_p"],
                   meta_fields=["filters"])
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row settings of a batch whose rows may sample differently, as arrays [B]: temperature (0: a greedy
    row), top_k (0: off), top_p_rest (SamplingParams.top_p_rest; 0: off) and min_p (0: off).
    `filters` (static) names the filters to run, where the caller knows them (a run of one setting); None (a
    server's rows, whose mix changes from cycle to cycle) picks them on the device, one branch of a lax.switch
    per set, so one program serves every mix. A filter leaves a row with it off as it is."""

    temperature: jax.Array
    top_k: jax.Array
    top_p_rest: jax.Array
    min_p: jax.Array
    filters: frozenset[str] | None = None

    @classmethod
    def of(cls, rows: list[SamplingParams], filters: frozenset[str] | None = None) -> "RowSampling":
        """Host arrays of rows' settings; a greedy row's filters are off (it takes the greedy rule's token)."""
        def column(value, dtype):
            return np.asarray([0 if r.greedy else value(r) for r in rows], dtype)

        return cls(column(lambda r: r.temperature, np.float32), column(lambda r: r.top_k, np.int32),
                   column(lambda r: r.top_p_rest, np.float32), column(lambda r: r.min_p, np.float32), filters)


FILTERS = ("top_k", "top_p", "min_p")
FILTER_SETS = [frozenset(f for i, f in enumerate(FILTERS) if mask >> i & 1) for mask in range(2 ** len(FILTERS))]


def warp_probs(logits: jax.Array, params: SamplingParams | RowSampling) -> jax.Array:
    """[..., V] logits -> [..., V] float32 probabilities the request samples from; with RowSampling, row b of
    the leading dimension as its own settings say."""
    logits = logits.astype(jnp.float32)
    if isinstance(params, RowSampling):
        greedy_rows = _per_row(params.temperature == 0, logits)
        greedy = _one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
        return jnp.where(greedy_rows, greedy, _row_probs(logits, params))
    if params.greedy:
        return _one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
    logits = logits / params.temperature
    if params.top_k > 0:
        logits = _top_k(logits, params.top_k)
    if params.top_p < 1:
        logits = _top_p(logits, params.top_p_rest)
    if params.min_p > 0:
        logits = _min_p(logits, params.min_p)
    return jax.nn.softmax(logits, axis=-1)


def _row_probs(logits: jax.Array, params: RowSampling) -> jax.Array:
    """warp_probs of each row's sampled settings; a greedy row's are those of temperature 1."""
    temperature = _per_row(params.temperature, logits)
    logits = logits / jnp.where(temperature == 0, 1.0, temperature)
    top_k, rest, min_p = (_per_row(a, logits) for a in (params.top_k, params.top_p_rest, params.min_p))
    steps = {"top_k": lambda x: _top_k_rows(x, top_k), "top_p": lambda x: _top_p(x, rest, rest > 0),
             "min_p": lambda x: _min_p(x, min_p)}

    def filtered(filters, x):
        for name in FILTERS:
            x = steps[name](x) if name in filters else x
        return x

    if params.filters is not None:
        return jax.nn.softmax(filtered(params.filters, logits), axis=-1)
    used = [(params.top_k > 0).any(), (params.top_p_rest > 0).any(), (params.min_p > 0).any()]
    which = sum(u.astype(jnp.int32) << i for i, u in enumerate(used))  # the index of FILTER_SETS in use
    branches = [functools.partial(filtered, filters) for filters in FILTER_SETS]
    return jax.nn.softmax(jax.lax.switch(which, branches, logits), axis=-1)


def _per_row(values: jax.Array, like: jax.Array) -> jax.Array:
    """[B] -> [B, 1, ...], broadcasting over `like`'s dimensions after the first."""
    return values.reshape((-1,) + (1,) * (like.ndim - 1))


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
    params: SamplingParams | RowSampling,
    uniform: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """-> (num_accepted [B], next_token [B]) by lossless rejection sampling.

    draft_probs [B, K, V] is the distribution the drafts were sampled from; None for a
    deterministic drafter (a point mass on each draft token). uniform [B, K+1]: each row's keyed draws
    (keyed_uniform of its seed at its pending token's position). Greedy rows of RowSampling take
    accept_greedy's tokens.
    """
    k = draft_tokens.shape[1]
    vocab = target_logits.shape[-1]
    rows = isinstance(params, RowSampling)
    p = _row_probs(target_logits.astype(jnp.float32), params) if rows else warp_probs(target_logits, params)

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
    next_token = _inverse_cdf(weights, uniform[:, k])
    if not rows:
        return num_accepted, next_token
    greedy_rows = params.temperature == 0
    greedy = accept_greedy(draft_tokens, draft_len, target_logits)
    return jnp.where(greedy_rows, greedy[0], num_accepted), jnp.where(greedy_rows, greedy[1], next_token)


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
    """One token per row [B, V], with probability proportional to weights, from one uniform [B] (rule_torch's)."""
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


def _top_k_rows(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """_top_k with k per row (0: off), broadcast over logits: a whole sort, the same k-th value."""
    vocab = logits.shape[-1]
    kth = jnp.minimum(jnp.where(top_k > 0, top_k, vocab), vocab) - 1
    kth = jnp.broadcast_to(kth, logits.shape[:-1] + (1,))
    kth_largest = jnp.take_along_axis(jnp.sort(logits, axis=-1, descending=True), kth, axis=-1)
    return jnp.where(logits < kth_largest, -jnp.inf, logits)


def _top_p(logits: jax.Array, rest, used=True) -> jax.Array:
    """Keep the most likely tokens whose probabilities sum past top_p: drop those summing to at most
    rest = 1 - top_p from the least likely up. `used` (per row): rows where the filter is on."""
    # Descending stable sort puts lower ids first among equal logits; flipped, it is HF's ascending
    # order with higher ids lower.
    order = jnp.argsort(logits, axis=-1, descending=True, stable=True)
    sorted_asc = jnp.flip(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    cumulative_asc = jnp.cumsum(jax.nn.softmax(sorted_asc, axis=-1), axis=-1)
    remove_asc = (cumulative_asc <= rest).at[..., -1].set(False)  # the most likely stays
    remove = jnp.put_along_axis(
        jnp.zeros_like(remove_asc), order, jnp.flip(remove_asc, axis=-1), axis=-1, inplace=False
    )
    return jnp.where(remove & used, -jnp.inf, logits)


def _min_p(logits: jax.Array, min_p) -> jax.Array:
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p * probs.max(axis=-1, keepdims=True)
    # min_p < 1, so the most likely token is never below the threshold.
    return jnp.where(probs < threshold, -jnp.inf, logits)
