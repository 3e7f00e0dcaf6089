"""Acceptance rules of both frameworks against the shared oracle, and SamplingParams."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.gates import framework_rules
from specdec.sampling import SamplingParams, seed_words
from tests import oracle

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from specdec.acceptance import rule_jax, rule_torch  # noqa: E402
from specdec.engines.verifier_torch import capture_graph  # noqa: E402


class TorchRules:
    @staticmethod
    def warp_probs(logits, params):
        return rule_torch.warp_probs(torch.from_numpy(logits), params).numpy()

    @staticmethod
    def accept_greedy(draft_tokens, draft_len, target_logits):
        outputs = rule_torch.accept_greedy(
            torch.from_numpy(draft_tokens), torch.from_numpy(draft_len),
            torch.from_numpy(target_logits),
        )
        return tuple(x.numpy() for x in outputs)

    accept_sampled = staticmethod(framework_rules("torch")[0])


class JaxRules:
    # Always under jit, as the fused loop runs them.
    _warp = staticmethod(jax.jit(rule_jax.warp_probs, static_argnames="params"))
    _greedy = staticmethod(jax.jit(rule_jax.accept_greedy))

    @classmethod
    def warp_probs(cls, logits, params):
        return np.asarray(cls._warp(logits, params=params))

    @classmethod
    def accept_greedy(cls, draft_tokens, draft_len, target_logits):
        return tuple(np.asarray(x) for x in cls._greedy(draft_tokens, draft_len, target_logits))

    accept_sampled = staticmethod(framework_rules("jax")[0])  # jitted there


@pytest.fixture(params=["torch", "jax"])
def rules(request):
    return {"torch": TorchRules, "jax": JaxRules}[request.param]


WARP_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_k=100),  # larger than the vocab: no-op
    SamplingParams(temperature=1.2, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("params", WARP_PARAMS, ids=str)
@pytest.mark.parametrize("logit_kind", ["continuous", "tied"])
def test_warp_probs_matches_oracle(rules, params, logit_kind):
    rng = np.random.default_rng(1)
    if logit_kind == "tied":  # whole numbers: ties at the top-k / top-p boundaries and argmax
        logits = rng.integers(-3, 4, size=(6, 3, 12)).astype(np.float32)
    else:
        logits = rng.normal(0, 2, size=(6, 3, 12)).astype(np.float32)
    got = rules.warp_probs(logits, params)
    assert got.dtype == np.float32 and got.shape == logits.shape
    want = np.array([[oracle.warp_probs(row, params) for row in rows] for rows in logits])
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same tokens filtered out


@pytest.mark.parametrize("params", WARP_PARAMS[:-1], ids=str)
def test_torch_warp_matches_hugging_face(params):
    generation = pytest.importorskip("transformers.generation.logits_process")
    warpers = [generation.TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(generation.TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(generation.TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(generation.MinPLogitsWarper(params.min_p))
    logits = torch.from_numpy(np.random.default_rng(2).normal(0, 2, (32, 50)).astype(np.float32))
    scores = logits
    for warper in warpers:
        scores = warper(None, scores)
    want = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(rule_torch.warp_probs(logits, params), want, atol=1e-6, rtol=0)


def test_argmax_returns_the_lowest_tied_index():
    # The greedy tie rule relies on this in both frameworks.
    row = np.array([0.0, 3.0, 1.0, 3.0, 3.0], dtype=np.float32)
    assert int(torch.from_numpy(row).argmax()) == 1
    assert int(jax.numpy.argmax(row)) == 1


def _wide_rows(vocab: int) -> torch.Tensor:
    """Rows whose argmax is hard for a pass by blocks: maxima tied within a block and across blocks, a NaN
    (torch.argmax's largest), -inf alone, +inf beside a NaN, and random logits."""
    rng = np.random.default_rng(7)
    rows = rng.integers(-3, 4, size=(8, vocab)).astype(np.float32)
    rows[0, [5, 9, vocab - 3]] = 50.0  # tie within the first block and with the last one
    rows[1, [vocab - 1, vocab // 2 + 7]] = 50.0  # a tie whose later id is the last (in a padded block at 5,000)
    rows[2, vocab * 3 // 4], rows[2, 700] = np.nan, 50.0
    rows[3] = -np.inf
    rows[4, 3], rows[4, vocab - 2] = np.inf, np.nan
    rows[5] = rng.standard_normal(vocab)
    return torch.from_numpy(rows).view(2, 4, vocab)  # leading dimensions as [B, K+1]


@pytest.mark.parametrize("vocab", [1000, 2048, 5000])  # one block (plain argmax); whole blocks; the last padded
def test_compiled_greedy_token_is_argmax_with_lowest_id(vocab):
    """Traced by torch.compile (the eager backend runs what dynamo traces), greedy_token takes its two passes
    and still gives torch.argmax's token, NaN and ties included."""
    logits = _wide_rows(vocab)
    compiled = torch.compile(rule_torch.greedy_token, backend="eager", fullgraph=True)
    want = logits.argmax(dim=-1)
    assert torch.equal(compiled(logits), want)
    assert torch.equal(rule_torch.greedy_token(logits), want)
    assert want[0, 0] == 5 and want[0, 1] == vocab // 2 + 7 and want[0, 2] == vocab * 3 // 4


def random_greedy_inputs(rng, batch: int, k: int, vocab: int):
    target_logits = rng.integers(-2, 3, size=(batch, k + 1, vocab)).astype(np.float32)
    argmaxes = np.array([[oracle.argmax_lowest_id(r) for r in rows] for rows in target_logits])
    # Mostly right drafts, so that long accepted prefixes occur.
    draft_tokens = np.where(rng.random((batch, k)) < 0.8, argmaxes[:, :k],
                            rng.integers(0, vocab, (batch, k))).astype(np.int64)
    draft_len = rng.integers(0, k + 1, batch).astype(np.int64)
    return draft_tokens, draft_len, target_logits


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_accept_greedy_matches_oracle(rules, k):
    rng = np.random.default_rng(k)
    draft_tokens, draft_len, target_logits = random_greedy_inputs(rng, 64, k, 6)
    got = rules.accept_greedy(draft_tokens, draft_len, target_logits)
    want = oracle.accept_greedy(draft_tokens, draft_len, target_logits)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_greedy_ties_break_to_the_lowest_id(rules):
    target_logits = np.zeros((2, 2, 5), np.float32)  # every token tied
    draft_tokens = np.array([[0], [1]], np.int64)
    num_accepted, next_token = rules.accept_greedy(draft_tokens, np.array([1, 1]), target_logits)
    np.testing.assert_array_equal(num_accepted, [1, 0])  # token 0 is the argmax, token 1 is not
    np.testing.assert_array_equal(next_token, [0, 0])


def test_greedy_with_no_drafts_is_plain_greedy_decode(rules):
    target_logits = np.random.default_rng(3).normal(size=(8, 1, 10)).astype(np.float32)
    num_accepted, next_token = rules.accept_greedy(
        np.zeros((8, 0), np.int64), np.zeros(8, np.int64), target_logits)
    np.testing.assert_array_equal(num_accepted, 0)
    np.testing.assert_array_equal(next_token, target_logits[:, 0].argmax(-1))


def test_greedy_ignores_drafts_past_draft_len(rules):
    target_logits = np.zeros((1, 4, 5), np.float32)
    target_logits[0, :, 2] = 1.0  # argmax 2 at every row
    draft_tokens = np.array([[2, 2, 2]], np.int64)  # all would match
    num_accepted, next_token = rules.accept_greedy(draft_tokens, np.array([1]), target_logits)
    assert num_accepted.tolist() == [1] and next_token.tolist() == [2]


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampled_with_greedy_params_equals_greedy(rules, k, with_draft_probs):
    rng = np.random.default_rng(4)
    draft_tokens, draft_len, target_logits = random_greedy_inputs(rng, 64, k, 6)
    draft_probs = None
    if with_draft_probs:
        draft_probs = rng.dirichlet(np.ones(6), (64, k)).astype(np.float32)
    got = rules.accept_sampled(draft_tokens, draft_len, draft_probs, target_logits,
                               SamplingParams(temperature=0.0), seed=0)
    want = oracle.accept_greedy(draft_tokens, draft_len, target_logits)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_sampled_never_accepts_or_emits_a_filtered_token(rules, with_draft_probs):
    batch, vocab = 256, 6
    target_logits = np.tile(np.arange(vocab, dtype=np.float32), (batch, 3, 1))
    draft_tokens = np.zeros((batch, 2), np.int64)  # token 0: outside top-2
    draft_probs = np.full((batch, 2, vocab), 1 / vocab, np.float32) if with_draft_probs else None
    num_accepted, next_token = rules.accept_sampled(
        draft_tokens, np.full(batch, 2), draft_probs, target_logits,
        SamplingParams(temperature=1.0, top_k=2), seed=5)
    np.testing.assert_array_equal(num_accepted, 0)
    assert set(next_token.tolist()) == {vocab - 2, vocab - 1}


def test_sampled_accepts_at_most_draft_len_and_reproduces(rules):
    rng = np.random.default_rng(6)
    batch, k, vocab = 128, 3, 5
    target_logits = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32)
    draft_tokens = rng.integers(0, vocab, (batch, k)).astype(np.int64)
    draft_len = rng.integers(0, k + 1, batch).astype(np.int64)
    draft_probs = rng.dirichlet(np.ones(vocab), (batch, k)).astype(np.float32)
    params = SamplingParams(temperature=0.9)
    first = rules.accept_sampled(draft_tokens, draft_len, draft_probs, target_logits, params, 7)
    again = rules.accept_sampled(draft_tokens, draft_len, draft_probs, target_logits, params, 7)
    assert (first[0] <= draft_len).all() and (first[0][draft_len == 0] == 0).all()
    assert (first[0] > 0).any()
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])


def test_sampled_with_identical_draft_and_target_accepts_everything(rules):
    rng = np.random.default_rng(8)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    target_logits = rng.normal(size=(64, 3, 7)).astype(np.float32)
    draft_probs = rules.warp_probs(target_logits[:, :2], params)
    draft_tokens = np.array([[rng.choice(7, p=row / row.sum()) for row in rows]
                             for rows in draft_probs.astype(np.float64)])
    num_accepted, _ = rules.accept_sampled(draft_tokens, np.full(64, 2), draft_probs,
                                           target_logits, params, seed=9)
    np.testing.assert_array_equal(num_accepted, 2)


KEYED_CASES = [(0, 0), (1, 5), (2**32 - 1, 3), (2**32, 3), (2**63 - 1, 100_000), (12345678901234, 2**31 - 1)]


def test_keyed_draws_are_the_spec_hash_in_both_frameworks():
    seeds, positions = zip(*KEYED_CASES)
    words = seed_words(list(seeds))
    lanes = 7
    got_torch = rule_torch.keyed_uniform(torch.from_numpy(words), torch.tensor(positions), lanes).numpy()
    got_jax = np.asarray(jax.jit(rule_jax.keyed_uniform, static_argnums=2)(
        words.astype(np.uint32), np.asarray(positions, np.int32), lanes))
    want = np.array([[oracle.keyed_uniform(s, p, j) for j in range(lanes)] for s, p in KEYED_CASES], np.float32)
    np.testing.assert_array_equal(got_torch, want)
    np.testing.assert_array_equal(got_jax, want)


def test_keyed_draws_are_uniform_over_seeds_positions_and_lanes():
    """Chi-square over 64 bins (63 degrees of freedom: 103.4 is the 0.999 quantile) of 2^18 draws, varying
    one key at a time: the seed, the position, the lane."""
    n = 2**12
    draws = [
        rule_torch.keyed_uniform(torch.from_numpy(seed_words(list(range(n)))), torch.zeros(n, dtype=torch.long), 64),
        rule_torch.keyed_uniform(torch.from_numpy(seed_words([7] * n)), torch.arange(n), 64),
        rule_torch.keyed_uniform(torch.from_numpy(seed_words([7])), torch.tensor([3]), 64 * n),
    ]
    for uniform in draws:
        counts = np.bincount((uniform.numpy().ravel() * 64).astype(int), minlength=64)
        expected = counts.sum() / 64
        assert ((counts - expected) ** 2 / expected).sum() < 103.4
        assert 0 <= uniform.min() and uniform.max() < 1


def test_a_rows_draws_do_not_depend_on_the_rows_beside_it(rules):
    rng = np.random.default_rng(11)
    batch, k, vocab = 8, 3, 9
    target_logits = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32)
    draft_tokens = rng.integers(0, vocab, (batch, k)).astype(np.int64)
    draft_probs = rng.dirichlet(np.ones(vocab), (batch, k)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    together = rules.accept_sampled(draft_tokens, np.full(batch, k), draft_probs, target_logits, params, seed=20)
    for b in (0, 5):  # row b of seed 20 draws with seed 20 + b (SamplingParams.row_seeds)
        alone = rules.accept_sampled(draft_tokens[b : b + 1], np.full(1, k), draft_probs[b : b + 1],
                                     target_logits[b : b + 1], params, seed=20 + b)
        assert (together[0][b], together[1][b]) == (alone[0][0], alone[1][0])


@pytest.mark.parametrize("vocab", [5, 3000])  # one block of the torch scan, and three (the last one padded)
def test_inverse_cdf_draws_by_cumulative_weight_and_never_a_token_without_weight(vocab):
    """Tokens without weight are never drawn, even where a uniform just below 1 times the total rounds up to it
    or a tiny weight leaves the sum as it was; elsewhere the token is the first whose cumulative weight reaches
    uniform * total, in both frameworks."""
    rng = np.random.default_rng(13)
    weights = rng.random((4, vocab)).astype(np.float32) * (rng.random((4, vocab)) < 0.5)
    weights[1, :] = 0
    weights[1, [1, vocab // 2, vocab - 2]] = [1e-30, 1.0, 1e-30]  # the last weighted token adds nothing to the sum
    cumulative = np.cumsum(weights.astype(np.float64), axis=-1)
    jax_draw = jax.jit(rule_jax._inverse_cdf)
    for u in (0.0, 0.25, 0.5, 0.75, 1 - 2.0**-24):
        uniform = np.full(4, u, np.float32)
        for tokens in (rule_torch._inverse_cdf(torch.from_numpy(weights), torch.from_numpy(uniform)).numpy(),
                       np.asarray(jax_draw(weights, uniform))):
            assert (weights[np.arange(4), tokens] > 0).all(), (u, tokens)
            if 0 < u < 0.9:  # away from rounding: the exact inverse CDF
                want = (cumulative < u * cumulative[:, -1:]).sum(-1)
                want = [next(i for i in range(w, vocab) if weights[r, i] > 0) for r, w in enumerate(want)]
                np.testing.assert_array_equal(tokens, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_per_row_settings_give_each_row_what_its_own_settings_give(device):
    """torch's RowSampling (a server's batch, a fused cycle's rows): bitwise the warp and the tokens of each row's
    SamplingParams alone (the host loop's), a greedy row among sampled ones included. On CUDA too, where dividing by
    a Python float would multiply by its reciprocal instead."""
    rng = np.random.default_rng(12)
    rows = list(WARP_PARAMS)  # every filter, mixed, and a greedy row
    batch, k, vocab = len(rows), 2, 12
    logits = torch.from_numpy(rng.normal(0, 2, (batch, k + 1, vocab)).astype(np.float32)).to(device)
    draft_tokens = torch.from_numpy(rng.integers(0, vocab, (batch, k))).to(device)
    draft_len = torch.full((batch,), k, device=device)
    per_row = rule_torch.RowSampling.of(rows, device)
    warped = rule_torch.warp_probs(logits, per_row)
    seeds = torch.from_numpy(seed_words(list(range(batch)))).to(device)
    uniform = rule_torch.keyed_uniform(seeds, torch.arange(batch, device=device), k + 1)
    accepted = rule_torch.accept_sampled(draft_tokens, draft_len, None, logits, per_row, uniform)
    for b, params in enumerate(rows):
        assert torch.equal(warped[b], rule_torch.warp_probs(logits[b], params))
        alone = rule_torch.accept_sampled(draft_tokens[b : b + 1], draft_len[b : b + 1], None, logits[b : b + 1],
                                          params, uniform[b : b + 1])
        assert (accepted[0][b], accepted[1][b]) == (alone[0][0], alone[1][0])


def test_top_p_keeps_a_token_summing_to_just_past_one_minus_top_p_in_every_form():
    """The top-p threshold at a float32 boundary: the least likely of two tokens has probability 0.10000002 (as the
    softmax of float32 logits [-2.1972244, 0] rounds in both frameworks), just past float32(1 - 0.9) = 0.1, the
    threshold Hugging Face compares with, and below 1 - float32(0.9) = 0.10000002384. Every form of the settings
    keeps it: SamplingParams and per-row settings alike, in both frameworks (per-row top_p as float32 once dropped
    it, so a fused cycle sampled other tokens than the host loop)."""
    import jax.numpy as jnp

    logits = np.array([[-2.1972244, 0.0]], np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    assert 0.1 < torch.softmax(torch.from_numpy(logits), -1)[0, 0] < 1 - np.float32(0.9)
    warps = {
        "torch": rule_torch.warp_probs(torch.from_numpy(logits), params).numpy(),
        "torch per row": rule_torch.warp_probs(torch.from_numpy(logits), rule_torch.RowSampling.of([params])).numpy(),
        "jax": np.asarray(rule_jax.warp_probs(jnp.asarray(logits), params)),
        "jax per row": np.asarray(rule_jax.warp_probs(jnp.asarray(logits), rule_jax.RowSampling.of([params]))),
    }
    for form, probs in warps.items():
        assert (probs > 0).all(), form
    generation = pytest.importorskip("transformers.generation.logits_process")
    kept = generation.TopPLogitsWarper(params.top_p)(None, torch.from_numpy(logits))
    assert torch.isfinite(kept).all()


def test_jax_per_row_settings_leave_each_row_as_its_settings_alone_leave_it():
    """JAX's RowSampling of a server's batch (one program for every mix of settings, the filters in use picked on the
    device): each row's warp is bitwise what a batch of its settings alone gives it, a greedy row among sampled
    ones included, and its tokens those of its SamplingParams. The warps are not bitwise those of SamplingParams, or
    of RowSampling naming its filters (generate's): XLA rewrites and fuses the division by the temperature
    differently in each program."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(12)
    rows = list(WARP_PARAMS)
    batch, k, vocab = len(rows), 2, 12
    logits = jnp.asarray(rng.normal(0, 2, (batch, k + 1, vocab)).astype(np.float32))
    draft_tokens = jnp.asarray(rng.integers(0, vocab, (batch, k)), jnp.int32)
    draft_len = jnp.full((batch,), k, jnp.int32)
    uniform = rule_jax.keyed_uniform(jnp.asarray(seed_words(list(range(batch))), jnp.uint32), jnp.arange(batch), k + 1)
    warp, accept = jax.jit(rule_jax.warp_probs), jax.jit(rule_jax.accept_sampled)
    accept_alone = jax.jit(rule_jax.accept_sampled, static_argnames="params")

    def per_row(settings):
        return jax.device_put(rule_jax.RowSampling.of(settings))

    warped = warp(logits, per_row(rows))
    accepted = accept(draft_tokens, draft_len, None, logits, per_row(rows), uniform)
    for b, params in enumerate(rows):
        np.testing.assert_array_equal(warped[b], warp(logits, per_row([params] * batch))[b])
        np.testing.assert_allclose(warped[b], rule_jax.warp_probs(logits[b], params), rtol=1e-6, atol=1e-7)
        alone = accept_alone(draft_tokens, draft_len, None, logits, params=params, uniform=uniform)
        assert (int(accepted[0][b]), int(accepted[1][b])) == (int(alone[0][b]), int(alone[1][b])), params


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 1.0},
    ],
    ids=str,
)
def test_sampling_params_rejects_bad_values(kwargs):
    with pytest.raises(SpecdecError) as error:
        SamplingParams(**kwargs)
    assert "\n" not in str(error.value)


def test_sampling_params_greedy_and_hashable():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert hash(SamplingParams(1.0, top_k=3)) == hash(SamplingParams(1.0, top_k=3))


@pytest.mark.gpu
def test_torch_rules_replay_in_a_cuda_graph():
    rng = np.random.default_rng(10)
    batch, k, vocab = 16, 3, 50
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)

    def fresh_inputs():
        arrays = random_greedy_inputs(rng, batch, k, vocab)
        return [torch.from_numpy(x).cuda() for x in arrays]

    draft_tokens, draft_len, target_logits = static = fresh_inputs()
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, device="cuda"), dim=-1)
    seeds = torch.zeros(batch, 2, dtype=torch.long, device="cuda")
    positions = torch.zeros(batch, dtype=torch.long, device="cuda")

    def run_rules():
        greedy = rule_torch.accept_greedy(draft_tokens, draft_len, target_logits)
        uniform = rule_torch.keyed_uniform(seeds, positions, k + 1)
        sampled = rule_torch.accept_sampled(draft_tokens, draft_len, draft_probs, target_logits, params, uniform)
        return greedy, sampled

    graph, (greedy_out, sampled_out) = capture_graph(run_rules)

    for seed in range(3):
        for buffer, new in zip(static, fresh_inputs()):
            buffer.copy_(new)
        seeds.copy_(torch.from_numpy(seed_words(SamplingParams(seed=seed).row_seeds(batch))))
        positions.fill_(seed)
        graph.replay()
        want = oracle.accept_greedy(*(x.cpu().numpy() for x in static))
        assert greedy_out[0].tolist() == want[0] and greedy_out[1].tolist() == want[1]
        replayed = [x.clone() for x in sampled_out]
        eager = run_rules()[1]  # the same keys eagerly give the same tokens
        assert all(torch.equal(a, b) for a, b in zip(replayed, eager))
        assert (replayed[0] <= draft_len).all()


@pytest.mark.gpu
def test_greedy_token_compiled_by_inductor_on_cuda_is_argmax():
    """Inductor's kernels for the two passes, on the 270M's vocabulary: torch.argmax's tokens, ties and NaN
    included."""
    logits = _wide_rows(262144).cuda()
    compiled = torch.compile(rule_torch.greedy_token, fullgraph=True)
    assert torch.equal(compiled(logits), logits.argmax(dim=-1))
