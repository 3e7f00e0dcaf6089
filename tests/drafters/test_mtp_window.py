"""An MTP assistant whose sliding window is narrower than its target's attends to its own window. Every other test's
assistant shares the target's window of 8, where reading the target's window instead passes unseen. Torch alone: JAX
reads the window the same way (mtp_jax), and an engine and assistant compiled for this test alone cost 20 s."""

import json

import pytest

from specdec.drafters.mtp import load_assistant
from specdec.models.random_init import write_random_assistant
from tests.drafters.test_mtp import K, LONG_PROMPT, TOL, begun, drafted, make_engine, rel_err, transformers_draft

ASSISTANT_WINDOW = 4  # the target's is 8; LONG_PROMPT runs past both


@pytest.fixture(scope="module")
def narrow_assistant(tmp_path_factory):
    path = write_random_assistant("gemma4_dense", tmp_path_factory.mktemp("narrow") / "assistant", seed=3)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["sliding_window"] = ASSISTANT_WINDOW  # no weight depends on it
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_narrower_assistant_drafts_what_transformers_drafts(narrow_assistant, random_checkpoints):
    target = random_checkpoints["gemma4_dense"]
    context, ref_logits, ref_tokens = transformers_draft(target, narrow_assistant, LONG_PROMPT[:-1], K)
    assistant = load_assistant(narrow_assistant)
    assert assistant.cfg.text.sliding_window == ASSISTANT_WINDOW
    engine = make_engine("torch", target)
    logits, draft, _ = drafted(engine, begun(engine, assistant, [context]))
    for step in range(K):
        assert rel_err(logits[step, 0], ref_logits[step]) <= TOL, step
    assert draft.tolist() == [ref_tokens]
