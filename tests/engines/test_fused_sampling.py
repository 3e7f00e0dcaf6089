"""Sampled decoding in the fused cycles (torch's FusedCycle, JaxFusedCycle, the JAX while_loop): the same
tokens as the host loop for a seed, seeds that reproduce and differ, filters that reach the sampler, the
end-to-end sampling gate, greedy unchanged; on CUDA, the sampled cycle captured as a graph."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specdec import gates
from specdec.drafters.ngram import NgramDrafter
from specdec.engines.cycle_jax import JaxFusedCycle
from specdec.engines.cycle_torch import FusedCycle
from specdec.engines.verifier_jax import JaxEngine
from specdec.engines.verifier_torch import TorchEngine
from specdec.generate import HostCycle, StopCondition, run_cycles
from specdec.models.gemma_torch import GemmaModel
from specdec.sampling import SamplingParams

VARIANT = "gemma3"  # this random checkpoint repeats itself, so n-gram drafts are often right
PROMPTS = [[2, 5, 6, 7, 5, 6, 7, 5, 6], [2, 9, 9, 9, 9]]
K = 3
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
FRAMEWORKS = ["torch", "jax"]

DRAWS = 2000  # rows of the sampling gate's batch
GATE_K = 2
GATE_SAMPLING = SamplingParams(temperature=0.7, top_k=8)  # few outcomes per position: every stratum well filled


@pytest.fixture(scope="module")
def model(random_checkpoints):
    return GemmaModel.from_checkpoint(random_checkpoints[VARIANT], max_seq_len=64)


@pytest.fixture(scope="module")
def engines(model, random_checkpoints):
    """framework -> a batch-2 engine, shared by the tests' cycles (each start prefills anew; JAX cycles of
    equal settings share its compiled step)."""
    return {
        "torch": TorchEngine(model, batch=2, max_seq_len=64, k_max=K),
        "jax": JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, batch=2, max_seq_len=64,
                                         k_max=K),
    }


def fused(engine, k: int, sampling: SamplingParams, **kwargs):
    """The engine's fused cycle with the device n-gram drafter (none at k = 0)."""
    framework, cycle_class = ("jax", JaxFusedCycle) if isinstance(engine, JaxEngine) else ("torch", FusedCycle)
    return cycle_class(engine, NgramDrafter().device_draft_fn(framework, k) if k else None, k, sampling, **kwargs)


def decode(cycle, k: int, n: int = 24, prompts=PROMPTS):
    return run_cycles(cycle, prompts, k, StopCondition(n))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("k", [0, K])
def test_greedy_fused_cycle_is_plain_decoding(engines, framework, k):
    engine = engines[framework]
    plain = decode(HostCycle(engine, None, 0, GREEDY), 0).tokens
    assert decode(fused(engine, k, GREEDY), k).tokens == plain


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("k", [0, K])
def test_sampled_fused_cycle_draws_what_the_host_loop_draws(engines, framework, k):
    """One seed, the same random numbers in the same order and the same logits: the fused cycle emits the
    host loop's tokens exactly, with the same drafts accepted."""
    engine = engines[framework]
    host = decode(HostCycle(engine, NgramDrafter() if k else None, k, SAMPLED), k)
    run = decode(fused(engine, k, SAMPLED), k)
    assert run.tokens == host.tokens
    assert run.stats.accepted_at == host.stats.accepted_at and run.stats.drafted_at == host.stats.drafted_at
    if k:
        assert 0 < host.stats.accepted < host.stats.drafted  # both acceptances and rejections were drawn


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_seeded_runs_reproduce_and_seeds_differ(engines, framework):
    engine = engines[framework]
    run = lambda cycle: decode(cycle, K, 16).tokens  # noqa: E731
    cycle = fused(engine, K, SamplingParams(1.0, seed=1))
    first = run(cycle)
    assert run(cycle) == first  # start reseeds: the cycle's next request draws the same numbers
    assert run(fused(engine, K, SamplingParams(1.0, seed=1))) == first
    assert run(fused(engine, K, SamplingParams(1.0, seed=2))) != first
    assert run(fused(engine, K, SamplingParams(1.0))) == run(fused(engine, K, SamplingParams(1.0, seed=0)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_filters_reach_the_fused_sampler(engines, framework):
    """At temperature 5 sampling wanders far from the greedy tokens; top-k 1, top-p 0.001 and min-p 0.999
    each leave only the most likely token (its probability is at least 1 / vocab > 0.001), so each filter
    alone brings the greedy tokens back."""
    engine = engines[framework]
    greedy = decode(fused(engine, K, GREEDY), K, 16).tokens
    assert decode(fused(engine, K, SamplingParams(5.0)), K, 16).tokens != greedy
    for only_the_top in (SamplingParams(5.0, top_k=1), SamplingParams(5.0, top_p=1e-3), SamplingParams(5.0, min_p=0.999)):
        assert decode(fused(engine, K, only_the_top), K, 16).tokens == greedy, only_the_top


def test_jax_cycles_of_any_temperature_or_seed_share_one_compiled_step(engines):
    """device_draft_fn makes a new functools.partial each call, and settings and seeds differ per request: the
    cycles share one jitted step, traced once greedy and once per set of filters in use, whatever the
    temperature, the filters' values or the seed."""
    engine = engines["jax"]
    settings = [SamplingParams(0.8, seed=1), SamplingParams(0.8, seed=2), SamplingParams(1.3, seed=9),
                SamplingParams(0.9, top_k=5, top_p=0.9), SamplingParams(0.5, top_k=7, top_p=0.6, seed=3)]
    cycles = [fused(engine, K, sampling) for sampling in settings]
    assert all(cycle._steps is cycles[0]._steps for cycle in cycles)
    loop = engine._loop_fn(NgramDrafter().device_draft_fn("jax", K))
    assert engine._loop_fn(NgramDrafter().device_draft_fn("jax", K)) is loop
    traced = []
    for cycle in cycles:
        decode(cycle, K, 8)
        traced.append(cycles[0]._steps._cache_size())
    assert traced[1:3] == traced[:1] * 2 and traced[4] == traced[3] <= traced[0] + 1


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_jax_cycles_per_call_change_nothing_but_dispatches(engines, sampling):
    """Eight cycles per compiled call emit what one per call emits; the device stops each row at its token
    budget, so the cycles run after a row's end commit nothing. The prompts prefill in one cycle of the same
    program, so 13 tokens take 1 + 13 calls of one cycle, or a call of the prefill cycle and 7 decode cycles
    and 6 of the next 8."""
    engine = engines["jax"]
    runs, dispatches = {}, {}
    for cycles in (1, 8):
        cycle = JaxFusedCycle(engine, None, 0, sampling, cycles_per_call=cycles, prefetch=False)
        before = engine.dispatches
        runs[cycles] = decode(cycle, 0, 13).tokens
        dispatches[cycles] = engine.dispatches - before
        assert np.asarray(engine.lengths).tolist() == [len(p) - 1 + 13 for p in PROMPTS]
    assert dispatches == {1: 1 + 13, 8: 2}
    assert runs[8] == runs[1] and all(len(t) == 13 for t in runs[1])
    k_runs = [decode(JaxFusedCycle(engine, NgramDrafter().device_draft_fn("jax", K), K, sampling, cycles), K).tokens
              for cycles in (1, 8)]
    assert k_runs[0] == k_runs[1]

def test_jax_fused_loop_samples_like_the_fused_cycle(random_checkpoints):
    """generate_fused (one while_loop) and JaxFusedCycle (one dispatch per cycle) run the same decode_step
    with the same key: the same tokens; seeds reproduce and differ."""
    engine = JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, max_seq_len=64, k_max=K)
    draft_fn = NgramDrafter().device_draft_fn("jax", K)
    looped = engine.generate_fused(PROMPTS[0], 30, draft_fn=draft_fn, sampling=SAMPLED)
    assert len(looped) == 30
    assert decode(fused(engine, K, SAMPLED), K, 30, PROMPTS[:1]).tokens == [looped]
    assert engine.generate_fused(PROMPTS[0], 30, draft_fn=draft_fn, sampling=SAMPLED) == looped
    other_seed = SamplingParams(SAMPLED.temperature, top_p=SAMPLED.top_p, seed=4)
    assert engine.generate_fused(PROMPTS[0], 30, draft_fn=draft_fn, sampling=other_seed) != looped


# --- the end-to-end sampling gate on the fused cycles ----------------------------------------------------


@pytest.fixture(scope="module")
def gate_prompt(model) -> list[int]:
    """A prompt ending in a run of tokens that the checkpoint continues: the n-gram drafter proposes the
    token the target most likely samples next, so drafts are both accepted and rejected."""
    base = [2, 159, 23, 41, 11]
    return base + TorchEngine(model, max_seq_len=64).greedy_decode(base, 16)


def gate_engine(framework: str, model, random_checkpoints, **torch_options):
    if framework == "jax":
        return JaxEngine.from_checkpoint(random_checkpoints[VARIANT], dtype=jnp.float32, batch=DRAWS, max_seq_len=32,
                                         k_max=GATE_K)
    return TorchEngine(model, batch=DRAWS, max_seq_len=32, k_max=GATE_K, **torch_options)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sampling_gate_passes_the_fused_cycle(model, random_checkpoints, gate_prompt, framework):
    cycle = fused(gate_engine(framework, model, random_checkpoints), GATE_K, GATE_SAMPLING)
    result = gates.gate_sampled_speculation(cycle, gate_prompt, GATE_K, GATE_SAMPLING, f"{framework}/fused")
    assert result.passed, result.detail
    assert 0.05 < result.detail["acceptance"] < 0.95  # accepted drafts and residual draws were both tested
    assert result.detail["first_tokens"] > 1



def test_sampling_gate_catches_a_fused_cycle_sampling_at_another_temperature(model, random_checkpoints, gate_prompt):
    """A planted fault: the cycle samples at temperature 1.0 while the request asked for GATE_SAMPLING's 0.7
    (a setting lost on its way into a captured cycle is one such bug). Greedy decoding cannot see it."""
    wrong = SamplingParams(1.0, GATE_SAMPLING.top_k)
    cycle = fused(gate_engine("torch", model, random_checkpoints), GATE_K, wrong)
    result = gates.gate_sampled_speculation(cycle, gate_prompt, GATE_K, GATE_SAMPLING, "torch/fused-fault")
    assert not result.passed, result.detail


def _lengths(engine) -> list[int]:
    return engine.lengths.tolist() if isinstance(engine, TorchEngine) else np.asarray(engine.lengths).tolist()


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_prefetch_changes_no_token(engines, framework, sampling):
    """A cycle launched before the host reads the last one's results emits what it would have emitted launched
    after, and the same cycles are counted. The one launched past the end runs out (JAX: one more call) but
    advances no row past its budget, and a second run of the same cycle object drops it."""
    engine = engines[framework]
    pays = engine.use_graphs if framework == "torch" else jax.default_backend() != "cpu"
    assert fused(engine, K, sampling).prefetch is pays  # the default: only where it pays (graphs, an accelerator)
    runs = {}
    for prefetch in (False, True):
        cycle = fused(engine, K, sampling, prefetch=prefetch)
        dispatches = getattr(engine, "dispatches", 0)
        first = decode(cycle, K, 13)
        dispatches = getattr(engine, "dispatches", 0) - dispatches
        lengths = _lengths(engine)  # a last cycle may accept past the budget, and keeps no more than it
        assert lengths == [len(p) - 1 + 13 for p in PROMPTS]
        again = decode(cycle, K, 13)
        assert again.tokens == first.tokens and again.stats.cycles == first.stats.cycles
        runs[prefetch] = first.tokens, first.stats.cycles, first.stats.timed_device_cycles, lengths, dispatches
    assert runs[True][:4] == runs[False][:4]
    assert len(runs[True][0][0]) == 13 and runs[True][1] > 1
    if framework == "jax":
        assert runs[True][4] == runs[False][4] + 1


def test_a_row_is_admitted_only_once_the_cycle_in_flight_is_collected(engines):
    from specdec.errors import SpecdecError

    cycle = fused(engines["torch"], K, GREEDY, prefetch=True)
    cycle.start(PROMPTS, StopCondition(8))
    cycle.step()
    for change in (lambda: cycle.admit(0, PROMPTS[0], 4), lambda: cycle.load_row(0, PROMPTS[0])):
        with pytest.raises(SpecdecError, match="collect it first"):
            change()
    assert cycle.collect() is not None and cycle.collect() is None
    cycle.admit(0, PROMPTS[0], 4)


# --- CUDA: the sampled cycle captured as one graph ---------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_sampled_cycle_reproduces_and_matches_eager(random_checkpoints):
    """Draws keyed by seed and position: every replay draws fresh numbers, two captures with one seed emit the
    same tokens, and the graphed cycle draws exactly what the eager one draws."""
    cuda_model = GemmaModel.from_checkpoint(random_checkpoints[VARIANT], dtype=torch.bfloat16, device="cuda",
                                            max_seq_len=1024)

    def run(graphs: bool, k: int, sampling: SamplingParams, cycle=None):
        cycle = cycle or fused(TorchEngine(cuda_model, batch=2, max_seq_len=1024, k_max=K, cuda_graphs=graphs), k,
                               sampling)
        return cycle, decode(cycle, k, 300).tokens

    for k in (0, K):
        cycle, graphed = run(True, k, SAMPLED)
        assert len(graphed[0]) == 300 and len(set(graphed[0])) > 20  # fresh numbers every replay
        assert run(True, k, SAMPLED)[1] == graphed  # a second capture
        assert run(True, k, SAMPLED, cycle)[1] == graphed  # a second request on the captured graph
        assert run(False, k, SAMPLED)[1] == graphed
        other_seed = SamplingParams(SAMPLED.temperature, top_p=SAMPLED.top_p, seed=4)
        assert run(True, k, other_seed)[1] != graphed


def rows_coming_and_going(engine) -> tuple[dict[int, list[int]], FusedCycle]:
    """A server's cycle: a greedy row, then a sampled row admitted beside it, then a top-p one, then the sampled
    rows retired, three cycles each -> (each row's tokens, the cycle)."""
    cycle = fused(engine, K, GREEDY, prefetch=False)
    for b in range(engine.batch):
        cycle.retire(b)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    admissions = [(0, GREEDY), (1, SamplingParams(1.0, seed=5)), (2, SamplingParams(0.8, top_p=0.9, seed=6))]
    live = []
    for phase in admissions + ["retire the sampled rows"]:
        if isinstance(phase, str):
            for b in (1, 2):
                cycle.retire(b)
            live = [0]
        else:
            row, sampling = phase
            cycle.admit(row, PROMPTS[row % 2], 200, sampling)
            live.append(row)
        for _ in range(3):
            result = cycle.step()
            for b in live:
                tokens[b] += result.emitted(b)
    return tokens, cycle


def test_rows_keep_their_tokens_as_rules_change_beside_them(random_checkpoints):
    """Each row's tokens are its solo run's, whatever rule the rows beside it need."""
    model = GemmaModel.from_checkpoint(random_checkpoints[VARIANT], max_seq_len=256)
    engine = TorchEngine(model, batch=3, max_seq_len=256, k_max=K)
    tokens, _ = rows_coming_and_going(engine)
    greedy = fused(engine, K, GREEDY, prefetch=False)
    for b in range(3):
        greedy.retire(b)
    greedy.admit(0, PROMPTS[0], 200)
    alone = []
    for _ in range(12):
        alone += greedy.step().emitted(0)
    assert tokens[0] == alone
    assert tokens[1] != tokens[0][: len(tokens[1])]  # sampled


@pytest.mark.gpu
def test_cuda_graph_rules_share_one_pool_and_match_eager(random_checkpoints):
    """Each rule the rows need is a graph of its own, the three sharing one memory pool: the tokens equal those of
    the same steps run eagerly."""
    cuda_model = GemmaModel.from_checkpoint(random_checkpoints[VARIANT], dtype=torch.bfloat16, device="cuda",
                                            max_seq_len=256)
    runs = [rows_coming_and_going(TorchEngine(cuda_model, batch=3, max_seq_len=256, k_max=K, cuda_graphs=graphs))
            for graphs in (False, True)]
    assert runs[0][0] == runs[1][0]
    assert set(runs[1][1]._graphs) == {None, frozenset(), frozenset({"top_p"})}


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_sampling_gate_passes_the_cuda_fused_cycle(random_checkpoints, gate_prompt, graphs):
    cuda_model = GemmaModel.from_checkpoint(random_checkpoints[VARIANT], device="cuda", max_seq_len=64)
    engine = gate_engine("torch", cuda_model, random_checkpoints, cuda_graphs=graphs)
    cycle = fused(engine, GATE_K, GATE_SAMPLING)
    result = gates.gate_sampled_speculation(cycle, gate_prompt, GATE_K, GATE_SAMPLING, "torch/cuda")
    assert result.passed, result.detail
    assert 0.05 < result.detail["acceptance"] < 0.95


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("host", [False, True])
def test_rows_past_their_budget_stop_advancing(engines, framework, host):
    """A batch runs until its last row is done; rows done earlier (EOS, budget) ride along but must not
    advance past their token budget, or they would run past the context it was checked against."""
    engine = engines[framework]
    cycle = HostCycle(engine, NgramDrafter(), K, GREEDY) if host else fused(engine, K, GREEDY)
    budget = 4
    cycle.start(PROMPTS, StopCondition(budget))
    for _ in range(12):
        cycle.step()
    lengths = np.asarray(engine.lengths.tolist() if framework == "torch" else engine.lengths)
    assert (lengths <= np.array([len(p) - 1 for p in PROMPTS]) + budget + K).all(), lengths
