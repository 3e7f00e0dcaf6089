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

from specdec.drafters.model import ModelDrafter, drafter_engine
from specdec.generate import StopCondition, run_cycles
from specdec.models.config import SLIDING
from specdec.models.random_init import build_hf_model, write_random_checkpoint

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
    from specdec.models.torch_gemma import GemmaModel
    from specdec.verifiers.torch_engine import TorchEngine

    return TorchEngine(GemmaModel.from_checkpoint(path, max_seq_len=MAX_SEQ), max_seq_len=MAX_SEQ, k_max=K_MAX)


def jax_engine(path):
    pytest.importorskip("jax")
    from specdec.verifiers.jax_engine import JaxEngine

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
def test_a_model_drafting_for_itself_accepts_every_draft_past_its_rings_wrap(windowed):
    """The target drafting for itself proposes the target's own tokens, so every draft is accepted, as long as the
    drafter's cache holds what the target's holds: its chained forwards write up to k_max - 1 positions further past
    the committed length, which its ring must not let overwrite a position still in the window. Torch alone: the
    drafter's engine takes its ring from the same settings in JAX (drafter_engine), whose compiled cycle costs 20 s."""
    from specdec.verifiers.torch_engine import FusedCycle

    path, _ = windowed
    target = torch_engine(path)
    drafter = ModelDrafter(drafter_engine(target, target), target, K_MAX)
    drafter_ring = target.cfg.cache_slots(MAX_SEQ, K_MAX, lookahead=K_MAX)[SLIDING]
    cycle = FusedCycle(target, drafter.device_draft_fn("torch", K_MAX), K_MAX)
    prompt = np.random.default_rng(1).integers(3, target.cfg.vocab_size, PROMPT_LEN).tolist()
    gen = run_cycles(cycle, [prompt], K_MAX, StopCondition(drafter_ring + PAST_THE_RING))
    assert len(gen.tokens[0]) == drafter_ring + PAST_THE_RING
    assert gen.stats.acceptance_rate == 1.0
