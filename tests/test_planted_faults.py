"""Every gate can fail: each test plants a fault the gate must catch. A gate loosened (a threshold, a
tolerance, an excuse) turns one of these red.

- K=0: a speculative loop that corrupts one emitted token;
- self-draft: a model drafter that proposes a wrong token now and then;
- sampled speculation: a model drafter reporting probabilities other than those it sampled from;
- sampling rule: corrections drawn from a residual distribution a few percent off.
(The greedy gate's planted fault is in tests/test_gates.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import gates
from specdec.drafters.model import ModelDrafter, TorchModelDraft
from specdec.engines.verifier_torch import TorchEngine
from specdec.generate import HostCycle
from specdec.models.gemma_torch import GemmaModel
from specdec.sampling import SamplingParams

PROMPT = [2, 17, 99, 5, 300, 41, 17, 99]


@pytest.fixture(scope="module")
def model(random_checkpoints):
    return GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], max_seq_len=256)


@pytest.fixture(scope="module")
def eager(model):
    (eut,) = gates.torch_engines(model, graphs=False)
    return eut


def test_k0_gate_catches_a_corrupted_emitted_token(eager):
    def corrupting(k_max):
        engine = eager.build(k_max)
        verify = engine.verify

        def wrong_verify(tokens):
            out = verify(tokens)
            if int(engine.lengths[0]) == len(PROMPT) - 1 + 30:  # the forward choosing emitted token 31
                out.logits = out.logits.clone()
                out.logits[:, 0, 7] = out.logits[:, 0].max() + 1.0
            return out

        engine.verify = wrong_verify
        return engine

    honest_plain = lambda _engine, prompt, n: eager.plain_decode(eager.make("honest"), prompt, n)  # noqa: E731
    broken = gates.EngineUnderTest("torch/broken", corrupting, honest_plain)
    result = gates.gate_k0(broken, PROMPT, 60)
    assert not result.passed
    assert result.detail["first_divergence"] == 30
    assert result.detail["plain_sha256"] != result.detail["k0_sha256"]


def test_self_draft_gate_catches_a_wrong_draft(eager, monkeypatch):
    honest = gates.gate_self_draft(eager, PROMPT, 40, ks=[3])
    assert honest[0].passed, honest[0].detail
    calls = []
    choose = TorchModelDraft._choose

    def sometimes_second_best(self, logits):
        calls.append(1)
        if len(calls) % 17 == 0:
            return logits.topk(2, dim=-1).indices[:, 1], None
        return choose(self, logits)

    monkeypatch.setattr(TorchModelDraft, "_choose", sometimes_second_best)
    (result,) = gates.gate_self_draft(eager, PROMPT, 40, ks=[3])
    assert not result.passed
    assert result.detail["rejections"] > 0 and result.detail["acceptance"] < 1.0
    assert result.detail["output_unchanged"]  # the target still decided every token: only the gate sees it


SAMPLING = SamplingParams(temperature=1.0, top_k=8)  # few outcomes per position: every stratum well filled
DRAWS = 3000


def perturbed(model: GemmaModel, path, scale: float = 0.03) -> GemmaModel:
    """The target's checkpoint with noise on every matrix: a drafter close to the target but not equal, so
    drafts are both accepted and rejected (and the residual distribution sampled)."""
    drafter = GemmaModel.from_checkpoint(path, max_seq_len=model.max_seq_len)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in drafter.parameters():
            if weight.ndim == 2:
                weight.add_(scale * weight.std() * torch.randn(weight.shape, generator=noise))
    return drafter


def sampled_speculation(random_checkpoints, drafter_cls=ModelDrafter):
    path = random_checkpoints["gemma4_e"]
    target_model = GemmaModel.from_checkpoint(path, max_seq_len=32)
    target = TorchEngine(target_model, batch=DRAWS, max_seq_len=32, k_max=3)
    drafter = drafter_cls(perturbed(target_model, path), target, 2, SAMPLING)
    cycle = HostCycle(target, drafter, 2, SamplingParams(SAMPLING.temperature, SAMPLING.top_k, seed=0))
    return gates.gate_sampled_speculation(cycle, PROMPT, 2, SAMPLING, "torch/model_drafter")


def test_sampled_speculation_gate_passes_an_honest_drafter(random_checkpoints):
    result = sampled_speculation(random_checkpoints)
    assert result.passed, result.detail
    assert 0.05 < result.detail["acceptance"] < 0.95  # both accepted drafts and residual draws were tested
    assert result.detail["first_tokens"] > 1


class StaleProbsDrafter(ModelDrafter):
    """Samples each draft right but reports, for draft i, the distribution of draft i - 1 (an off-by-one a
    drafter's bookkeeping can make; greedy decoding never sees it)."""

    def propose(self, k):
        draft = super().propose(k)
        draft.probs = torch.cat([draft.probs[:, :1], draft.probs[:, :-1]], dim=1)
        return draft


def test_sampled_speculation_gate_catches_misreported_draft_probabilities(random_checkpoints):
    result = sampled_speculation(random_checkpoints, StaleProbsDrafter)
    assert not result.passed, result.detail


def slightly_wrong_residual(accept_sampled, warp, off: float):
    """The correct rule, except that a fraction `off` of the corrections comes from the target itself
    instead of the residual max(0, p - q)."""
    def accept(draft_tokens, draft_len, draft_probs, target_logits, params, seed):
        num_accepted, next_token = accept_sampled(draft_tokens, draft_len, draft_probs, target_logits, params, seed)
        rng = np.random.default_rng(seed + 1)
        rows = np.arange(len(num_accepted))
        p = warp(target_logits[rows, num_accepted], params).astype(np.float64)
        from_target = (rng.random((len(p), 1)) > np.cumsum(p / p.sum(-1, keepdims=True), -1)).sum(-1)
        swap = (num_accepted < draft_len) & (rng.random(len(num_accepted)) < off)
        return num_accepted, np.where(swap, np.minimum(from_target, p.shape[-1] - 1), next_token)
    return accept


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_gate_detects_a_residual_ten_percent_off(seed):
    """At the gate's default number of draws, 10% of corrections from the wrong distribution fail it whatever
    the seed (p-values 1e-13 to 1e-7 over seeds 0-9; at 5% they spread from 1e-3 to 0.3, a coin toss), with a
    p-value far from both ends: a threshold loosened to 1e-300 would let it pass."""
    accept_sampled, warp = gates.framework_rules("torch")
    case = next(c for c in gates.sampling_cases() if c.name == "uniform_draft")
    honest = gates.check_sampling_rule(case, accept_sampled, warp, draws=100_000, seed=seed)
    assert honest.passed
    result = gates.check_sampling_rule(case, slightly_wrong_residual(accept_sampled, warp, 0.1), warp,
                                       draws=100_000, seed=seed)
    assert not result.passed, result.detail["p_value"]
    assert 1e-300 < result.detail["p_value"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_gate_detects_a_residual_eight_percent_off(seed):
    """Nearer the edge of the gate's power: 8% of corrections from the wrong distribution fail it over seeds 0-5 with
    p-values from 1e-7 to 3e-5, under the threshold of 1e-4 by a factor of 3 or more. A threshold loosened to 1e-8
    lets every one of them pass, where the 10% fault above still fails it at seeds 0-2."""
    accept_sampled, warp = gates.framework_rules("torch")
    case = next(c for c in gates.sampling_cases() if c.name == "uniform_draft")
    result = gates.check_sampling_rule(case, slightly_wrong_residual(accept_sampled, warp, 0.08), warp,
                                       draws=100_000, seed=seed)
    assert not result.passed, result.detail["p_value"]
