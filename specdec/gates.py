"""Lossless gates: checks that speculative decoding emits what the target alone would.

Each gate returns GateResult rows, usable from tests and from ``specdec validate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams, seed_words

P_VALUE_THRESHOLD = 1e-4
MIN_EXPECTED_PER_CELL = 5.0


@dataclass
class GateResult:
    name: str
    passed: bool
    detail: dict = field(default_factory=dict)


# --- chi-square goodness of fit --------------------------------------------------------------


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): the regularized upper incomplete gamma."""
    if dof <= 0:
        return 1.0
    return _upper_regularized_gamma(dof / 2, statistic / 2)


def _upper_regularized_gamma(a: float, x: float) -> float:
    # Series for P below a + 1, Lentz's continued fraction for Q above (Numerical Recipes 6.2).
    if x <= 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1 / a
        denominator = a
        while abs(term) > abs(total) * 1e-15:
            denominator += 1
            term *= x / denominator
            total += term
        return max(0.0, 1 - total * math.exp(log_prefactor))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    fraction = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        fraction *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_prefactor) * fraction


def chi_square_test(observed: np.ndarray, expected: np.ndarray) -> dict:
    """Goodness of fit of counts [S, V] to expectations [S, V], each row (stratum) on its own.

    A count in a cell of zero expectation is an impossible outcome: p_value 0. Cells expecting
    fewer than MIN_EXPECTED_PER_CELL are pooled (the pool joins the smallest other cell if still
    too small); each stratum adds (its cells - 1) degrees of freedom.
    """
    observed = np.asarray(observed, dtype=np.float64).reshape(-1, np.shape(observed)[-1])
    expected = np.asarray(expected, dtype=np.float64).reshape(observed.shape)
    impossible = int(observed[expected == 0].sum())
    statistic, dof = 0.0, 0
    for counts, expectation in zip(observed, expected):
        possible = expectation > 0
        counts, expectation = counts[possible], expectation[possible]
        order = np.argsort(expectation)
        counts, expectation = counts[order], expectation[order]
        small = expectation < MIN_EXPECTED_PER_CELL
        pooled_count, pooled_expectation = counts[small].sum(), expectation[small].sum()
        counts, expectation = list(counts[~small]), list(expectation[~small])
        if pooled_expectation > 0:
            if pooled_expectation < MIN_EXPECTED_PER_CELL and expectation:
                counts[0] += pooled_count
                expectation[0] += pooled_expectation
            else:
                counts.append(pooled_count)
                expectation.append(pooled_expectation)
        counts, expectation = np.array(counts), np.array(expectation)
        statistic += float(((counts - expectation) ** 2 / expectation).sum())
        dof += max(len(counts) - 1, 0)
    p_value = 0.0 if impossible else chi_square_sf(statistic, dof)
    return {"statistic": statistic, "dof": dof, "p_value": p_value, "impossible": impossible}


# --- sampling gate -----------------------------------------------------------------------------

# (draft_tokens [B,K], draft_len [B], draft_probs [B,K,V] | None, target_logits [B,K+1,V], params,
#  seed) -> (num_accepted [B], next_token [B]); numpy in and out.
AcceptRule = Callable[..., tuple[np.ndarray, np.ndarray]]
# (logits [..., V], params) -> probs [..., V]; numpy in and out.
WarpRule = Callable[[np.ndarray, SamplingParams], np.ndarray]


@dataclass(frozen=True)
class SamplingCase:
    """A Markov target and drafter: position i's logits depend on the token before it.

    Like a real verify, row i of the target then depends on the drafts before it, so a rule
    that reads the wrong row shows. The token before position 0 is the pending token, 0.
    """

    name: str
    params: SamplingParams
    target_logits: np.ndarray  # [K+1, V, V]: [position, previous token] -> logits
    draft_logits: np.ndarray | None  # [K, V, V], or None for a deterministic drafter
    point_drafts: np.ndarray | None  # [K, V]: the deterministic drafter's token
    vary_draft_len: bool = False

    @property
    def k(self) -> int:
        return self.target_logits.shape[0] - 1


def sampling_cases(vocab: int = 8, seed: int = 0) -> list[SamplingCase]:
    """Point-mass, disjoint, equal, uniform and random drafters under each sampling filter."""
    if vocab < 4:
        raise SpecdecError(f"the sampling gate needs vocab >= 4, got {vocab}")
    rng = np.random.default_rng(seed)

    def logits(k: int) -> np.ndarray:
        return rng.normal(0.0, 1.5, (k, vocab, vocab)).astype(np.float32)

    def target_and_drafter(k: int) -> tuple[np.ndarray, np.ndarray]:
        # A drafter approximates its target: enough acceptances to reach every position.
        target = logits(k + 1)
        return target, target[:k] + rng.normal(0.0, 0.5, (k, vocab, vocab)).astype(np.float32)

    target_k3 = logits(4)  # shared by the K = 3 cases; point drafts are its argmax / argmin
    half = vocab // 2
    disjoint_target, disjoint_draft = logits(3), logits(2)
    disjoint_target[..., half:] = -np.inf
    disjoint_draft[..., :half] = -np.inf
    plain = SamplingParams(temperature=1.0)
    return [
        SamplingCase("point_mass_drafter", plain, target_k3, None,
                     target_k3[:3].argmax(-1), vary_draft_len=True),
        SamplingCase("point_mass_outside_top_k", SamplingParams(1.0, top_k=2), target_k3[:3], None,
                     target_k3[:2].argmin(-1)),
        SamplingCase("disjoint_support", plain, disjoint_target, disjoint_draft, None),
        SamplingCase("draft_equals_target", SamplingParams(0.7, top_p=0.9), target_k3,
                     target_k3[:3], None),
        SamplingCase("uniform_draft", SamplingParams(1.3), target_k3,
                     np.zeros((3, vocab, vocab), np.float32), None),
        SamplingCase("top_k", SamplingParams(1.0, top_k=half), *target_and_drafter(2), None),
        SamplingCase("top_p", SamplingParams(1.0, top_p=0.8), *target_and_drafter(2), None),
        SamplingCase("min_p_hot", SamplingParams(1.5, min_p=0.3), *target_and_drafter(2),
                     None),
        SamplingCase("all_filters", SamplingParams(0.8, top_k=vocab - 2, top_p=0.9, min_p=0.05),
                     *target_and_drafter(3), None, vary_draft_len=True),
        SamplingCase("no_drafts", plain, logits(1), None, np.zeros((0, vocab), np.int64)),
        SamplingCase("greedy_params", SamplingParams(0.0), *target_and_drafter(2), None),
    ]


@dataclass
class _Cycle:
    """The inputs of one verify cycle, one row per draw."""

    draft_tokens: np.ndarray
    draft_len: np.ndarray
    draft_probs: np.ndarray | None
    target_logits: np.ndarray


def _simulate_inputs(case: SamplingCase, warp: WarpRule, draws: int, rng) -> _Cycle:
    vocab = case.target_logits.shape[-1]
    previous = np.zeros(draws, dtype=np.int64)
    drafts, draft_probs, target_rows = [], [], []
    q_tables = None if case.draft_logits is None else warp(case.draft_logits, case.params)
    for i in range(case.k):
        target_rows.append(case.target_logits[i][previous])
        if q_tables is None:
            token = case.point_drafts[i][previous]
        else:
            draft_probs.append(q_tables[i][previous])
            q64 = q_tables[i].astype(np.float64)
            q64 /= q64.sum(-1, keepdims=True)
            token = np.empty(draws, dtype=np.int64)
            for before in range(vocab):  # sample per previous token: exact rng.choice
                rows = previous == before
                token[rows] = rng.choice(vocab, size=int(rows.sum()), p=q64[before])
        drafts.append(token)
        previous = token
    target_rows.append(case.target_logits[case.k][previous])
    draft_tokens = np.stack(drafts, 1) if drafts else np.zeros((draws, 0), np.int64)
    draft_len = (rng.integers(0, case.k + 1, draws) if case.vary_draft_len
                 else np.full(draws, case.k)).astype(np.int64)
    return _Cycle(
        draft_tokens=draft_tokens,
        draft_len=draft_len,
        draft_probs=np.stack(draft_probs, 1) if q_tables is not None else None,
        target_logits=np.stack(target_rows, 1),
    )


def check_sampling_rule(
    case: SamplingCase, accept: AcceptRule, warp: WarpRule, draws: int, seed: int
) -> GateResult:
    """Run one case `draws` times and test every emitted position against the target.

    At position i, among draws whose first i drafts were accepted, the token emitted there (the
    accepted draft i, or the correction / bonus) must follow the warped target given the token
    before it. Counts are stratified by that previous token; the per-position statistics add up
    to one chi-square test (the Anderson-Goodman test of Markov transitions).
    """
    rng = np.random.default_rng(seed)
    cycle = _simulate_inputs(case, warp, draws, rng)
    num_accepted, next_token = accept(
        cycle.draft_tokens, cycle.draft_len, cycle.draft_probs, cycle.target_logits,
        case.params, seed,
    )
    num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
    vocab = case.target_logits.shape[-1]
    detail = {
        "params": case.params,
        "k": case.k,
        "acceptance_rate": float(num_accepted.sum() / max(cycle.draft_len.sum(), 1)),
    }
    if (num_accepted < 0).any() or (num_accepted > cycle.draft_len).any() or (
        (next_token < 0) | (next_token >= vocab)
    ).any():
        detail["error"] = "num_accepted outside [0, draft_len] or next_token outside the vocab"
        return GateResult(f"sampling/{case.name}", False, detail)

    target_probs = warp(case.target_logits, case.params).astype(np.float64)
    target_probs /= target_probs.sum(-1, keepdims=True)
    statistic, dof, impossible, positions = 0.0, 0, 0, []
    previous = np.zeros(len(next_token), dtype=np.int64)
    for i in range(case.k + 1):
        reached = num_accepted >= i
        if i < case.k:
            emitted = np.where(num_accepted > i, cycle.draft_tokens[:, i], next_token)
        else:
            emitted = next_token  # only the bonus reaches position K
        observed = np.zeros((vocab, vocab))
        np.add.at(observed, (previous[reached], emitted[reached]), 1)
        expected = observed.sum(1, keepdims=True) * target_probs[i]
        result = chi_square_test(observed, expected)
        positions.append({"position": i, "reached": int(reached.sum()), **result})
        statistic += result["statistic"]
        dof += result["dof"]
        impossible += result["impossible"]
        if i < case.k:
            previous = cycle.draft_tokens[:, i]
    p_value = 0.0 if impossible else chi_square_sf(statistic, dof)
    detail.update(statistic=statistic, dof=dof, p_value=p_value, impossible=impossible,
                  positions=positions)
    return GateResult(f"sampling/{case.name}", p_value > P_VALUE_THRESHOLD, detail)


def _check_reproducible(case: SamplingCase, accept: AcceptRule, warp: WarpRule, draws: int,
                        seed: int) -> GateResult:
    cycle = _simulate_inputs(case, warp, draws, np.random.default_rng(seed))

    def run(rule_seed: int) -> np.ndarray:
        outputs = accept(cycle.draft_tokens, cycle.draft_len, cycle.draft_probs,
                         cycle.target_logits, case.params, rule_seed)
        return np.stack([np.asarray(x) for x in outputs])

    first, again, other_seed = run(seed), run(seed), run(seed + 1)
    detail = {"same_seed_identical": bool(np.array_equal(first, again)),
              "other_seed_differs": not np.array_equal(first, other_seed)}
    return GateResult("sampling/seeded_reproducible", all(detail.values()), detail)


def _row_keys(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's seed (seed + row) as the rules' words, and a position of 0: every row draws its own numbers."""
    return seed_words(SamplingParams(seed=seed).row_seeds(batch)), np.zeros(batch, np.int32)


def framework_rules(framework: str) -> tuple[AcceptRule, WarpRule]:
    """numpy-in, numpy-out accept_sampled and warp_probs of one framework."""
    if framework == "torch":
        import torch

        from specdec.acceptance import rule_torch

        def accept(draft_tokens, draft_len, draft_probs, target_logits, params, seed):
            seeds, positions = _row_keys(len(draft_tokens), seed)
            uniform = rule_torch.keyed_uniform(torch.from_numpy(seeds), torch.from_numpy(positions),
                                               draft_tokens.shape[1] + 1)
            outputs = rule_torch.accept_sampled(
                torch.from_numpy(draft_tokens), torch.from_numpy(draft_len),
                None if draft_probs is None else torch.from_numpy(draft_probs),
                torch.from_numpy(target_logits), params, uniform,
            )
            return tuple(x.numpy() for x in outputs)

        def warp(logits, params):
            return rule_torch.warp_probs(torch.from_numpy(logits), params).numpy()

        return accept, warp
    if framework == "jax":
        import jax

        from specdec.acceptance import rule_jax

        accept_jit = jax.jit(rule_jax.accept_sampled, static_argnames="params")
        keyed_jit = jax.jit(rule_jax.keyed_uniform, static_argnums=2)
        warp_jit = jax.jit(rule_jax.warp_probs, static_argnames="params")

        def accept(draft_tokens, draft_len, draft_probs, target_logits, params, seed):
            seeds, positions = _row_keys(len(draft_tokens), seed)
            uniform = keyed_jit(seeds.astype(np.uint32), positions, draft_tokens.shape[1] + 1)
            outputs = accept_jit(draft_tokens, draft_len, draft_probs, target_logits, params=params, uniform=uniform)
            return tuple(np.asarray(x) for x in outputs)

        def warp(logits, params):
            return np.asarray(warp_jit(logits, params=params))

        return accept, warp
    raise SpecdecError(f"unknown framework {framework!r}: use 'torch' or 'jax'")


def gate_sampling(
    framework: str = "torch", draws: int = 100_000, vocab: int = 8, seed: int = 0
) -> list[GateResult]:
    """Speculative sampling emits the warped target distribution, and seeds reproduce.

    One chi-square result per case (point-mass, disjoint-support, equal, uniform and random
    drafters; temperature, top-k, top-p, min-p; K = 0..3; rows with draft_len < K), each over
    `draws` vectorised draws, plus one seeded-reproducibility result.
    """
    accept, warp = framework_rules(framework)
    cases = sampling_cases(vocab, seed)
    results = [
        check_sampling_rule(case, accept, warp, draws, seed + index)
        for index, case in enumerate(cases)
    ]
    all_filters = next(case for case in cases if case.name == "all_filters")
    results.append(_check_reproducible(all_filters, accept, warp, draws, seed))
    return results


# --- gates on a real target: K=0, greedy K=1..8, self-draft, sampled speculation --------------------


def _host(array) -> np.ndarray:
    if hasattr(array, "detach"):  # torch
        return array.detach().float().cpu().numpy()
    return np.asarray(array, dtype=np.float32)


@dataclass
class EngineUnderTest:
    """One engine configuration the model gates run on (e.g. "torch/eager", "torch/graphs", "jax")."""

    name: str
    build: Callable[[int], object]  # k_max -> a new batch-1 Verifier
    plain_decode: Callable[[object, list[int], int], list[int]]  # the engine's own plain greedy decode
    k_max: int = 8  # every role's engine is built with it: one decode width for plain and speculative runs
    invariant: bool = True  # row-invariant forwards (speculative output identical to plain decode)
    _built: dict = field(default_factory=dict, repr=False)

    def make(self, role: str = "target"):
        """The engine for a role, built once: a verifier is reset by each prefill, so gates reuse it
        (and its compiled or captured forwards) across runs."""
        if role not in self._built:
            self._built[role] = self.build(self.k_max)
        return self._built[role]

    def margin(self, context: list[int]) -> float:
        """The target's top-2 logit margin for the token after `context` (diagnosis of a divergence: a
        margin of a few ulps means the two forwards rounded a near-tie differently)."""
        verifier = self.make()
        pending = verifier.prefill([context])
        logits = _host(verifier.verify(pending[:, None]).logits[0, -1])
        top2 = np.sort(logits)[-2:]
        return float(top2[1] - top2[0])


def token_sha256(tokens: list[int]) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


def divergence(eut: EngineUnderTest, prompt: list[int], plain: list[int], spec: list[int]) -> dict:
    """Where a speculative decode first left the plain one, and the target's top-2 margin there."""
    shorter = min(len(plain), len(spec))
    first = next((i for i in range(shorter) if plain[i] != spec[i]), shorter)
    return {"first_divergence": first, "plain_token": plain[first] if first < len(plain) else None,
            "spec_token": spec[first] if first < len(spec) else None,
            "top2_margin": eut.margin(prompt + plain[:first])}


def gate_k0(eut: EngineUnderTest, prompt: list[int], n_tokens: int) -> GateResult:
    """K=0 through the speculative loop is bit-identical to the engine's plain decode."""
    from specdec.generate import StopCondition, speculative_generate

    plain = eut.plain_decode(eut.make(), prompt, n_tokens)
    spec = speculative_generate(eut.make(), None, [prompt], 0, StopCondition(n_tokens)).tokens[0]
    detail = {"engine": eut.name, "tokens": len(spec), "prompt_tokens": len(prompt),
              "plain_sha256": token_sha256(plain), "k0_sha256": token_sha256(spec)}
    passed = plain == spec and len(plain) == n_tokens
    if not passed:
        detail.update(divergence(eut, prompt, plain, spec))
    return GateResult(f"k0_bit_identical/{eut.name}", passed, detail)


def gate_greedy(eut: EngineUnderTest, prompt: list[int], n_tokens: int, ks=range(1, 9), drafter_factory=None) -> list[GateResult]:
    """Greedy speculative decode with K = 1..8 emits exactly the plain decode's tokens. Any divergence
    fails, whatever the target's margin there (reported, with where it happened, for diagnosis).
    `drafter_factory(verifier, k)` makes the drafter (default: n-gram)."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.generate import StopCondition, speculative_generate

    plain = eut.plain_decode(eut.make(), prompt, n_tokens)
    results = []
    for k in ks:
        drafter = drafter_factory(eut.make(), k) if drafter_factory else NgramDrafter()
        gen = speculative_generate(eut.make(), drafter, [prompt], k, StopCondition(n_tokens))
        spec = gen.tokens[0]
        detail = {"engine": eut.name, "k": k, "tokens": len(spec), "tau": gen.stats.tau,
                  "acceptance": gen.stats.acceptance_rate}
        if spec != plain:
            detail.update(divergence(eut, prompt, plain, spec))
        results.append(GateResult(f"greedy_k{k}/{eut.name}", spec == plain, detail))
    return results


def gate_self_draft(eut: EngineUnderTest, prompt: list[int], n_tokens: int, ks=range(1, 9)) -> list[GateResult]:
    """The target drafting for itself is always right: every draft accepted (acceptance 1.0, tau = K + 1)
    and the plain decode's tokens. A rejection fails; the target's margins there are reported."""
    from specdec.drafters.model import ModelDrafter
    from specdec.generate import StopCondition, speculative_generate

    plain = eut.plain_decode(eut.make(), prompt, n_tokens)
    results = []
    for k in ks:
        target = eut.make()
        gen = speculative_generate(target, ModelDrafter(target, target, k), [prompt], k, StopCondition(n_tokens))
        s, tokens = gen.stats, gen.tokens[0]
        detail = {"engine": eut.name, "k": k, "acceptance": s.acceptance_rate, "tau": s.tau, "cycles": s.cycles,
                  "rejections": len(s.rejected_at), "output_unchanged": tokens == plain}
        perfect = s.acceptance_rate == 1.0 and s.tau == k + 1 and tokens == plain
        if s.rejected_at:
            detail["rejected_at"] = s.rejected_at[:8]
            detail["rejection_margins"] = [eut.margin(prompt + tokens[:i]) for i in s.rejected_at[:8]]
        results.append(GateResult(f"self_draft_k{k}/{eut.name}", perfect, detail))
    return results
def gate_sampled_speculation(cycle, prompt: list[int], k: int, params: SamplingParams, name: str) -> GateResult:
    """Speculative sampling end to end on a real target. `cycle` is the cycle under test, drafting k tokens
    and sampling with `params`: specdec.generate.HostCycle with any drafter, or a fused cycle (torch's
    FusedCycle, JaxFusedCycle). Each row of its verifier's batch decodes two tokens from the same prompt; the
    first must follow the target's warped distribution after the prompt, the second the target's
    distribution after the prompt and the first (stratified by it). One chi-square test over both
    positions. It catches what the rule-level gate cannot see: a drafter reporting probabilities other than
    those it sampled from, a loop feeding the rule the wrong rows, a fused cycle sampling otherwise than the
    rule says. The expected distributions come from the same engine's forward (row invariance makes them
    exact)."""
    from specdec.generate import StopCondition, run_cycles

    target = cycle.verifier
    draws = target.batch
    gen = run_cycles(cycle, [prompt] * draws, k, StopCondition(2))
    first = np.array([t[0] for t in gen.tokens])
    second = np.array([t[1] for t in gen.tokens])
    framework = target.framework
    _, warp = framework_rules(framework)
    pending = target.prefill([prompt] * draws)
    if framework == "jax":
        import jax.numpy as jnp

        chunk = jnp.stack([pending, jnp.asarray(first, jnp.int32)], axis=1)
    else:
        import torch

        chunk = torch.stack([pending, torch.as_tensor(first, device=pending.device)], dim=1)
    logits = target.verify(chunk).logits
    strata, representative = np.unique(first, return_index=True)  # rows with one first token share a row
    rows_needed = np.concatenate([_host(logits[:1, 0]), _host(logits[representative, 1])])
    expected_probs = warp(rows_needed, params).astype(np.float64)
    expected_probs /= expected_probs.sum(-1, keepdims=True)
    vocab = expected_probs.shape[-1]
    statistic, dof, impossible = 0.0, 0, 0
    tests = [(np.bincount(first, minlength=vocab), draws * expected_probs[0])]
    for i, token in enumerate(strata):
        observed = np.bincount(second[first == token], minlength=vocab)
        tests.append((observed, observed.sum() * expected_probs[1 + i]))
    for observed, expected in tests:
        result = chi_square_test(observed[None], expected[None])
        statistic += result["statistic"]
        dof += result["dof"]
        impossible += result["impossible"]
    p_value = 0.0 if impossible else chi_square_sf(statistic, dof)
    detail = {"k": k, "draws": draws, "params": params, "acceptance": gen.stats.acceptance_rate,
              "first_tokens": len(strata), "statistic": statistic, "dof": dof, "p_value": p_value,
              "impossible": impossible}
    return GateResult(f"sampled_speculation/{name}", p_value > P_VALUE_THRESHOLD, detail)


def torch_engines(model, graphs: bool | None = None, k_max: int = 8, invariant: bool = True,
                  hidden_layers: tuple[int, ...] = ()) -> list[EngineUnderTest]:
    """The PyTorch engine eager, and graphed too on CUDA (returning `hidden_layers` for a drafter that reads them)."""
    from specdec.engines.verifier_torch import TorchEngine

    modes = [False, True] if (graphs is None and model.embed_tokens.weight.is_cuda) else [bool(graphs)]
    return [
        EngineUnderTest(
            name=f"torch/{'graphs' if g else 'eager'}",
            build=lambda k, g=g: TorchEngine(model, batch=1, k_max=k, cuda_graphs=g, invariant=invariant,
                                             hidden_layers=hidden_layers),
            plain_decode=lambda engine, prompt, n: engine.greedy_decode(prompt, n),
            k_max=k_max,
            invariant=invariant,
        )
        for g in modes
    ]


def jax_engines(engine, k_max: int = 8, invariant: bool = True, hidden_layers: tuple[int, ...] = ()) -> list[EngineUnderTest]:
    """The JAX engine; its plain decode is the fused on-device loop (one dispatch per generation)."""
    from specdec.engines.verifier_jax import JaxEngine

    return [
        EngineUnderTest(
            name="jax",
            build=lambda k: JaxEngine(engine.cfg, engine.params, batch=1, max_seq_len=engine.max_seq_len, k_max=k,
                                      invariant=invariant, hidden_layers=hidden_layers,
                                      prefill_chunk=engine.prefill_chunk),
            plain_decode=lambda verifier, prompt, n: verifier.generate_fused(prompt, n),
            k_max=k_max,
            invariant=invariant,
        )
    ]


def model_gates(engines: list[EngineUnderTest], prompt: list[int], n_tokens: int, k_max: int = 8,
                self_draft: bool = True, progress: Callable[[str], None] | None = None, drafter_factory=None,
                drafter_name: str = "n-gram") -> list[GateResult]:
    """The gates of one prompt: K=0 and greedy K=1..k_max on each engine (n-gram drafts, or
    `drafter_factory(verifier, k)`'s), and self-draft on the PyTorch ones (the model drafter runs on the
    PyTorch engine)."""
    say = progress or (lambda _msg: None)
    results: list[GateResult] = []
    ks = range(1, k_max + 1)
    for eut in engines:
        say(f"{eut.name}: K=0 vs plain decode, {n_tokens} tokens")
        results.append(gate_k0(eut, prompt, n_tokens))
        say(f"{eut.name}: greedy K=1..{k_max}, {drafter_name} drafter")
        results += gate_greedy(eut, prompt, n_tokens, ks, drafter_factory)
        if self_draft and eut.name.startswith("torch"):
            say(f"{eut.name}: self-draft K=1..{k_max}")
            results += gate_self_draft(eut, prompt, n_tokens, ks)
    return results


def gate_sampled_drafter(engine, build, prompt: list[int], k: int = 2,
                         params: SamplingParams = SamplingParams(0.7, top_k=8)) -> GateResult:
    """gate_sampled_speculation on the fused cycle a user runs with a stateful drafter (EAGLE-3 head, model,
    MTP assistant): drafts sampled by it, their probabilities handed to the rule. `engine` is a batch engine
    (one row per draw) returning the drafter's taps; `build(engine, k, params)` makes the drafter
    (specdec.drafters.registry.DrafterSource.build)."""
    drafter = build(engine, k, params)
    if drafter.framework == "jax":
        from specdec.engines.cycle_jax import JaxFusedCycle as Cycle
    else:
        from specdec.engines.cycle_torch import FusedCycle as Cycle
    # Two tokens a row are all the gate reads: JAX runs one cycle per call, not 8.
    extra = {"cycles_per_call": 1} if drafter.framework == "jax" else {}
    cycle = Cycle(engine, drafter.device_draft_fn(drafter.framework, k), k, params, **extra)
    return gate_sampled_speculation(cycle, prompt, k, params, f"{drafter.framework}/{drafter.name}")
