"""Continuous batching: `prefill_row` starts a request in one row while the other rows keep decoding, and
each request's greedy tokens are those it gets alone in the same engine (both engines)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engines.test_row_invariance import ENGINES, host

PROMPTS = [[2] + np.random.default_rng(seed).integers(3, 500, n).tolist() for seed, n in ((5, 13), (6, 30), (7, 4))]
STEPS = 24


def greedy_steps(engine, active: dict[int, int], pending, steps: int) -> dict[int, list[int]]:
    """Plain greedy decode of every row for `steps` forwards; only the `active` rows (row -> tokens to emit)
    commit and record, the rest ride along without advancing."""
    out = {row: [] for row in active}
    for _ in range(steps):
        logits = host(engine.verify(pending[:, None]).logits)[:, 0]
        nxt = logits.argmax(-1)
        commit = np.array([1 if row in active and len(out[row]) < active[row] else 0 for row in range(engine.batch)])
        for row in active:
            if len(out[row]) < active[row]:
                out[row].append(int(nxt[row]))
        engine.commit(_like(engine, commit))
        pending = np.where(commit == 1, nxt, host(pending))
        pending = _like(engine, pending)
    return out


def _like(engine, array):
    if hasattr(engine, "device"):
        import torch

        return torch.as_tensor(array, device=engine.device)
    import jax.numpy as jnp

    return jnp.asarray(array, jnp.int32)


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_a_request_joining_mid_decode_gets_its_solo_tokens(random_checkpoints, engine_name):
    path = random_checkpoints["gemma3"]
    engine = ENGINES[engine_name](path, "float32", batch=3)
    solo = {}
    for prompt_index, prompt in enumerate(PROMPTS):
        engine.prefill([PROMPTS[0]] * 3)  # other rows: some request, never advanced
        pending = host(engine.prefill_row(1, prompt)).reshape(1)
        pending = _like(engine, np.array([PROMPTS[0][-1], pending[0], PROMPTS[0][-1]]))
        solo[prompt_index] = greedy_steps(engine, {1: STEPS}, pending, STEPS)[1]

    # Row 0 decodes prompt 0; after 7 steps prompt 1 joins in row 2; after 5 more, row 0's request is
    # replaced by prompt 2 while row 2 goes on.
    engine.prefill([PROMPTS[0], PROMPTS[0], PROMPTS[0]])
    pending = host(engine.prefill_row(0, PROMPTS[0]))
    pending = _like(engine, np.array([pending[0], 0, 0]))
    first = greedy_steps(engine, {0: 7}, pending, 7)[0]
    pending = host(pending).copy()
    pending[0] = first[-1]
    pending[2] = host(engine.prefill_row(2, PROMPTS[1]))[0]
    both = greedy_steps(engine, {0: STEPS - 7, 2: STEPS}, _like(engine, pending), 5)
    assert first + both[0] == solo[0][:12]

    pending = host(pending).copy()
    pending[0] = host(engine.prefill_row(0, PROMPTS[2]))[0]
    pending[2] = both[2][-1]
    rest = greedy_steps(engine, {0: STEPS, 2: STEPS - 5}, _like(engine, pending), STEPS - 5)
    assert both[2] + rest[2] == solo[1]
    assert rest[0] == solo[2][: STEPS - 5]


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_prefill_row_refuses_bad_rows_and_prompts(random_checkpoints, engine_name):
    from specdec.errors import SpecdecError

    engine = ENGINES[engine_name](random_checkpoints["gemma3"], "float32", batch=2)
    with pytest.raises(SpecdecError, match="outside the engine's batch"):
        engine.prefill_row(2, PROMPTS[0])
    with pytest.raises(SpecdecError, match="empty prompt"):
        engine.prefill_row(0, [])
    with pytest.raises(SpecdecError, match="does not fit the context"):
        engine.prefill_row(0, [2] * 200)
