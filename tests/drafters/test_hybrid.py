"""n-gram lookup first, a head elsewhere (`ngram+KIND=DIR`, specdec.drafters.hybrid): each cycle a row drafts
lookup's continuation where lookup finds K tokens after a match of 2 or more, else the head's drafts, which the head
computes from the whole context as if it had drafted every cycle; greedy output is plain decoding's on both engines,
host and fused; sampled drafts keep the target's distribution with lookup's rows a point mass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specdec.drafters.eagle3 import save_head
from specdec.drafters.hybrid import JaxHybrid
from specdec.drafters.ngram import ngram_propose
from specdec.drafters.registry import DrafterSource
from specdec.engines.cycle_jax import JaxFusedCycle
from specdec.engines.verifier_jax import JaxEngine
from specdec.generate import HostCycle, StopCondition, run_cycles
from specdec.sampling import SamplingParams
from tests.drafters.test_eagle3 import (DRAWS, GATE_K, GATE_SAMPLING, K, PROMPTS, VARIANT, aligned_head,  # noqa: F401
                                        as_p_eagle, cycle_of,
                                        gate_prompt, head, jax_engine, model, parallel_head,
                                        reference_parallel_drafts, target_cfg, torch_engine)


@pytest.fixture(scope="module")
def hybrid(parallel_head, random_checkpoints, tmp_path_factory):
    """`ngram+peagle=DIR` for the random gemma3 target: the P-EAGLE head behind n-gram lookup."""
    path = save_head(tmp_path_factory.mktemp("hybrid") / "head", parallel_head.cfg, parallel_head.params,
                     parallel_head.d2t, parallel_head.t2d)
    return DrafterSource(f"ngram+peagle={path}", random_checkpoints[VARIANT])


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("fused", [False, True])
def test_each_row_drafts_lookups_continuation_where_it_finds_one_else_the_heads(model, parallel_head, hybrid,
                                                                               random_checkpoints, framework, fused):
    engine = torch_engine(model, parallel_head, batch=1) if framework == "torch" else \
        jax_engine(random_checkpoints, parallel_head, batch=1)
    cycle = cycle_of(engine, hybrid.build(engine, K, SamplingParams()), fused)
    context = [2, 5, 6, 7, 41, 9, 3, 5, 6, 7]  # ends in a 3-gram seen before: lookup drafts the first cycle
    cycle.start([context], StopCondition(40))
    by = {"lookup": 0, "head": 0}
    for _ in range(12):
        result = cycle.step()
        found = ngram_propose(context, K, 2, 3)
        expected = found if len(found) == K else reference_parallel_drafts(model, parallel_head, context, K)
        by["lookup" if len(found) == K else "head"] += 1
        assert [int(t) for t in result.draft_tokens[0, : result.draft_len[0]]] == expected
        context += result.emitted(0)
    assert by["lookup"] > 0 and by["head"] > 0, by  # both branches ran
    tokens, length = lookup_buffer(cycle)  # what the next lookup reads: the whole context, the pending token last
    assert tokens[:length] == context


def lookup_buffer(cycle) -> tuple[list[int], int]:
    """Row 0 of the token buffer a cycle's hybrid looks up in, and its length."""
    if isinstance(cycle, HostCycle):
        device = cycle.drafter.device
        state = device.state if isinstance(device, JaxHybrid) else None
    elif isinstance(cycle, JaxFusedCycle):
        device, state = cycle.draft_fn, cycle.state.drafter
    else:
        device, state = cycle.drafter, None
    if state is not None:
        return np.asarray(state["lookup_tokens"][0]).tolist(), int(state["lookup_len"][0])
    return device.tokens[0].tolist(), int(device.context_len[0])


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("fused", [False, True])
def test_greedy_hybrid_is_plain_decoding(model, parallel_head, hybrid, random_checkpoints, framework, fused):
    engine = torch_engine(model, parallel_head) if framework == "torch" else jax_engine(random_checkpoints, parallel_head)
    plain = run_cycles(HostCycle(engine, None, 0, SamplingParams()), PROMPTS, 0, StopCondition(24)).tokens
    gen = run_cycles(cycle_of(engine, hybrid.build(engine, K, SamplingParams()), fused), PROMPTS, K, StopCondition(24))
    assert gen.tokens == plain
    assert gen.stats.drafted == K * gen.stats.cycles


def test_sampling_gate_passes_a_hybrids_drafts(model, aligned_head, random_checkpoints, gate_prompt, tmp_path):
    """Rows that lookup drafts report a point mass, the others the head's sampled distributions (JAX, fused): the
    prompt ends in a repeated 3-gram, so lookup drafts the first cycle of every row."""
    from specdec import gates

    parallel = as_p_eagle(aligned_head, seed=9)
    path = save_head(tmp_path / "head", parallel.cfg, parallel.params, parallel.d2t, parallel.t2d)
    source = DrafterSource(f"ngram+peagle={path}", random_checkpoints[VARIANT])
    engine = JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, batch=DRAWS, max_seq_len=48,
                                       k_max=GATE_K, hidden_layers=source.taps)
    prompt = gate_prompt + gate_prompt[4:7]
    assert len(ngram_propose(prompt, GATE_K, 2, 3)) == GATE_K
    drafter = source.build(engine, GATE_K, GATE_SAMPLING)
    cycle = JaxFusedCycle(engine, drafter.device_draft_fn("jax", GATE_K), GATE_K, GATE_SAMPLING)
    result = gates.gate_sampled_speculation(cycle, prompt, GATE_K, GATE_SAMPLING, "jax/ngram+peagle")
    assert result.passed, result.detail
