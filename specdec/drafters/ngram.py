"""N-gram drafter (prompt lookup decoding): propose what followed the last n tokens before.

The rule, the same in all three versions (host, torch, JAX):
for n from max_ngram down to min_ngram, look for an earlier occurrence of the last n tokens of
prompt + generated tokens, i.e. a start j with tokens[j:j+n] == tokens[-n:] and j + n < len
(at least one token follows it, so the suffix never matches itself; occurrences may overlap it).
The first n with any occurrence wins; among its occurrences the most recent (largest j) wins,
since recent text predicts best. The proposal is tokens[j+n : j+n+k], shorter where it runs
into the end of the sequence; no occurrence at any n means no proposal.
Hugging Face's prompt lookup takes the earliest occurrence instead; vLLM's ngram proposer the
longest match.

The device versions work on a fixed-shape token buffer so an engine can fuse draft + verify +
accept: an occurrence of length n ending at e is the AND over m < n of
tokens[e - m] == tokens[len - 1 - m], built up for m = 0..max_ngram-1 in O(L * max_ngram).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np

from specdec.errors import SpecdecError
from specdec.protocol import Draft


def _check_ngram_sizes(min_ngram: int, max_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise SpecdecError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")


def ngram_propose(tokens: Sequence[int], k: int, min_ngram: int = 1, max_ngram: int = 3) -> list[int]:
    """Up to k tokens that followed the most recent earlier match (host version of the rule)."""
    if k < 0:
        raise SpecdecError(f"k must be >= 0, got {k}")
    _check_ngram_sizes(min_ngram, max_ngram)
    tokens = np.asarray(tokens, dtype=np.int64)
    length = len(tokens)
    if k == 0:
        return []
    for n in range(max_ngram, min_ngram - 1, -1):
        if length < n + 1:
            continue
        # Windows starting at j = 0 .. length-n-1: each has at least one token after it.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n
            return tokens[begin : begin + k].tolist()
    return []


class NgramDrafter:
    """The host n-gram drafter behind the Drafter protocol: one context (prompt + emitted tokens) per
    row. Deterministic, so a point-mass drafter (no draft probabilities); works on any vocabulary."""

    vocab_size = None
    stateful = False  # its device function reads the token buffer alone

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        _check_ngram_sizes(min_ngram, max_ngram)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.context: list[list[int]] = []

    def begin(self, prompts: list[list[int]]) -> None:
        self.context = [list(p) for p in prompts]

    def propose(self, k: int) -> Draft:
        """numpy arrays: the loop moves them to the verifier's device."""
        tokens = np.zeros((len(self.context), k), dtype=np.int64)
        lengths = np.zeros(len(self.context), dtype=np.int64)
        for b, ctx in enumerate(self.context):
            proposal = ngram_propose(ctx, k, self.min_ngram, self.max_ngram)
            tokens[b, : len(proposal)] = proposal
            lengths[b] = len(proposal)
        return Draft(tokens, lengths)

    def observe(self, emitted: list[list[int]], hidden=None) -> None:
        for ctx, new in zip(self.context, emitted):
            ctx.extend(new)

    def device_draft_fn(self, framework: str, k: int):
        """The same rule over a device token buffer (see specdec.protocol.DeviceDrafter)."""
        propose = {"torch": ngram_propose_torch, "jax": ngram_propose_jax}.get(framework)
        if propose is None:
            raise SpecdecError(f"unknown framework {framework!r}: use 'torch' or 'jax'")
        return partial(propose, k=k, min_ngram=self.min_ngram, max_ngram=self.max_ngram)


def open_drafter(path=None, target_path=None, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3):
    """The registry's entry (specdec.drafters.registry): n-gram sizes as vLLM names them; no files."""
    sizes = (prompt_lookup_min, prompt_lookup_max)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        raise SpecdecError(f"prompt_lookup_min and prompt_lookup_max must be integers, got {sizes}")
    _check_ngram_sizes(*sizes)
    return NgramSource(*sizes)


class NgramSource:
    """n-gram drafting for any target (specdec.protocol.LoadedDrafter)."""

    taps = ()
    samples_drafts = False

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def build(self, verifier, k: int, sampling) -> NgramDrafter:
        return NgramDrafter(self.min_ngram, self.max_ngram)


def ngram_propose_torch(tokens, lengths, k: int, min_ngram: int = 1, max_ngram: int = 3):
    """tokens [B, L] long (valid up to lengths [B]) -> (draft [B, k] long, draft_len [B] long).

    Entries of draft at positions >= draft_len are 0. CUDA-graph capturable: fixed shapes, no
    host sync.
    """
    import torch  # torch and JAX are optional extras: import only the one in use

    _check_ngram_sizes(min_ngram, max_ngram)
    batch, buffer_len = tokens.shape
    ends = torch.arange(buffer_len, device=tokens.device)  # candidate last index e of a match
    lengths = lengths.long()
    matches_so_far = torch.ones_like(tokens, dtype=torch.bool)
    best_end = torch.full((batch,), -1, dtype=torch.long, device=tokens.device)
    for m in range(max_ngram):
        suffix_token = tokens.gather(1, (lengths - 1 - m).clamp(min=0)[:, None])
        shifted = torch.roll(tokens, m, dims=1)  # shifted[:, e] = tokens[:, e - m] for e >= m
        matches_so_far = matches_so_far & (shifted == suffix_token) & (ends >= m)
        n = m + 1
        if n >= min_ngram:
            # e <= len - 2 leaves a token after the match, so the suffix never matches itself.
            valid = matches_so_far & (ends <= lengths[:, None] - 2)
            last_end = torch.where(valid, ends, -1).amax(dim=1)
            best_end = torch.where(last_end >= 0, last_end, best_end)  # longer n wins
    found = best_end >= 0
    begin = best_end + 1
    draft_len = torch.where(found, torch.clamp(lengths - begin, max=k), 0)
    offsets = torch.arange(k, device=tokens.device)
    positions = (begin[:, None] + offsets).clamp(0, buffer_len - 1)
    draft = tokens.gather(1, positions)
    draft = torch.where(offsets < draft_len[:, None], draft, 0)
    return draft, draft_len


def ngram_propose_jax(tokens, lengths, k: int, min_ngram: int = 1, max_ngram: int = 3):
    """tokens [B, L] int (valid up to lengths [B]) -> (draft [B, k], draft_len [B]).

    Entries of draft at positions >= draft_len are 0. jit with k, min_ngram, max_ngram static.
    """
    import jax.numpy as jnp  # optional extra, like torch above

    _check_ngram_sizes(min_ngram, max_ngram)
    batch, buffer_len = tokens.shape
    ends = jnp.arange(buffer_len)  # candidate last index e of a match
    matches_so_far = jnp.ones(tokens.shape, dtype=bool)
    best_end = jnp.full((batch,), -1, dtype=jnp.int32)
    for m in range(max_ngram):
        suffix_token = jnp.take_along_axis(tokens, jnp.maximum(lengths - 1 - m, 0)[:, None], axis=1)
        shifted = jnp.roll(tokens, m, axis=1)  # shifted[:, e] = tokens[:, e - m] for e >= m
        matches_so_far = matches_so_far & (shifted == suffix_token) & (ends >= m)
        n = m + 1
        if n >= min_ngram:
            # e <= len - 2 leaves a token after the match, so the suffix never matches itself.
            valid = matches_so_far & (ends <= lengths[:, None] - 2)
            last_end = jnp.where(valid, ends, -1).max(axis=1)
            best_end = jnp.where(last_end >= 0, last_end, best_end)  # longer n wins
    found = best_end >= 0
    begin = best_end + 1
    draft_len = jnp.where(found, jnp.minimum(lengths - begin, k), 0)
    offsets = jnp.arange(k)
    positions = jnp.clip(begin[:, None] + offsets, 0, buffer_len - 1)
    draft = jnp.take_along_axis(tokens, positions, axis=1)
    draft = jnp.where(offsets < draft_len[:, None], draft, 0)
    return draft, draft_len
