"""The real Gemma 3 270M (the embedded default): greedy tokens identical to transformers."""

import pytest
import torch

from specdec.models.gguf_import import default_checkpoint
from specdec.models.tokenizer import Tokenizer
from specdec.models.torch_gemma import GemmaModel
from specdec.verifiers.torch_engine import TorchEngine

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
