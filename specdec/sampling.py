"""Sampling settings of one request, shared by the target and the drafter."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class SamplingParams:
    """Temperature, then top-k, then top-p, then min-p (Hugging Face's order).

    temperature == 0 means greedy. top_k == 0, top_p == 1 and min_p == 0 each switch their filter
    off. Frozen and hashable, so a JAX function can take it as a static argument.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise SpecdecError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecdecError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecdecError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise SpecdecError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_p_rest(self) -> float:
        """The top-p filter's threshold: tokens whose ascending cumulative probability is at most this go. 1 - top_p
        in double precision, as Hugging Face computes it; compared with float32 sums it rounds to float32 once.
        Per-row settings store this, not top_p: 1 - float32(top_p) is another float32 (0.10000002 for 0.9, not
        0.1), and a token summing to between the two would be kept by one and dropped by the other."""
        return 1 - self.top_p

    @property
    def filters(self) -> frozenset[str]:
        """The filters these settings switch on."""
        on = {"top_k": self.top_k > 0, "top_p": self.top_p < 1, "min_p": self.min_p > 0}
        return frozenset(name for name, used in on.items() if used and not self.greedy)

    def row_seeds(self, batch: int) -> list[int]:
        """The seed each row of a batch draws with: the request's (None: 0) + the row, so rows differ."""
        return [((self.seed or 0) + b) % 2**64 for b in range(batch)]


def seed_words(seeds: list[int]) -> np.ndarray:
    """Seeds [B] (below 2^64) as the acceptance rules' keys: [B, 2] 32-bit words (low, high), int64 (torch
    holds them so; JAX takes them as uint32)."""
    seeds = np.asarray([s % 2**64 for s in seeds], np.uint64)
    return np.stack([seeds & np.uint64(0xFFFFFFFF), seeds >> np.uint64(32)], axis=1).astype(np.int64)
