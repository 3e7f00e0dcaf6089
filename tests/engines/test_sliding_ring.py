"""The sliding layers' ring of KV slots, run past its wrap, at windows whose rings straddle the rounding to
whole splits of 64 slots: each verify's kept logits against transformers' full forward over the same tokens, in
both engines.

The random test models' window of 8 hides a ring one forward short: 8 and 8 + 15 slots both round up to one split of
64, and sequences of under 64 tokens never wrap it. Here, at k_max 8 (16-row forwards): a window of 64 needs 64 + 15
slots, two splits where 64 alone would take one; a window of 49 needs exactly one split, so the ring has no slot to
spare. Each run wraps its ring: a prompt (a short one, or one longer than the ring, whose prefill keeps its last
positions), then verifies of kept and rejected drafts out to 40 positions past the ring.
A model drafter's engine chains forwards past the committed length and holds k_max more slots: at a window of 49
they take a second split (49 + 15 + 8 > 64), which a missing lookahead would leave out.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.drafters.model import ModelDrafter, load_source
from specdec.generate import HostCycle
from specdec.models.config import SLIDING, GemmaConfig
from specdec.models.random_init import build_hf_model, write_random_checkpoint
from specdec.sampling import SamplingParams

K_MAX = 8
MAX_SEQ = 256
PAST_THE_RING = 40
TOL = 1e-4
CHUNKS = [K_MAX + 1, 1, 5, K_MAX + 1, 3, 2, 7]  # tokens a verify feeds, in turn
PROMPT_LEN = 6
LONG_PROMPT = 9  # positions past the ring


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=[49, 64])
def windowed(request, tmp_path_factory):
    """(a random Gemma 3 of that window as a checkpoint, its transformers twin)."""
    window = request.param
    path = write_random_checkpoint("gemma3", tmp_path_factory.mktemp(f"window_{window}"), sliding_window=window)
    return path, build_hf_model("gemma3", sliding_window=window)


def torch_engine(path):
    from specdec.engines.verifier_torch import TorchEngine
    from specdec.models.gemma_torch import GemmaModel

    return TorchEngine(GemmaModel.from_checkpoint(path, max_seq_len=MAX_SEQ), max_seq_len=MAX_SEQ, k_max=K_MAX)


def jax_engine(path):
    pytest.importorskip("jax")
    from specdec.engines.verifier_jax import JaxEngine

    return JaxEngine.from_checkpoint(path, max_seq_len=MAX_SEQ, k_max=K_MAX)


def verify_and_commit(engine, chunk: np.ndarray, keep: int) -> np.ndarray:
    """Verify one row's chunk, commit its first `keep` tokens -> the chunk's logits [T, V]."""
    if engine.framework == "jax":
        import jax.numpy as jnp

        logits = engine.verify(jnp.asarray(chunk[None], jnp.int32)).logits
        engine.commit(jnp.full((1,), keep, jnp.int32))
    else:
        logits = engine.verify(torch.as_tensor(chunk[None])).logits
        engine.commit(torch.full((1,), keep))
    return np.asarray(logits[0])


@pytest.mark.parametrize("long_prompt", [False, True], ids=["short_prompt", "long_prompt"])
@pytest.mark.parametrize("make_engine", [torch_engine, jax_engine], ids=["torch", "jax"])
def test_verifies_past_the_rings_wrap_match_a_full_forward(windowed, make_engine, long_prompt):
    path, hf = windowed
    engine = make_engine(path)
    ring = engine.cfg.cache_slots(MAX_SEQ, K_MAX)[SLIDING]
    assert ring < MAX_SEQ  # a ring, not every position
    prompt_len = ring + LONG_PROMPT if long_prompt else PROMPT_LEN
    total = ring + PAST_THE_RING
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, engine.cfg.vocab_size, total)
    with torch.no_grad():
        reference = hf(torch.as_tensor(tokens[None])).logits[0].numpy()

    engine.prefill([tokens[:prompt_len].tolist()])
    ours, expected, t, turn = [], [], prompt_len - 1, 0
    while t < total:
        size = min(CHUNKS[turn % len(CHUNKS)], total - t)
        keep = int(rng.integers(1, size + 1))  # the rest are rejected drafts: their keys/values written, then dropped
        chunk = tokens[t : t + size].copy()
        chunk[keep:] = rng.integers(3, engine.cfg.vocab_size, size - keep)
        ours.append(verify_and_commit(engine, chunk, keep)[:keep])
        expected.append(reference[t : t + keep])
        t, turn = t + keep, turn + 1
    assert rel_err(np.concatenate(ours), np.concatenate(expected)) <= TOL





@pytest.mark.parametrize("windowed", [49], indirect=True)  # at 64, 64 + 15 and 64 + 15 + 8 take two splits alike
def test_a_model_drafters_cache_past_its_rings_wrap_is_a_fresh_prefill_of_the_context(windowed, tmp_path):
    """A drafter of other weights, whose drafts the target rejects: each cycle's chained draft forwards write up to
    k_max - 1 positions further past the committed length than a verify does, and the rejection rolls them back.
    Its ring holds them (lookahead), so no position still in the window is overwritten: after cycles past the
    ring's wrap, the drafter's first draft has the distribution a drafter started on the whole context gives it.
    (A drafter whose drafts are all accepted never rolls back: it would not tell. The random models repeat a token
    whatever the context, so drafts are compared by their distribution, which the first draft's sampling leaves as
    it is.)"""
    path, _ = windowed
    window = GemmaConfig.from_file(path / "config.json").sliding_window
    other = write_random_checkpoint("gemma3", tmp_path / "drafter", seed=1, sliding_window=window)
    target = torch_engine(path)
    source = load_source(other, target)
    sampling = SamplingParams(temperature=1.0, seed=3)
    drafter = ModelDrafter(source, target, K_MAX, sampling)
    drafter_ring = target.cfg.cache_slots(MAX_SEQ, K_MAX, lookahead=K_MAX)[SLIDING]
    prompt = np.random.default_rng(1).integers(3, target.cfg.vocab_size, drafter_ring + LONG_PROMPT).tolist()
    cycle = HostCycle(target, drafter, K_MAX, sampling)
    cycle.start([prompt])
    emitted, cycles = [], 0
    while len(emitted) < PAST_THE_RING // 2:
        emitted += cycle.step().emitted(0)
        cycles += 1
    assert len(emitted) < cycles * (K_MAX + 1)  # drafts were rejected
    continued = drafter.propose(K_MAX).probs[:, 0]
    fresh = ModelDrafter(source, target, K_MAX, sampling)
    target.prefill([prompt + emitted])
    fresh.begin([prompt + emitted])
    np.testing.assert_allclose(continued, fresh.propose(K_MAX).probs[:, 0], rtol=0, atol=1e-6)
