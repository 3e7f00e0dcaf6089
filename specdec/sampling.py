"""Sampling settings of one request, shared by the target and the drafter."""

from __future__ import annotations

from dataclasses import dataclass

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
