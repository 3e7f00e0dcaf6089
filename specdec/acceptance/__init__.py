"""Acceptance rules: which drafted tokens to keep, and the target's own next token.

One implementation per framework, with the same semantics, defined here once:
``rule_torch`` (PyTorch, CUDA-graph capturable) and ``rule_jax`` (pure JAX, jit-able with static
K and params). Neither is imported here, so each needs only its own framework installed.

Shapes: B rows (sequences), K drafted tokens per row (static, may be 0), V vocabulary.
``draft_tokens [B, K]`` int, ``draft_len [B]`` int in [0, K] (entries at positions >= draft_len are
padding and never read as drafts), ``target_logits [B, K+1, V]``: row i is the target's logits
after the pending token and the first i drafts.

warp_probs(logits [..., V], params) -> probs [..., V] float32
    The distribution a request samples from, identical for target and draft. In float32:
    temperature (divide), then top-k, then top-p, then min-p, then softmax, matching Hugging
    Face's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper
    (min_tokens_to_keep=1):
    - top-k keeps every token whose logit is >= the k-th largest (ties at the k-th all stay);
    - top-p sorts ascending, takes the cumulative softmax and removes tokens whose cumulative
      probability is <= 1 - top_p, always keeping the most likely token. Among equal logits the
      higher token id sorts lower and so is removed first (HF's sort leaves that order unspecified);
    - min-p removes tokens whose probability (after the filters before it) is < min_p * max prob.
    Greedy params (temperature 0) give a one-hot at the argmax.

accept_greedy(draft_tokens, draft_len, target_logits) -> (num_accepted [B], next_token [B])
    num_accepted = the longest prefix of the first draft_len drafts where each draft equals the
    argmax of its target row; next_token = argmax of row num_accepted (the correction at the first
    mismatch, or the bonus at row draft_len). argmax ties break to the lowest token id:
    torch.argmax and jnp.argmax both return the first maximal index. With K = 0 this is plain
    greedy decoding.

accept_sampled(draft_tokens, draft_len, draft_probs, target_logits, params, uniform)
        -> (num_accepted [B], next_token [B])
    Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023) with
    p = warp_probs(target_logits, params). draft_probs [B, K, V] is q, the exact distribution each
    draft token was sampled from (the drafter's warp_probs output); None means a deterministic
    drafter, i.e. q is a point mass on each draft token. Draft i is accepted when u_i * q(x_i) <
    p(x_i) with u_i ~ U[0, 1), i.e. with probability min(1, p/q). At the first rejection the
    next token is drawn from max(0, p - q) (normalised; for a point mass: p with x zeroed); if
    that residual has no mass (p == q) it is drawn from p. If all draft_len drafts are accepted,
    the bonus is drawn from p at row draft_len. Every emitted token is then distributed exactly
    as the target alone would sample it. With greedy params it returns what accept_greedy does.
    The next token is drawn by inverse CDF: the first token with weight whose cumulative weight
    reaches u_K times the total weight.
    The draws are keyed, not streamed: uniform [B, K+1] holds row b's u_0 .. u_K =
    keyed_uniform(seeds[b], positions[b], K + 1), where seeds [B, 2] are the row's seed as two 32-bit
    words (specdec.sampling.seed_words) and positions [B] its pending token's position. A row's draws
    thus depend on its seed and its position alone: not on the rows beside it, on what ran before, or
    on which loop (host or fused, either framework) runs the cycle.

keyed_uniform(seeds [B, 2], positions [B], n) -> [B, n] float32 in [0, 1)
    Lane j of row b: the PCG4D hash (Jarzynski and Olano, "Hash Functions for GPU Rendering",
    JCGT 2020) of the 32-bit words (seed low, seed high, position, j): each word v <- v * KEYED_STEP[0]
    + KEYED_STEP[1]; then for i = 0..3, v[i] += v[a] * v[b] with (a, b) = KEYED_MIX[i]; then each
    word v ^= v >> 16 and the mix again; all mod 2^32. The uniform is (v[0] >> 8) / 2^24. Both
    frameworks compute the same words, so their draws are equal.

Per-row params (torch's RowSampling, a server's batch): warp_probs and accept_sampled give row b
what SamplingParams of row b's settings give it; a row of temperature 0 is greedy.

All functions are vectorised over B and V, return device arrays and need no host sync.
"""

KEYED_STEP = (1664525, 1013904223)  # keyed_uniform's first step: v * a + c, the LCG of Numerical Recipes
KEYED_MIX = ((1, 3), (2, 0), (0, 1), (1, 2))  # v[i] += v[a] * v[b], for i = 0..3 in order
