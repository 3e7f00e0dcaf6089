"""n-gram lookup first, a learned drafter elsewhere (the registry's `ngram+KIND=DIR` kinds): per row and cycle, the
row drafts n-gram lookup's continuation where lookup finds one of K tokens after a match of `prompt_lookup_min` or
more tokens (2 by default: a single repeated token is weak evidence), and the wrapped drafter's drafts otherwise.
Lookup wins on text that repeats (code, edits, extraction) and costs nothing; a head wins on text that does not.

The wrapped drafter (an EAGLE-3 or P-EAGLE head, a model drafter, an MTP assistant) runs every cycle either way: its
state must catch up on every verify, whoever drafted. The wrapper keeps a token buffer of its own for the lookup,
filled from the prompts it begins and the tokens each verify emits (`observe`), so it is a device state like any
other (specdec.drafters.stateful) and the fused cycles of both engines run it unchanged. Where the wrapped drafter
samples its drafts, a row drafted by lookup reports a point mass for them, which the acceptance rule takes as it is:
lossless either way.
"""

from __future__ import annotations

import numpy as np

from specdec.drafters.ngram import NgramDrafter, open_drafter as open_ngram
from specdec.drafters.stateful import JaxHostDriven, StatefulDrafter
from specdec.errors import SpecdecError


def open_drafter(inner, prompt_lookup_min: int = 2, prompt_lookup_max: int = 3) -> "HybridSource":
    """The registry's entry for a composite kind (specdec.drafters.registry): `inner` is the wrapped kind's loaded
    drafter; the lookup's n-gram sizes as vLLM names them."""
    lookup = open_ngram(None, None, prompt_lookup_min, prompt_lookup_max)
    return HybridSource(inner, lookup.min_ngram, lookup.max_ngram)


class HybridSource:
    """The wrapped drafter's files, read and checked (specdec.protocol.LoadedDrafter), built with lookup first."""

    def __init__(self, inner, min_ngram: int, max_ngram: int):
        self.inner, self.min_ngram, self.max_ngram = inner, min_ngram, max_ngram
        self.taps, self.samples_drafts = inner.taps, inner.samples_drafts

    def build(self, verifier, k: int, sampling) -> StatefulDrafter:
        drafter = self.inner.build(verifier, k, sampling)
        if not isinstance(drafter, StatefulDrafter):
            raise SpecdecError(f"n-gram lookup goes first only before a drafter with a device state, not {drafter!r}")
        lookup = NgramDrafter(self.min_ngram, self.max_ngram).device_draft_fn(verifier.framework, k)
        if verifier.framework == "jax":
            drafter.device = JaxHybrid(drafter.device, lookup, verifier.batch, verifier.max_seq_len, k)
        else:
            if verifier.compiles:  # as the fused cycle compiles a lone lookup: a handful of kernels, not dozens
                from specdec.engines.verifier_torch import compiled

                lookup = compiled(lookup)
            drafter.device = TorchHybrid(drafter.device, lookup, verifier.batch, verifier.max_seq_len, k,
                                         verifier.device)
        drafter.name = "ngram+" + drafter.name
        return drafter


class TorchHybrid:
    """The torch device state (specdec.drafters.stateful): the wrapped one's, and a token buffer for the lookup."""

    def __init__(self, inner, lookup, batch: int, max_seq_len: int, k: int, device):
        import torch

        self.inner, self.lookup, self.k = inner, lookup, k
        self.sampling, self.generator = inner.sampling, inner.generator
        self.tokens = torch.zeros(batch, max_seq_len + 2 * (k + 1), dtype=torch.long, device=device)
        self.context_len = torch.zeros(batch, dtype=torch.long, device=device)  # the pending token included

    def state(self) -> list:
        return self.inner.state() + [self.tokens, self.context_len]

    def begin(self, prompts: list[list[int]], prompt_hidden) -> None:
        self.inner.begin(prompts, prompt_hidden)
        for row, prompt in enumerate(prompts):
            self._set_row(row, prompt)

    def begin_row(self, row: int, prompt: list[int], prompt_hidden) -> None:
        self.inner.begin_row(row, prompt, prompt_hidden)
        self._set_row(row, prompt)

    def _set_row(self, row: int, prompt: list[int]) -> None:
        import torch

        self.tokens[row, : len(prompt)] = torch.as_tensor(prompt, device=self.tokens.device)
        self.context_len[row] = len(prompt)

    def draft(self):
        """-> (draft [B, k], draft_len [B], probs [B, k, V] or None): lookup's where it found k tokens."""
        import torch

        drafts, draft_len, probs = self.inner.draft()
        found, found_len = self.lookup(self.tokens, self.context_len)
        use = found_len == self.k
        drafts = torch.where(use[:, None], found.to(drafts.dtype), drafts)
        draft_len = torch.where(use, found_len.to(draft_len.dtype), draft_len)
        if probs is not None:  # lookup's drafts are certain: a point mass
            certain = torch.nn.functional.one_hot(drafts, probs.shape[-1]).to(probs.dtype)
            probs = torch.where(use[:, None, None], certain, probs)
        return drafts, draft_len, probs

    def observe(self, hidden, emitted, count, start) -> None:
        """The wrapped state's observe; the emitted tokens after each row's pending one (at position `start`)."""
        import torch

        self.inner.observe(hidden, emitted, count, start)
        positions = (start[:, None] + 1 + torch.arange(emitted.shape[1], device=emitted.device)).clamp(
            max=self.tokens.shape[1] - 1)  # past a row's count: junk its next tokens overwrite before lookup reads
        self.tokens.scatter_(1, positions, emitted.to(self.tokens.dtype))
        self.context_len.copy_(torch.where(count > 0, start + 1 + count, self.context_len))


class JaxHybrid(JaxHostDriven):
    """The JAX device state (specdec.drafters.stateful): the wrapped one's state dict, with the lookup's token buffer
    (`lookup_tokens`, `lookup_len`) beside its entries."""

    def __init__(self, inner, lookup, batch: int, max_seq_len: int, k: int):
        self.inner, self.lookup, self.k, self.batch = inner, lookup, k, batch
        self.slots = max_seq_len + 2 * (k + 1)
        self.sampling, self.params = inner.sampling, inner.params

    @property
    def cache_key(self):
        return ("ngram+", self.inner.cache_key, self.lookup.keywords["min_ngram"], self.lookup.keywords["max_ngram"])

    def init_state(self) -> dict:
        return dict(self.inner.init_state(), **self._empty_lookup())

    def _empty_lookup(self) -> dict:
        import jax.numpy as jnp

        return {"lookup_tokens": jnp.zeros((self.batch, self.slots), jnp.int32),
                "lookup_len": jnp.zeros(self.batch, jnp.int32)}

    def begin(self, target_params, prompts: list[list[int]], prompt_hidden) -> dict:
        state = dict(self.inner.begin(target_params, prompts, prompt_hidden), **self._empty_lookup())
        self.state = self._with_rows(state, dict(enumerate(prompts)))
        return self.state

    def begin_rows(self, target_params, state: dict, prompts: dict[int, list[int]], prompt_hidden) -> dict:
        return self._with_rows(self.inner.begin_rows(target_params, state, prompts, prompt_hidden), prompts)

    def _with_rows(self, state: dict, prompts: dict[int, list[int]]) -> dict:
        rows = np.asarray(list(prompts))
        tokens = np.zeros((len(rows), self.slots), np.int32)
        for i, prompt in enumerate(prompts.values()):
            tokens[i, : len(prompt)] = prompt
        lengths = np.asarray([len(p) for p in prompts.values()], np.int32)
        return dict(state, lookup_tokens=state["lookup_tokens"].at[rows].set(tokens),
                    lookup_len=state["lookup_len"].at[rows].set(lengths))

    def compile_row_starts(self, target_params, longest_prompt: int) -> None:
        self.inner.compile_row_starts(target_params, longest_prompt)

    def draft(self, target_params, params, state, target_cache=None):
        import jax
        import jax.numpy as jnp

        drafts, draft_len, probs, state = self.inner.draft(target_params, params, state, target_cache)
        found, found_len = self.lookup(state["lookup_tokens"], state["lookup_len"])
        use = found_len == self.k
        drafts = jnp.where(use[:, None], found.astype(drafts.dtype), drafts)
        draft_len = jnp.where(use, found_len.astype(draft_len.dtype), draft_len)
        if probs is not None:  # lookup's drafts are certain: a point mass
            probs = jnp.where(use[:, None, None], jax.nn.one_hot(drafts, probs.shape[-1], dtype=probs.dtype), probs)
        return drafts, draft_len, probs, state

    def observe(self, params, state, hidden, emitted, count, start):
        import jax.numpy as jnp

        state = self.inner.observe(params, state, hidden, emitted, count, start)
        rows = jnp.arange(emitted.shape[0])[:, None]
        positions = start[:, None] + 1 + jnp.arange(emitted.shape[1])
        return dict(state, lookup_tokens=state["lookup_tokens"].at[rows, positions].set(emitted.astype(jnp.int32),
                                                                                        mode="drop"),
                    lookup_len=jnp.where(count > 0, start + 1 + count, state["lookup_len"]).astype(jnp.int32))
