"""The EAGLE-3 loss against a plain numpy reference built from the target's full logits, the chunked
full-vocabulary argmax, and offline (stored states) against online (the target run in the step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.drafters import eagle3_jax as ej
from specdec.drafters.eagle3 import Eagle3Config, build_draft_vocab, draft_to_target
from specdec.models import gemma_jax
from specdec.models.checkpoint import checkpoint_fingerprint
from specdec.training import eagle3 as train
from specdec.training.data import TrainData
from tests.training.distilled import write_dataset

SEQ = 48


@pytest.fixture(scope="module")
def setup(target, online_data):
    cfg, params = gemma_jax.load_params(target, jnp.float32)
    data = TrainData(online_data)
    # Half the target's vocabulary, without the most frequent response token: some target argmaxes fall
    # outside it.
    counts = data.response_token_counts(cfg.vocab_size)
    counts[counts.argmax()] = -1
    d2t, t2d = build_draft_vocab(counts, 256)
    hcfg = Eagle3Config.for_target(cfg, 256, fingerprint=checkpoint_fingerprint(target))
    head = {k: v * (3.0 if k.endswith("proj.weight") else 1.0)
            for k, v in train.init_head_params(hcfg, seed=1).items()}
    vocab = {"draft_ids": jnp.asarray(draft_to_target(d2t), jnp.int32), "t2d": jnp.asarray(t2d)}
    return cfg, params, data, hcfg, head, vocab, d2t, t2d


def test_chunked_argmax_is_the_full_argmax(setup):
    cfg, params, data, *_ = setup
    batch = data.batch(np.arange(4), SEQ)
    _, last = jax.jit(lambda p, t: train.target_states(p, cfg, t, (1, 2, 3)))(params, jnp.asarray(batch["tokens"]))
    full = np.asarray(gemma_jax.final_logits(params, cfg, last))
    for chunk in (512, 100, 7):  # one chunk; chunks that do not divide the vocabulary (padded)
        argmax = jax.jit(lambda p, x, chunk=chunk: train.target_argmax(p, cfg, x, chunk))(params, last)
        np.testing.assert_array_equal(np.asarray(argmax), full.argmax(-1))
    # The restricted head gives the full logits' columns.
    ids = jnp.asarray([5, 0, 511, 17])
    np.testing.assert_allclose(np.asarray(gemma_jax.final_logits(params, cfg, last, ids)), full[..., [5, 0, 511, 17]],
                               rtol=1e-6, atol=1e-6)


def test_loss_matches_a_numpy_reference(setup):
    cfg, params, data, hcfg, head, vocab, d2t, t2d = setup
    steps = 3
    batch = data.batch(np.arange(8), SEQ)
    settings = train.LossSettings(ttt_steps=steps, step_weight_decay=0.8, online=True, argmax_chunk=100)
    loss, m = jax.jit(lambda h, p, v, b: train.eagle3_loss(h, hcfg, cfg, p, v, b, settings))(
        head, params, vocab, {k: jnp.asarray(v) for k, v in batch.items()})

    # Reference: the target's full logits, the head's logits from ttt_logits, the rule written out per (j, b, t).
    @jax.jit
    def reference(head, params, tokens):
        positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
        cache = gemma_jax.init_cache(cfg, 8, SEQ, 0, jnp.float32)
        full, hidden, _ = gemma_jax.forward(params, cfg, tokens, positions, cache, hidden_layers=hcfg.taps)
        return full, ej.ttt_logits(head, hcfg, params["embed_tokens.weight"], tokens, ej.fuse(head, hidden), steps)

    tokens = jnp.asarray(batch["tokens"])
    full, logits = (np.asarray(x, np.float64) for x in reference(head, params, tokens))
    ids = draft_to_target(d2t)
    B, N = tokens.shape
    want_loss, want_acc, want_count = np.zeros(steps), np.zeros(steps), np.zeros(steps, int)
    for j in range(steps):
        ce, hits = [], []
        for b in range(B):
            for t in range(N):
                p_pos, y_pos = t + 1 + j, t + 2 + j
                if y_pos >= N or not batch["mask"][b, y_pos] or not batch["valid"][b, y_pos]:
                    continue
                if not t2d[full[b, p_pos].argmax()]:
                    continue
                z = full[b, p_pos, ids]
                p = np.exp(z - z.max())
                p /= p.sum()
                q = logits[j, b, t]
                logq = q - q.max() - np.log(np.exp(q - q.max()).sum())
                ce.append(-(p * logq).sum())
                hits.append(q.argmax() == z.argmax())
        want_loss[j], want_acc[j], want_count[j] = np.mean(ce), np.mean(hits), len(ce)
    assert 0 < want_count[0] < batch["mask"].sum()  # some positions dropped for an argmax outside the vocabulary
    np.testing.assert_array_equal(np.asarray(m["step_count"]), want_count)
    np.testing.assert_allclose(np.asarray(m["step_loss"]), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["step_acc"]), want_acc, rtol=1e-6)
    np.testing.assert_allclose(float(loss), sum(0.8**j * want_loss[j] for j in range(steps)), rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 2e-2)])
def test_offline_features_give_the_online_loss(setup, target, rows, tmp_path, dtype, tol):
    """The same batch: the target's states read from the data (float32 exactly, float16 as distill stores
    them by default) against the target run inside the step."""
    cfg, params, data, hcfg, head, vocab, *_ = setup
    offline = TrainData(write_dataset(tmp_path / "d", rows, target, features=dtype), offline=True)
    rows_ = np.arange(8)
    online_batch, offline_batch = data.batch(rows_, SEQ), offline.batch(rows_, SEQ)
    np.testing.assert_array_equal(online_batch["tokens"], offline_batch["tokens"])
    assert offline_batch["taps"].dtype == np.dtype(dtype)
    mesh = train.data_mesh(jax.devices()[:1])
    results = []
    for online, batch in ((True, online_batch), (False, offline_batch)):
        settings = train.LossSettings(ttt_steps=3, online=online)
        batch = {k: v for k, v in batch.items() if k != "valid"}
        results.append(train.make_eval_loss(hcfg, cfg, settings, mesh)(head, params, vocab, batch))
    (on_loss, on), (off_loss, off) = results
    np.testing.assert_allclose(float(off_loss), float(on_loss), rtol=tol)
    np.testing.assert_allclose(np.asarray(off["step_loss"]), np.asarray(on["step_loss"]), rtol=tol)
    if dtype == "float32":
        np.testing.assert_array_equal(np.asarray(off["step_count"]), np.asarray(on["step_count"]))
