"""The real Gemma 3 270M (the embedded default): greedy tokens identical to transformers, and speculative
greedy tokens identical to plain decoding."""

import pytest
import torch

from specdec.engines.verifier_torch import TorchEngine
from specdec.models.gemma_torch import GemmaModel
from specdec.models.gguf_import import default_checkpoint
from specdec.models.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPTS = {
    "code": "def fibonacci(n):",
    "prose": "The old lighthouse keeper climbed the stairs one last time.",
    "question": "Question: What is the capital of France?\nAnswer:",
}
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def checkpoint():
    return default_checkpoint()


@pytest.fixture(scope="module")
def hf_greedy(checkpoint):
    from transformers import Gemma3ForCausalLM

    hf = Gemma3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = Tokenizer.from_dir(checkpoint)
    out = {}
    with torch.no_grad():
        for name, text in PROMPTS.items():
            ids = tok.encode(text)
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
            out[name] = (ids, gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def model(checkpoint):
    return GemmaModel.from_checkpoint(checkpoint, max_seq_len=256)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_match_transformers(model, hf_greedy, name):
    ids, expected = hf_greedy[name]
    assert len(expected) == NEW_TOKENS
    assert TorchEngine(model, max_seq_len=256).greedy_decode(ids, NEW_TOKENS) == expected


@pytest.mark.parametrize("name", ["code", "prose"])
def test_speculative_greedy_identical_to_plain_decode(model, checkpoint, name):
    """No tolerance: n-gram speculative decoding at K = 1, 4, 8 emits exactly the plain decode's tokens."""
    from specdec import gates

    (eut,) = gates.torch_engines(model, graphs=False)
    ids = Tokenizer.from_dir(checkpoint).encode(PROMPTS[name])
    results = gates.gate_greedy(eut, ids, 32, ks=[1, 4, 8])
    assert all(r.passed for r in results), [r.detail for r in results if not r.passed]
