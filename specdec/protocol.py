"""The draft/verify protocol every drafter and both engines implement (see docs/design.md, "The cycle").

State per row: committed tokens (in the verifier's KV cache) and one pending token (emitted, not yet in
the cache). A cycle:
  1. draft = drafter.propose(k)                    up to k tokens per row (+ draft probabilities if sampled)
  2. out = verifier.verify([pending] + draft)      logits of all k+1 rows; hidden states of tapped layers
  3. accepted, next = accept(draft, out.logits)    longest accepted prefix, then the target's own token
  4. verifier.commit(accepted + 1); drafter.observe(...); emit; pending = next

Arrays are framework arrays (torch tensors or jax arrays) of fixed shape: a row with fewer drafts than
k pads its draft and says how many are real in `lengths`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

DEFAULT_DRAFTS = 4  # draft tokens per cycle where a user names none (`specdec generate`'s --k)

Array = Any  # torch.Tensor or jax.Array


@dataclass
class Draft:
    tokens: Array  # [B, k] int, padded past `lengths`
    lengths: Array  # [B] int, real drafts per row (0..k)
    probs: Array | None = None  # [B, k, V] float draft distributions; None = deterministic (point mass)


@dataclass
class VerifyOutput:
    logits: Array  # [B, T, V] float32 target logits for every verified row
    hidden: Array | None = None  # [B, T, n_taps, H] hidden states after the requested layers


@runtime_checkable
class Verifier(Protocol):
    """The target model, owning a static KV cache. Positions are absolute; rows advance independently."""

    framework: str  # "torch" or "jax": which device drafters and fused cycles it takes
    vocab_size: int
    k_max: int  # most drafts one verify takes (T = k + 1 <= k_max + 1)
    width: int  # rows a decode forward runs and writes (>= k_max + 1; pads after the real tokens)
    max_seq_len: int  # positions the cache holds
    hidden_layers: tuple[int, ...]  # layers whose hidden states verify returns

    def prefill(self, prompts: list[list[int]]) -> Array:
        """Start one request per row: commit each prompt but its last token and return nothing;
        the last prompt token becomes the row's pending token."""
        ...

    def prefill_row(self, row: int, prompt: list[int]) -> Array:
        """Start a request in one row while the other rows keep theirs (continuous batching); returns
        its pending token [1]."""
        ...

    def verify(self, tokens: Array) -> VerifyOutput:
        """Run tokens [B, T] (pending + drafts) at each row's next positions. Their keys/values enter
        the cache, but only `commit` makes them part of the context."""
        ...

    def commit(self, num_tokens: Array) -> None:
        """Advance each row by num_tokens [B] (accepted drafts + 1): the rest of the last verify is
        rolled back (overwritten by the next one)."""
        ...


@runtime_checkable
class Drafter(Protocol):
    vocab_size: int | None  # None: works on any vocabulary (n-gram)

    def begin(self, prompts: list[list[int]]) -> None:
        """Start one request per row."""
        ...

    def propose(self, k: int) -> Draft:
        """Up to k draft tokens per row, continuing each row's context (prompt + emitted tokens)."""
        ...

    def observe(self, emitted: list[list[int]], hidden: Array | None = None) -> None:
        """Tokens emitted per row this cycle (accepted drafts + the target's token), and the target's
        hidden states of the verified rows when the verifier was asked for them."""
        ...


class DraftFn(Protocol):
    """A stateless device drafter (n-gram lookup): a pure function of the device token buffer, run inside a fused
    cycle (one CUDA graph replay per cycle, or a JAX loop) with fixed shapes and no host synchronisation.
    tokens[b, :context_len[b]] is row b's context (prompt + emitted, the pending token last); k is fixed when the
    function is made."""

    def __call__(self, tokens: Array, context_len: Array) -> tuple[Array, Array]:
        """-> (draft [B, k], draft_len [B])."""
        ...


@runtime_checkable
class DeviceState(Protocol):
    """A stateful device drafter (an EAGLE-3 head's, a model drafter's or an MTP assistant's state on the device):
    the cycle begins it, drafts from it and updates it after each verify, over every row. Each framework's full
    method list is in specdec.drafters.stateful."""

    sampling: Any  # SamplingParams of its drafts: greedy drafts are a point mass for every row's rule

    def begin(self, *args) -> Any: ...

    def draft(self, *args) -> Any: ...

    def observe(self, *args) -> Any: ...


DeviceDraftFn = DraftFn | DeviceState  # what DeviceDrafter.device_draft_fn gives the fused cycles


def is_device_state(draft_fn: DeviceDraftFn | None) -> bool:
    """Whether a fused cycle's drafter is a device state (DeviceState) rather than a function (DraftFn)."""
    return isinstance(draft_fn, DeviceState)


class LoadedDrafter(Protocol):
    """A drafter kind's files, read once and checked against one target (specdec.drafters.registry): what the
    target must be loaded with, and the drafter built for any verifier of it."""

    taps: tuple[int, ...]  # target layers whose hidden states the drafter reads
    samples_drafts: bool  # whether a sampled run draws its drafts from the drafter's own distribution

    def build(self, verifier: Verifier, k: int, sampling) -> Drafter:
        """The drafter for this verifier, proposing up to k tokens a cycle under these sampling settings."""
        ...


@runtime_checkable
class DeviceDrafter(Drafter, Protocol):
    # False: the device function drafts from the token buffer alone (n-gram). True: it is a device state
    # (specdec.drafters.stateful) that the cycle begins, drafts from and updates after each verify, over every row.
    stateful: bool

    def device_draft_fn(self, framework: str, k: int) -> DeviceDraftFn:
        """The drafter as a device function for "torch" or "jax", proposing up to k tokens."""
        ...
