"""The training-time test computes, for every base position at once, exactly what drafting computes one
draft at a time against the head's cache: the alignment of training and inference, checked directly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.drafters import eagle3_jax as ej
from specdec.drafters.eagle3 import Eagle3Config, random_head

# Compiled once per shape (eager JAX dispatches each op on its own: slow).
step = jax.jit(ej.step, static_argnums=1)
ttt_logits = jax.jit(ej.ttt_logits, static_argnums=(1, 5))


def tiny_config(**kw):
    base = dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=50,
                draft_vocab_size=50, aux_layer_ids=(1, 2, 3), target_num_layers=5)
    return Eagle3Config(**{**base, **kw})


@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_matches_chained_drafting(steps):
    cfg = tiny_config()
    params = {n: jnp.asarray(a) for n, a in random_head(cfg, seed=1).params.items()}
    params = {n: (a * 5 if n.endswith("proj.weight") else a) for n, a in params.items()}  # sharper attention
    rng = np.random.default_rng(0)
    N = 9
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, N)), jnp.int32)
    features = jnp.asarray(rng.standard_normal((1, N, cfg.hidden_size)), jnp.float32)
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    ttt = np.asarray(ttt_logits(params, cfg, embed, tokens, features, steps))

    for t in range(N - 1 - steps):
        # Drafting after position t: the cache holds the pairs (feature s, token s+1) for s <= t ...
        cache = ej.init_cache(cfg, 1, 32, jnp.float32)
        positions = jnp.arange(t + 1)[None]
        out, logits, cache = step(params, cfg, embed[tokens[:, 1 : t + 2]], features[:, : t + 1], positions, cache)
        np.testing.assert_allclose(logits[0, t], ttt[0, 0, t], rtol=1e-4, atol=1e-4)
        hidden = out[:, t : t + 1]
        # ... then each draft feeds the head its own output and the next token, one position on.
        for j in range(1, steps):
            token = tokens[:, t + 1 + j : t + 2 + j]
            hidden, logits, cache = step(params, cfg, embed[token], hidden, jnp.asarray([[t + j]]), cache)
            np.testing.assert_allclose(logits[0, 0], ttt[j, 0, t], rtol=1e-4, atol=1e-4)


def test_ttt_step_reads_the_token_after_next():
    """Hand-built check of the alignment: step 0 at position t reads token t+1 (changing token t+1 changes
    position t's logits, changing token t+2 does not)."""
    cfg = tiny_config()
    params = {n: jnp.asarray(a) for n, a in random_head(cfg, seed=2).params.items()}
    rng = np.random.default_rng(1)
    tokens = np.asarray(rng.integers(0, cfg.vocab_size, (1, 6)), np.int32)
    features = jnp.asarray(rng.standard_normal((1, 6, cfg.hidden_size)), jnp.float32)
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    base = np.asarray(ttt_logits(params, cfg, embed, jnp.asarray(tokens), features, 1))[0, 0]
    t = 2
    for changed, affects in ((t + 1, True), (t + 2, False)):
        other = tokens.copy()
        other[0, changed] = (other[0, changed] + 1) % cfg.vocab_size
        logits = np.asarray(ttt_logits(params, cfg, embed, jnp.asarray(other), features, 1))[0, 0]
        assert (not np.allclose(logits[t], base[t])) == affects


@pytest.mark.parametrize("k", [1, 4])
def test_a_p_eagle_heads_drafts_are_its_training_steps(k):
    """P-EAGLE: what training scores at step j of base t (the real rows up to t, then mask rows) is what drafting
    proposes as draft j after a prompt ending at t + 1, in one forward, on either engine's device state: the
    sampled drafts' distributions are the training step's softmax."""
    import torch

    from specdec.drafters.eagle3_jax import JaxEagle3
    from specdec.drafters.eagle3_torch import TorchEagle3
    from specdec.sampling import SamplingParams

    cfg = tiny_config(mask_token_id=7)
    head = random_head(cfg, seed=3)
    head.params = {n: (a * 5 if n.endswith("proj.weight") else a) for n, a in head.params.items()}  # sharper
    params = {n: jnp.asarray(a) for n, a in head.params.items()}
    rng = np.random.default_rng(2)
    N = 10
    prompt = rng.integers(0, cfg.vocab_size, N).tolist()
    taps = rng.standard_normal((N - 1, 3, cfg.hidden_size)).astype(np.float32)  # the target's, at positions 0..N-2
    embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)

    features = jnp.concatenate([ej.fuse(params, jnp.asarray(taps)), jnp.zeros((1, cfg.hidden_size))])[None]
    ttt = ttt_logits(params, cfg, jnp.asarray(embed), jnp.asarray([prompt], jnp.int32), features, k)
    expected = np.asarray(jax.nn.softmax(ttt[:, 0, N - 2], axis=-1))  # draft j: step j at the last committed position
    sampling = SamplingParams(temperature=1.0, seed=0)  # no filters: the draft distribution is the head's softmax

    jax_state = JaxEagle3(head, batch=1, max_seq_len=64, k=k, sampling=sampling)
    target = {"embed_tokens.weight": jnp.asarray(embed)}
    state = jax_state.begin_rows(target, jax_state.init_state(), {0: prompt}, {0: taps})
    _, draft_len, probs, _ = jax_state.draft(target, jax_state.params, state)
    np.testing.assert_allclose(np.asarray(probs)[0], expected, rtol=1e-4, atol=1e-6)
    assert int(draft_len[0]) == k

    table = torch.from_numpy(embed)
    torch_state = TorchEagle3(head, lambda ids: table[ids], "cpu", batch=1, max_seq_len=64, k=k, sampling=sampling)
    torch_state.begin_row(0, prompt, torch.from_numpy(taps))
    with torch.inference_mode():
        _, _, probs = torch_state.draft()
    np.testing.assert_allclose(probs[0].numpy(), expected, rtol=1e-4, atol=1e-6)
