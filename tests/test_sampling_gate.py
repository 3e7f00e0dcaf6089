"""The sampling gate passes both frameworks' rules, and fails rules that are not lossless."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specdec.gates import (
    chi_square_sf,
    chi_square_test,
    check_sampling_rule,
    framework_rules,
    gate_sampling,
    sampling_cases,
)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_gate_sampling_passes(framework):
    pytest.importorskip(framework)
    results = gate_sampling(framework)
    failed = {r.name: r.detail for r in results if not r.passed}
    assert not failed, failed
    assert len(results) == len(sampling_cases()) + 1


@pytest.mark.parametrize(
    "statistic,dof,want",
    [
        (3.0, 2, math.exp(-1.5)),
        (0.7, 1, math.erfc(math.sqrt(0.35))),
        (9.0, 4, math.exp(-4.5) * (1 + 4.5)),
        (100.0, 100, 0.48119168452795674),  # reference values from scipy.stats.chi2.sf
        (50.0, 10, 2.669083424904495e-07),
        (12.0, 3, 0.007383160505359769),
    ],
)
def test_chi_square_sf(statistic, dof, want):
    assert chi_square_sf(statistic, dof) == pytest.approx(want, rel=1e-9)


def test_chi_square_test_fails_a_count_in_a_zero_probability_cell():
    result = chi_square_test(np.array([[500, 499, 1]]), np.array([[500.0, 500.0, 0.0]]))
    assert result["impossible"] == 1 and result["p_value"] == 0.0


def test_chi_square_test_pools_small_cells():
    # Expected 2 and 3 pool into one cell of 5; an empty stratum adds nothing.
    observed = np.array([[95, 3, 2], [0, 0, 0]])
    expected = np.array([[95.0, 3.0, 2.0], [0.0, 0.0, 0.0]])
    result = chi_square_test(observed, expected)
    assert result["dof"] == 1 and result["statistic"] == 0.0 and result["p_value"] == 1.0


# --- negative controls: the gate must be able to fail ------------------------------------------

def sample_rows(probs: np.ndarray, rng) -> np.ndarray:
    probs = probs.astype(np.float64)
    cumulative = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    return np.minimum((rng.random((len(probs), 1)) > cumulative).sum(-1), probs.shape[-1] - 1)


def rows_at(target_logits: np.ndarray, index: np.ndarray) -> np.ndarray:
    return target_logits[np.arange(len(index)), index]


def always_accept(warp):
    """Keeps every draft; the bonus is sampled correctly."""
    def accept(draft_tokens, draft_len, draft_probs, target_logits, params, seed):
        bonus_probs = warp(rows_at(target_logits, draft_len), params)
        return draft_len, sample_rows(bonus_probs, np.random.default_rng(seed))
    return accept


def resample_from_target_after_rejection(accept_sampled, warp):
    """The correct accept test, but corrections drawn from p instead of max(0, p - q)."""
    def accept(draft_tokens, draft_len, draft_probs, target_logits, params, seed):
        num_accepted, next_token = accept_sampled(
            draft_tokens, draft_len, draft_probs, target_logits, params, seed)
        resampled = sample_rows(warp(rows_at(target_logits, num_accepted), params),
                                np.random.default_rng(seed))
        return num_accepted, np.where(num_accepted < draft_len, resampled, next_token)
    return accept


def case_named(name):
    return next(case for case in sampling_cases() if case.name == name)


def test_always_accepting_fails_the_gate():
    _, warp = framework_rules("torch")
    result = check_sampling_rule(case_named("uniform_draft"), always_accept(warp), warp,
                                 draws=20_000, seed=0)
    assert not result.passed and result.detail["p_value"] < 1e-12


def test_always_accepting_a_filtered_token_is_an_impossible_outcome():
    _, warp = framework_rules("torch")
    result = check_sampling_rule(case_named("point_mass_outside_top_k"), always_accept(warp),
                                 warp, draws=1_000, seed=0)
    assert not result.passed and result.detail["impossible"] > 0


def test_correcting_from_the_target_instead_of_the_residual_fails_the_gate():
    accept_sampled, warp = framework_rules("torch")
    wrong_rule = resample_from_target_after_rejection(accept_sampled, warp)
    result = check_sampling_rule(case_named("uniform_draft"), wrong_rule, warp,
                                 draws=100_000, seed=0)
    assert not result.passed, result.detail
