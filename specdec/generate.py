"""The speculative loop (docs/design.md, "The cycle") and its statistics.

One loop serves both engines and every drafter; with k = 0 each cycle is a plain one-token decode.
Per cycle there is one host synchronisation: reading the accepted counts and the next tokens, which the
host needs anyway to stream text and to honour EOS, stop strings and max tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from specdec.errors import SpecdecError
from specdec.protocol import Draft, Drafter, Verifier
from specdec.sampling import SamplingParams, seed_words


@dataclass
class SpecStats:
    """Counts over a generation (summed over rows), with vLLM's definitions: tau = tokens emitted per
    verify cycle (accepted + 1); acceptance at position i = drafts accepted at i / cycles that drafted
    at i. tok/s counts the tokens kept (after stop conditions) over the decoding time: prefill, and the
    set-up before it (loading, compiling, capturing), are timed apart. Cycles that ran in one device call
    with the prefill (JAX's fused cycle) are in the output and tau but not in tok/s: their time is prefill's."""

    k: int
    cycles: int = 0
    emitted: int = 0
    kept: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    rejected_at: list[int] = field(default_factory=list)  # row 0's emitted-token index of each rejected draft
    untimed_kept: int = 0  # of `kept`, those of cycles timed with the prefill
    timed_device_cycles: int = 0  # cycles the device ran within decode_s (a JAX call runs 8, the last past the end)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    baseline_tok_s: float | None = None  # plain decoding on the same engine and path (compare_plain)
    load_s: float | None = None  # set-up, when the caller timed it
    compile_s: float | None = None
    compile_cache: str = ""  # "cache hit", "cache miss", ... where the framework reports it

    def __post_init__(self):
        self.drafted_at = self.drafted_at or [0] * self.k
        self.accepted_at = self.accepted_at or [0] * self.k

    def record(self, draft_len: int, num_accepted: int, emitted: int, kept: int, first_index: int | None = None,
               timed: bool = True) -> None:
        """One row's cycle; `first_index` (row 0 only) is the index its first emitted token takes; `timed`:
        its time is in decode_s, not prefill_s."""
        if first_index is not None and num_accepted < draft_len:
            self.rejected_at.append(first_index + num_accepted)
        self.cycles += 1
        self.emitted += emitted
        self.kept += kept
        if not timed:
            self.untimed_kept += kept
        self.drafted += draft_len
        self.accepted += num_accepted
        for i in range(draft_len):
            self.drafted_at[i] += 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    @property
    def tau(self) -> float:
        return self.emitted / self.cycles if self.cycles else 0.0

    @property
    def num_drafts(self) -> int:
        """Row cycles that drafted at least one token (vLLM's spec_decode_num_drafts)."""
        return self.drafted_at[0] if self.k else 0

    def spec_decode_summary(self) -> dict:
        """vLLM's spec_decode counters over these cycles, and its mean acceptance length (1 + accepted drafts per
        cycle that drafted)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.drafted, "num_accepted_tokens": self.accepted,
                "num_accepted_tokens_per_pos": list(self.accepted_at),
                "mean_acceptance_length": 1 + self.accepted / self.num_drafts if self.num_drafts else 1.0}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tok_s(self) -> float:
        return (self.kept - self.untimed_kept) / self.decode_s if self.decode_s else 0.0

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def speedup(self) -> float | None:
        return self.tok_s / self.baseline_tok_s if self.baseline_tok_s else None

    def as_dict(self) -> dict:
        return {
            "k": self.k, "cycles": self.cycles, "emitted": self.emitted, "kept": self.kept, "drafted": self.drafted,
            "accepted": self.accepted, "tau": self.tau, "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance, "tok_s": self.tok_s,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "baseline_tok_s": self.baseline_tok_s,
            "speedup": self.speedup, "load_s": self.load_s, "compile_s": self.compile_s,
            "compile_cache": self.compile_cache,
        }

    def summary(self) -> str:
        """One line, set-up apart from decoding: "loaded 1.1 s · compiled 2.9 s (cache hit) · prefill 9 ms ·
        128 tokens at 1,180 tok/s · tau 2.80 · acceptance 0.45 [0.62 0.41 0.30 0.22]"."""
        parts = []
        if self.load_s is not None:
            parts.append(f"loaded {self.load_s:.1f} s")
        if self.compile_s is not None:
            parts.append(f"compiled {self.compile_s:.1f} s" + (f" ({self.compile_cache})" if self.compile_cache else ""))
        parts.append(f"prefill {self.prefill_s * 1e3:.0f} ms")
        if self.kept and self.kept == self.untimed_kept:  # one JAX call held the prefill and every token
            parts.append(f"{self.kept} tokens, all within the prefill's time")
        else:
            parts.append(f"{self.kept} tokens at {self.tok_s:,.0f} tok/s")
        if self.k:
            per_pos = " ".join(f"{a:.2f}" for a in self.per_position_acceptance)
            parts.append(f"tau {self.tau:.2f} · acceptance {self.acceptance_rate:.2f} [{per_pos}]")
        if self.speedup is not None:
            parts.append(f"{self.speedup:.2f}x plain decoding ({self.baseline_tok_s:,.0f} tok/s)")
        return " · ".join(parts)


@dataclass
class Generation:
    tokens: list[list[int]]  # emitted tokens per row (stop tokens included, stop strings cut)
    stats: SpecStats


class _Ops:
    """The few array operations the loop needs, for torch tensors or jax arrays."""

    def __init__(self, verifier: Verifier, sampling: SamplingParams):
        self.sampling = sampling
        self.jax = verifier.framework == "jax"
        if self.jax:
            import jax
            import jax.numpy as jnp

            from specdec.acceptance import rule_jax as rule

            self.xp = jnp
            # Compiled once per shape: the rules run every cycle.
            self.accept_greedy = jax.jit(rule.accept_greedy)
            self.accept_sampled = jax.jit(rule.accept_sampled, static_argnames="params")
            self.keyed_uniform = jax.jit(rule.keyed_uniform, static_argnums=2)
        else:
            import torch

            from specdec.acceptance import rule_torch as rule

            self.xp = torch
            self.accept_greedy, self.accept_sampled = rule.accept_greedy, rule.accept_sampled
            self.keyed_uniform = rule.keyed_uniform
            self.device = verifier.device

    def on_device(self, draft: Draft) -> Draft:
        """A host drafter's numpy arrays as the verifier's arrays."""
        if self.jax:
            xp = self.xp
            probs = None if draft.probs is None else xp.asarray(draft.probs)
            return Draft(xp.asarray(draft.tokens, xp.int32), xp.asarray(draft.lengths, xp.int32), probs)
        as_t = lambda a, dt=None: self.xp.as_tensor(a, dtype=dt, device=self.device)  # noqa: E731
        probs = None if draft.probs is None else as_t(draft.probs)
        return Draft(as_t(draft.tokens, self.xp.long), as_t(draft.lengths, self.xp.long), probs)

    def tokens_with_pending(self, pending, draft: Draft):
        if self.jax:
            return self.xp.concatenate([pending[:, None].astype(draft.tokens.dtype), draft.tokens], axis=1)
        return self.xp.cat([pending[:, None], draft.tokens], dim=1)

    def accept(self, draft: Draft, logits, seeds=None, positions=None):
        """The batch's acceptance; sampled, row b draws with seeds[b] at positions[b] (specdec.acceptance)."""
        if self.sampling.greedy:
            return self.accept_greedy(draft.tokens, draft.lengths, logits)
        uniform = self.keyed_uniform(seeds, positions, draft.tokens.shape[1] + 1)
        return self.accept_sampled(draft.tokens, draft.lengths, draft.probs, logits, self.sampling, uniform)

    def seeds(self, seeds: list[int]):
        """Seeds as the rule's keys on the device (specdec.sampling.seed_words)."""
        words = seed_words(seeds)
        if self.jax:
            return self.xp.asarray(words, self.xp.uint32)
        return self.xp.as_tensor(words, device=self.device)

    def empty_draft(self, batch: int) -> Draft:
        if self.jax:
            return Draft(self.xp.zeros((batch, 0), self.xp.int32), self.xp.zeros((batch,), self.xp.int32))
        zeros = self.xp.zeros((batch, 0), dtype=self.xp.long, device=self.device)
        return Draft(zeros, self.xp.zeros(batch, dtype=self.xp.long, device=self.device))

    def as_array(self, values: np.ndarray):
        """A small host array as the verifier's (to scale per-row device values)."""
        if self.jax:
            return self.xp.asarray(values, self.xp.int32)
        return self.xp.as_tensor(values, dtype=self.xp.long, device=self.device)

    def to_host(self, *arrays) -> list[np.ndarray]:
        """Bring small per-row arrays to the host in one transfer (one synchronisation)."""
        if self.jax:
            import jax

            return [np.asarray(a) for a in jax.device_get(arrays)]
        flat = self.xp.cat([a.reshape(a.shape[0], -1).long() for a in arrays], dim=1).cpu().numpy()
        widths = np.cumsum([int(np.prod(a.shape[1:])) for a in arrays])[:-1]
        return [part.reshape(a.shape) for part, a in zip(np.split(flat, widths, axis=1), arrays)]


class StopCondition:
    """EOS ids, stop strings and a token budget, applied to each row's emitted tokens in order, so a
    stop inside an accepted draft ends the row there."""

    def __init__(self, max_new_tokens: int, eos_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                 decode: Callable[[list[int]], str] | None = None):
        if max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_strings and decode is None:
            raise SpecdecError("stop strings need a tokenizer")
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set(eos_ids)
        self.stop_strings = tuple(stop_strings)
        self.decode = decode

    def take(self, row: list[int], new: list[int]) -> tuple[list[int], bool]:
        """How many of `new` the row keeps, and whether it is finished."""
        kept = []
        for token in new:
            kept.append(token)
            if token in self.eos_ids or len(row) + len(kept) >= self.max_new_tokens:
                return kept, True
            if self.stop_strings and any(s in self.decode(row + kept) for s in self.stop_strings):
                return kept, True
        return kept, False


@dataclass
class CycleResult:
    """One draft/verify/accept cycle, on the host: per row, what was drafted and what was emitted."""

    num_accepted: np.ndarray  # [B]
    next_token: np.ndarray  # [B]
    draft_tokens: np.ndarray  # [B, k]
    draft_len: np.ndarray  # [B]

    def emitted(self, b: int) -> list[int]:
        return [int(t) for t in self.draft_tokens[b, : self.num_accepted[b]]] + [int(self.next_token[b])]


class HostCycle:
    """draft (any drafter) -> verify -> accept on the verifier's device -> commit; one host sync."""

    decode_cycles_in_start = 0  # start prefills alone (run_cycles times it apart)

    def __init__(self, verifier: Verifier, drafter: Drafter | None, k: int, sampling: SamplingParams):
        self.verifier, self.drafter, self.k = verifier, drafter, k
        self.device_cycles = 0  # cycles run, one per step
        self.ops = _Ops(verifier, sampling)

    def start(self, prompts: list[list[int]], stop: StopCondition | None = None) -> None:
        """Prefill the prompts. A row that has emitted its token budget (`stop.max_new_tokens`) stops
        advancing: it rides along in the batch until every row is done, but commits nothing more, so it
        never runs past the context the budget was checked against."""
        self.batch = len(prompts)
        self.seeds = None if self.ops.sampling.greedy else self.ops.seeds(self.ops.sampling.row_seeds(self.batch))
        self.pending = self.verifier.prefill(prompts)
        self.positions = np.array([len(p) - 1 for p in prompts])  # of the pending tokens
        self.generated = np.zeros(self.batch, np.int64)
        self.budget = stop.max_new_tokens if stop is not None else np.iinfo(np.int64).max
        if self.drafter is not None:
            self.drafter.begin(prompts)

    def step(self) -> CycleResult:
        self.device_cycles += 1
        ops = self.ops
        live = self.generated < self.budget
        draft = ops.on_device(self.drafter.propose(self.k)) if self.k > 0 else ops.empty_draft(self.batch)
        out = self.verifier.verify(ops.tokens_with_pending(self.pending, draft))
        positions = None if self.seeds is None else ops.as_array(self.positions)
        num_accepted, self.pending = ops.accept(draft, out.logits, self.seeds, positions)
        self.verifier.commit((num_accepted + 1) * ops.as_array(live))
        result = CycleResult(*ops.to_host(num_accepted, self.pending, draft.tokens, draft.lengths))
        advance = np.where(live, result.num_accepted + 1, 0)
        self.generated += advance
        self.positions += advance
        if self.drafter is not None:
            self.drafter.observe([result.emitted(b) if live[b] else [] for b in range(self.batch)], out.hidden)
        return result

    def drain(self) -> None:
        """Nothing runs ahead of step here (a host drafter needs each cycle's tokens before the next)."""


def check_context(verifier: Verifier, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Every row's prompt and new tokens fit the verifier's context, with room for the rows a decode
    forward writes past the last one (drafts and pads, rolled back afterwards)."""
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens + verifier.width - 1 > verifier.max_seq_len:
        raise SpecdecError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens does not fit the context of"
            f" {verifier.max_seq_len} tokens ({verifier.width - 1} positions are kept for drafts)"
        )


def run_cycles(cycle, prompts: list[list[int]], k: int, stop: StopCondition,
               on_tokens: Callable[[int, list[int]], None] | None = None) -> Generation:
    """Cycle until every row meets its stop condition; `on_tokens(row, tokens)` streams each row's
    newly kept tokens. Finished rows ride along in the fixed-shape batch, their tokens dropped."""
    check_context(cycle.verifier, prompts, stop.max_new_tokens)
    batch = len(prompts)
    stats = SpecStats(k=k)
    rows: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    start = time.perf_counter()
    cycle.start(prompts, stop)
    synchronize(cycle.verifier)
    stats.prefill_s = time.perf_counter() - start
    untimed, device_cycles = cycle.decode_cycles_in_start, cycle.device_cycles
    start = time.perf_counter()
    while not all(done):
        result = cycle.step()
        timed, untimed = untimed <= 0, untimed - 1
        for b in range(batch):
            if done[b]:
                continue
            new = result.emitted(b)
            first_index = len(rows[b]) if b == 0 else None
            kept, done[b] = stop.take(rows[b], new)
            rows[b].extend(kept)
            stats.record(int(result.draft_len[b]), int(result.num_accepted[b]), len(new), len(kept), first_index, timed)
            if on_tokens is not None:
                on_tokens(b, kept)
    stats.decode_s = time.perf_counter() - start  # the last step read its results; a prefetched cycle is not timed
    stats.timed_device_cycles = cycle.device_cycles - device_cycles
    cycle.drain()
    return Generation(rows, stats)


def synchronize(verifier: Verifier) -> None:
    """Wait for the verifier's queued device work (for timing)."""
    if verifier.framework == "jax":
        import jax

        jax.block_until_ready(verifier.lengths)
    elif getattr(verifier, "device", None) is not None and verifier.device.type == "cuda":
        import torch

        torch.cuda.synchronize(verifier.device)


def speculative_generate(
    verifier: Verifier,
    drafter: Drafter | None,
    prompts: list[list[int]],
    k: int,
    stop: StopCondition,
    sampling: SamplingParams = SamplingParams(),
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> Generation:
    """Generate for each prompt until its stop condition. With drafter None or k = 0 every cycle is a
    plain one-token decode."""
    if k < 0 or k > verifier.k_max:
        raise SpecdecError(f"k={k} is outside 0..{verifier.k_max} (the engine's captured maximum)")
    if drafter is not None and drafter.vocab_size is not None and drafter.vocab_size != verifier.vocab_size:
        raise SpecdecError(f"drafter vocabulary ({drafter.vocab_size}) differs from the target's ({verifier.vocab_size})")
    if drafter is None:
        k = 0
    return run_cycles(HostCycle(verifier, drafter, k, sampling), prompts, k, stop, on_tokens)
