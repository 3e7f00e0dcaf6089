"""A small-model drafter: a Gemma of the same vocabulary (e.g. Gemma 4 E4B for 31B, or the target itself
for the self-draft gate) proposes k tokens autoregressively on its own engine.

The drafter's KV cache holds each row's context; after a cycle, the drafts the target accepted are
already in it, so the next proposal feeds only the tokens it has not seen (one or two) before drafting.
"""

from __future__ import annotations

import torch

from specdec.acceptance.torch_rule import warp_probs
from specdec.protocol import Draft
from specdec.sampling import SamplingParams
from specdec.verifiers.torch_engine import TorchEngine


class ModelDrafter:
    def __init__(self, engine: TorchEngine, sampling: SamplingParams = SamplingParams()):
        self.engine = engine
        self.vocab_size = engine.vocab_size
        self.sampling = sampling
        self.generator = None
        if not sampling.greedy:
            self.generator = torch.Generator(device=engine.device)
            self.generator.manual_seed((sampling.seed or 0) + 1)  # independent of the acceptance stream
        self.context: list[list[int]] = []
        self.cached: list[int] = []  # tokens of each row's context that sit in the drafter's cache
        self.drafted: list[list[int]] = []  # last proposal per row, the part fed into the cache

    def begin(self, prompts: list[list[int]]) -> None:
        self.engine.prefill(prompts)
        self.context = [list(p) for p in prompts]
        self.cached = [len(p) - 1 for p in prompts]
        self.drafted = [[] for _ in prompts]

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sampling.greedy:
            return logits.argmax(dim=-1), None
        probs = warp_probs(logits, self.sampling)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1), probs

    def propose(self, k: int) -> Draft:
        engine, device = self.engine, self.engine.device
        batch = len(self.context)
        feeds = [ctx[n:] for ctx, n in zip(self.context, self.cached)]
        width = max(len(f) for f in feeds)
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feeds], dtype=torch.long, device=device)
        feed_len = torch.tensor([len(f) for f in feeds], dtype=torch.long, device=device)
        engine.lengths.copy_(torch.tensor(self.cached, device=device))
        logits = engine.verify(tokens).logits  # rows past a row's feed are padding: stale, never read
        last = logits.gather(1, (feed_len - 1)[:, None, None].expand(batch, 1, logits.shape[-1])).squeeze(1)
        engine.commit(feed_len)
        drafts, probs = [], []
        for i in range(k):
            token, p = self._choose(last)
            drafts.append(token)
            probs.append(p)
            if i + 1 < k:
                last = engine.verify(token[:, None]).logits[:, -1]
                engine.commit(torch.ones_like(feed_len))
        draft_tokens = torch.stack(drafts, dim=1)
        self.drafted = draft_tokens[:, : k - 1].tolist()
        self.cached = [len(ctx) for ctx in self.context]
        return Draft(
            draft_tokens,
            torch.full((batch,), k, dtype=torch.long, device=device),
            None if self.sampling.greedy else torch.stack(probs, dim=1),
        )

    def observe(self, emitted: list[list[int]], hidden=None) -> None:
        for b, new in enumerate(emitted):
            fed = self.drafted[b]
            still_valid = 0  # drafts in the cache that the target kept, in order
            while still_valid < min(len(fed), len(new)) and fed[still_valid] == new[still_valid]:
                still_valid += 1
            self.cached[b] += still_valid
            self.context[b].extend(new)
