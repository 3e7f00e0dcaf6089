"""The speculative loop on the PyTorch engine: lossless against plain decode, stop conditions, stats."""

import dataclasses
import types

import pytest

from specdec.drafters.model import ModelDrafter
from specdec.engines.verifier_torch import TorchEngine
from specdec.errors import SpecdecError
from specdec.generate import StopCondition, speculative_generate
from specdec.models.gemma_torch import GemmaModel
from specdec.sampling import SamplingParams

PROMPTS = [[2, 17, 99, 5, 300, 41, 17, 99], [2, 8, 8, 9]]


@pytest.fixture(scope="module")
def model(random_checkpoints):
    return GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], max_seq_len=256)


def plain(model, prompt, n):
    return TorchEngine(model, max_seq_len=256).greedy_decode(prompt, n)


@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_self_draft_is_lossless_and_accepts_everything(model, k):
    target = TorchEngine(model, batch=2, max_seq_len=256, k_max=8)
    drafter = ModelDrafter(model, target, k) if k else None
    gen = speculative_generate(target, drafter, PROMPTS, k, StopCondition(40))
    for prompt, tokens in zip(PROMPTS, gen.tokens):
        assert tokens == plain(model, prompt, 40)
    if k:
        assert gen.stats.acceptance_rate == 1.0
        assert gen.stats.tau == k + 1
        assert gen.stats.per_position_acceptance == [1.0] * k


def test_stop_inside_accepted_draft(model):
    reference = plain(model, PROMPTS[0], 40)
    eos = reference[10]
    first = reference.index(eos)
    target = TorchEngine(model, batch=1, max_seq_len=256, k_max=8)
    drafter = ModelDrafter(model, target, 8)
    gen = speculative_generate(target, drafter, PROMPTS[:1], 8, StopCondition(40, eos_ids=[eos]))
    assert gen.tokens[0] == reference[: first + 1]
    gen = speculative_generate(target, drafter, PROMPTS[:1], 8, StopCondition(13))
    assert gen.tokens[0] == reference[:13]


def test_stop_strings(model):
    reference = plain(model, PROMPTS[0], 30)
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731  a toy detokenizer
    stop_at = decode(reference[6:8])
    target = TorchEngine(model, batch=1, max_seq_len=256, k_max=8)
    drafter = ModelDrafter(model, target, 4)
    gen = speculative_generate(target, drafter, PROMPTS[:1], 4, StopCondition(30, stop_strings=[stop_at], decode=decode))
    assert gen.tokens[0] == reference[:8]


def test_sampled_runs_reproduce_per_seed(model):
    def run(seed):
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        target = TorchEngine(model, batch=2, max_seq_len=256, k_max=8)
        drafter = ModelDrafter(model, target, 3, sampling)
        return speculative_generate(target, drafter, PROMPTS, 3, StopCondition(30), sampling).tokens

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_bad_k_and_vocab(model, random_checkpoints):
    target = TorchEngine(model, batch=1, max_seq_len=256, k_max=4)
    with pytest.raises(SpecdecError, match="outside 0..4"):
        speculative_generate(target, None, PROMPTS[:1], 5, StopCondition(5))
    other = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=256)
    other.cfg = dataclasses.replace(other.cfg, vocab_size=1000)
    with pytest.raises(SpecdecError, match=r"model: drafter vocabulary of 1000 tokens, target's 512"):
        ModelDrafter(other, target, 2)
    with pytest.raises(SpecdecError, match=r"drafter vocabulary \(1000\) differs from the target's \(512\)"):
        speculative_generate(target, types.SimpleNamespace(vocab_size=1000), PROMPTS[:1], 2, StopCondition(5))


def test_fused_ngram_cycle_matches_the_host_loop(model):
    """The device-side n-gram drafter fused with verify/accept emits what the host loop emits, with the
    same drafts (same statistics)."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.engines.cycle_torch import FusedCycle
    from specdec.generate import run_cycles

    prompts = [[2, 5, 6, 7, 5, 6, 7, 5, 6], [2, 9, 9, 9, 9]]
    host = speculative_generate(TorchEngine(model, batch=2, max_seq_len=256), NgramDrafter(), prompts, 4, StopCondition(60))
    cycle = FusedCycle(TorchEngine(model, batch=2, max_seq_len=256), NgramDrafter().device_draft_fn("torch", 4), 4)
    fused = run_cycles(cycle, prompts, 4, StopCondition(60))
    assert fused.tokens == host.tokens
    assert fused.stats.as_dict()["per_position_acceptance"] == host.stats.as_dict()["per_position_acceptance"]
    assert host.stats.drafted > 0 and host.stats.accepted > 0


def test_stats_line_of_tokens_decoded_with_the_prefill():
    """Tokens from cycles timed with the prefill are not counted in tok/s; when every token came with it, the
    line says so rather than reporting 0 tok/s."""
    from specdec.generate import SpecStats

    some = SpecStats(k=0, kept=10, untimed_kept=4, decode_s=0.5)
    assert "10 tokens at 12 tok/s" in some.summary()
    every = SpecStats(k=0, kept=4, untimed_kept=4, prefill_s=0.9)
    assert "4 tokens, all within the prefill's time" in every.summary() and "tok/s" not in every.summary()
