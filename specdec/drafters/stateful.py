"""Drafters that keep state on the device (an EAGLE-3 head's KV cache, a small model's KV cache, an MTP
assistant's last hidden state), seen from the host.

Each such drafter is a *device state* per framework, which the fused cycles run inside their compiled cycle
(torch's FusedCycle captures `draft` and `observe` in its CUDA graph; JAX's decode_step carries the state):

  torch: begin(prompts, prompt_hidden); begin_row(row, prompt, prompt_hidden[row]);
         draft() -> (tokens [B, k], draft_len [B], probs [B, k, V] | None);
         observe(hidden, emitted [B, k+1], count [B], start [B]); state() -> tensors a cycle advances;
         sampling; generator (a torch.Generator when it samples, else None)
  jax:   params, cache_key, sampling; init_state() -> a state of no request;
         begin(target_params, prompts, prompt_hidden) -> state;
         begin_rows(target_params, state, {row: prompt}, prompt_hidden) -> state;
         draft(target_params, params, state, target_cache) -> (tokens, draft_len, probs | None, state);
         observe(params, state, hidden, emitted, count, start) -> state;
         host_draft(target_params, target_cache) / host_observe(...) over a state kept on the object;
         compile_row_starts(target_params, longest_prompt): compile what begin_rows runs for any prompt up to
         that long, so that a server's first request of a length pays no compile (its warm-up)

`begin` starts every row; `begin_row` / `begin_rows` start a server's newly admitted rows (the cycles' `admit`) and
leave every other row's state as it is: its cache rows (but for what lies past a row's context, as pads a JAX model
drafter's prefill runs there, overwritten before anything reads them), features, tokens and counts. `prompt_hidden` is
the verifier's `prefill_hidden` (per row, the hidden states of its `hidden_layers` at the committed prompt positions),
which `prefill` and `prefill_row`/`prefill_rows` leave.

`observe` follows a verify from positions `start` (the committed lengths before it) whose first `count`
rows were kept (accepted drafts + 1; 0: the row did not advance); `hidden` are the verify's hidden states
of the verifier's `hidden_layers`. StatefulDrafter drives the same functions from the host loop
(specdec.generate.HostCycle), so host and fused cycles draft alike. A sampling drafter draws from a random
stream of its own, seeded by `draft_seed` apart from the acceptance rule's (torch: its generator; JAX: a key in
its state, `next_draft_keys`): host and fused cycles then draw the same numbers. That stream is the batch's, so a
server, whose rows carry their own settings and seeds, drafts greedily (SamplingParams()): argmax drafts with no
probabilities, which every row's acceptance takes as a point mass, lossless for sampled rows too.
"""

from __future__ import annotations

import functools

import numpy as np

from specdec.errors import SpecdecError
from specdec.protocol import Draft


def draft_seed(seed: int | None) -> int:
    """The seed of a sampling drafter's random stream: the request's (None: 0), moved away from the acceptance
    rule's own stream, which starts from the same request seed; drafts and acceptance tests must draw
    independent numbers or the output distribution would shift."""
    return ((seed or 0) + 0x5DEECE66D) % (1 << 31)


def draft_key(seed: int | None):
    """JAX: the key a drafter's state starts with."""
    import jax

    return jax.random.PRNGKey(draft_seed(seed))


def next_draft_keys(state: dict):
    """JAX: (the state's key for the next cycle, the key of draft step j of this one for each j: a function)."""
    import jax

    carry, base = jax.random.split(state["key"])
    return carry, lambda j: jax.random.fold_in(base, j)


class JaxHostDriven:
    """Base of the JAX device states: `host_draft` and `host_observe` run their pure `draft` and `observe`
    compiled, over a state kept on the object (`begin` sets it), for the host-driven cycle."""

    state: dict | None = None

    @functools.cached_property
    def _host_draft(self):
        import jax

        return jax.jit(self.draft, donate_argnums=2)

    @functools.cached_property
    def _host_observe(self):
        import jax

        return jax.jit(self.observe, donate_argnums=1)

    def host_draft(self, target_params, target_cache=None):
        draft, draft_len, probs, self.state = self._host_draft(target_params, self.params, self.state, target_cache)
        return draft, draft_len, probs

    def compile_row_starts(self, target_params, longest_prompt: int) -> None:
        """Nothing by default: a state whose begin_rows runs no program shaped by the prompt's length (an MTP
        assistant's rows are set in place; a model drafter prefills through its engine's fixed-width forward)."""

    def host_observe(self, hidden, emitted, count, start) -> None:
        import jax.numpy as jnp

        self.state = self._host_observe(self.params, self.state, hidden, jnp.asarray(emitted), jnp.asarray(count),
                                        jnp.asarray(start))


class StatefulDrafter:
    """specdec.protocol.Drafter (and DeviceDrafter) over a device state built for one verifier and k."""

    needs_hidden = False  # whether observe needs the verifier's hidden states
    stateful = True  # specdec.protocol.DeviceDrafter: its device function is a state over every row

    def __init__(self, device, verifier, k: int, vocab_size: int, name: str):
        self.device, self.verifier, self.k, self.vocab_size, self.name = device, verifier, k, vocab_size, name
        self.framework = verifier.framework
        if vocab_size != verifier.vocab_size:
            raise SpecdecError(f"{name}: drafter vocabulary of {vocab_size} tokens, target's {verifier.vocab_size}")

    def device_draft_fn(self, framework: str, k: int):
        """The drafting state the fused cycles run (specdec.protocol.DeviceDrafter): stateful, built for k."""
        if framework != self.framework or k != self.k:
            raise SpecdecError(f"this {self.name} drafter was built for {self.framework} with k={self.k}")
        return self.device

    def begin(self, prompts: list[list[int]]) -> None:
        self.lengths = [len(p) - 1 for p in prompts]
        if self.framework == "jax":
            self.device.begin(self.verifier.params, prompts, self.verifier.prefill_hidden)
        else:
            self.device.begin(prompts, self.verifier.prefill_hidden)

    def propose(self, k: int) -> Draft:
        if k != self.k:
            raise SpecdecError(f"this {self.name} drafter was built for k={self.k}, asked for {k}")
        if self.framework == "jax":
            return Draft(*self.device.host_draft(self.verifier.params, self.verifier.cache))
        import torch

        with torch.inference_mode():
            return Draft(*self.device.draft())

    def observe(self, emitted: list[list[int]], hidden=None) -> None:
        if hidden is None and self.needs_hidden:
            raise SpecdecError(f"the {self.name} drafter needs the verifier's hidden states")
        rows = np.zeros((len(emitted), self.k + 1), np.int64)
        for b, tokens in enumerate(emitted):
            rows[b, : len(tokens)] = tokens
        count = np.array([len(t) for t in emitted])
        start = np.array(self.lengths)
        self.lengths = [n + c for n, c in zip(self.lengths, count)]
        if self.framework == "jax":
            self.device.host_observe(hidden, rows, count, start)
            return
        import torch

        as_t = lambda a: torch.as_tensor(a, device=self.verifier.device)  # noqa: E731
        with torch.inference_mode():
            self.device.observe(hidden, as_t(rows), as_t(count), as_t(start))
