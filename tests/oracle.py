"""The shared test oracle: plain loops over Python floats, written from the rules' definitions
(specdec.acceptance, specdec.drafters.ngram), not from their vectorised code. Tests of both
frameworks compare against these."""

from __future__ import annotations

import math

from specdec.sampling import SamplingParams


def argmax_lowest_id(row) -> int:
    best = 0
    for token in range(1, len(row)):
        if row[token] > row[best]:
            best = token
    return best


def warp_probs(row, params: SamplingParams) -> list[float]:
    """One row of logits -> probabilities: temperature, top-k, top-p, min-p, softmax."""
    vocab = len(row)
    if params.greedy:
        best = argmax_lowest_id(row)
        return [1.0 if token == best else 0.0 for token in range(vocab)]
    logits = [float(x) / params.temperature for x in row]

    if params.top_k > 0:
        kth_largest = sorted(logits, reverse=True)[min(params.top_k, vocab) - 1]
        logits = [x if x >= kth_largest else -math.inf for x in logits]

    if params.top_p < 1:
        # Ascending by logit; among equal logits the higher id first, i.e. removed first.
        ascending = sorted(range(vocab), key=lambda token: (logits[token], -token))
        probs = softmax(logits)
        cumulative = 0.0
        for token in ascending[:-1]:  # the most likely token always stays
            cumulative += probs[token]
            if cumulative <= 1 - params.top_p:
                logits[token] = -math.inf

    if params.min_p > 0:
        probs = softmax(logits)
        threshold = params.min_p * max(probs)
        logits = [-math.inf if prob < threshold else x for x, prob in zip(logits, probs)]

    return softmax(logits)


def softmax(logits) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def accept_greedy(draft_tokens, draft_len, target_logits) -> tuple[list[int], list[int]]:
    """Per row: accept drafts while each equals its row's argmax, then emit the next argmax."""
    num_accepted, next_token = [], []
    for row in range(len(draft_tokens)):
        accepted = 0
        while (
            accepted < draft_len[row]
            and draft_tokens[row][accepted] == argmax_lowest_id(target_logits[row][accepted])
        ):
            accepted += 1
        num_accepted.append(accepted)
        next_token.append(argmax_lowest_id(target_logits[row][accepted]))
    return num_accepted, next_token


def ngram_propose(tokens, k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Longest n first; within it, the most recent earlier occurrence with a token after it."""
    tokens = list(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def keyed_uniform(seed: int, position: int, lane: int) -> float:
    """The acceptance rules' keyed draw (specdec.acceptance), in Python integers: PCG4D of (seed low, seed high,
    position, lane)."""
    mask = 2**32 - 1
    seed, position, lane = int(seed), int(position), int(lane)
    v = [seed & mask, seed >> 32, position, lane]
    v = [(x * 1664525 + 1013904223) & mask for x in v]
    for round_ in range(2):
        if round_:
            v = [x ^ (x >> 16) for x in v]
        v[0] = (v[0] + v[1] * v[3]) & mask
        v[1] = (v[1] + v[2] * v[0]) & mask
        v[2] = (v[2] + v[0] * v[1]) & mask
        v[3] = (v[3] + v[1] * v[2]) & mask
    return (v[0] >> 8) / 2**24
