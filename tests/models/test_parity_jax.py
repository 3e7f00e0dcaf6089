"""The JAX model against transformers and the PyTorch model on random checkpoints of every variant (fp32),
and greedy tokens of the real Gemma 3 270M against transformers.

Error is max |ours - reference| / max |reference| over the compared logits. Sequences run to 40 tokens: past
the sliding window (8), inside the ring (64 slots: its wrap is tests/engines/test_sliding_ring.py's). Every
chunk pattern runs through both frameworks, so each JAX result is checked against transformers' full forward and
against gemma_torch fed the same chunks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specdec.models import gemma_jax
from specdec.models.fp8_jax import quantize
from specdec.models.gemma_torch import GemmaModel
from specdec.models.random_init import MULTIMODAL_VARIANT, VARIANTS, build_hf_model

TOL = 1e-4
N = 40
K_MAX = 8
MAX_SEQ = 128


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


class Pair:
    """One variant in both frameworks: each runs a list of (tokens, positions) chunks on a fresh cache."""

    def __init__(self, path, variant):
        self.cfg, self.params = gemma_jax.load_params(path, jnp.float32)
        self.torch_model = GemmaModel.from_checkpoint(path, max_seq_len=MAX_SEQ)
        self.taps = (0, self.cfg.num_layers // 2)
        cfg, taps = self.cfg, self.taps
        self.forward = jax.jit(
            lambda p, t, pos, c: gemma_jax.forward(p, cfg, t, pos, c, hidden_layers=taps), donate_argnums=3
        )
        self.tokens = np.asarray(
            torch.randint(3, cfg.vocab_size, (2, N), generator=torch.Generator().manual_seed(7))
        )
        with torch.no_grad():
            self.ref = build_hf_model(variant)(torch.as_tensor(self.tokens), output_hidden_states=True)

    def run_jax(self, chunks):
        cache = gemma_jax.init_cache(self.cfg, len(chunks[0][0]), MAX_SEQ, K_MAX, jnp.float32)
        outs = []
        for tokens, positions in chunks:
            logits, hidden, cache = self.forward(self.params, jnp.asarray(tokens), jnp.asarray(positions, jnp.int32), cache)
            outs.append((np.asarray(logits), np.asarray(hidden)))
        return outs

    @torch.no_grad()
    def run_torch(self, chunks):
        cache = self.torch_model.allocate_cache(len(chunks[0][0]), K_MAX)
        outs = []
        for tokens, positions in chunks:
            logits, hidden = self.torch_model(torch.tensor(tokens), torch.tensor(positions), cache, hidden_layers=self.taps)
            outs.append((logits.numpy(), hidden.numpy()))
        return outs

    def check(self, chunks, keep, ref_logits):
        """JAX logits over `chunks` (the first keep[i] rows of chunk i) against ref_logits from transformers'
        full forward, and against the torch model fed the same chunks."""
        kept = lambda outs: np.concatenate([o[0][:, :n] for o, n in zip(outs, keep)], axis=1)  # noqa: E731
        ours = kept(self.run_jax(chunks))
        assert ours.shape == ref_logits.shape
        assert rel_err(ours, ref_logits) <= TOL
        assert rel_err(ours, kept(self.run_torch(chunks))) <= TOL


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, random_checkpoints):
    return Pair(random_checkpoints[request.param], request.param)


def positions(start, stop, batch=2):
    return np.broadcast_to(np.arange(start, stop)[None], (batch, stop - start))


def test_prefill(pair):
    pair.check([(pair.tokens, positions(0, N))], [N], pair.ref.logits.numpy())


def test_token_by_token_decode(pair):
    chunks = [(pair.tokens[:, t : t + 1], positions(t, t + 1)) for t in range(N)]
    pair.check(chunks, [1] * N, pair.ref.logits.numpy())


@pytest.mark.parametrize("prefix", [3, 11])
def test_chunks_after_prefix(pair, prefix):
    chunks = [(pair.tokens[:, :prefix], positions(0, prefix))]
    t, sizes = prefix, [K_MAX + 1, 2, 5, 1, 9, 3, 7]
    while t < N:
        size = min(sizes[(len(chunks) - 1) % len(sizes)], N - t)
        chunks.append((pair.tokens[:, t : t + size], positions(t, t + size)))
        t += size
    pair.check(chunks, [c[0].shape[1] for c in chunks], pair.ref.logits.numpy())


def test_single_row_decode(pair):
    """Batch 1, one token at a time: the shape of plain decode (and MoE's gathered-experts path)."""
    n = 20
    chunks = [(pair.tokens[:1, t : t + 1], positions(t, t + 1, batch=1)) for t in range(n)]
    pair.check(chunks, [1] * n, pair.ref.logits[:1, :n].numpy())


def test_rejected_drafts_leave_no_trace(pair):
    """Verify K+1 tokens of which only some are right, then continue from the first wrong one: the stale
    entries in the cache (and the ring slots they took) must not change any later logit."""
    rng = np.random.default_rng(3)
    chunks, keep, t = [(pair.tokens[:, :4], positions(0, 4))], [4], 4
    while t < N:
        size = min(K_MAX + 1, N - t)
        chunk = pair.tokens[:, t : t + size].copy()
        kept = int(rng.integers(1, size + 1))
        chunk[:, kept:] = rng.integers(3, pair.cfg.vocab_size, (2, size - kept))
        chunks.append((chunk, positions(t, t + size)))
        keep.append(kept)
        t += kept
    pair.check(chunks, keep, pair.ref.logits.numpy())


def test_rows_at_different_positions(pair):
    """Row 0 continues after its prefix while row 1 starts over (a new request in that slot), in one forward."""
    lag = 5
    rows = np.stack([pair.tokens[0, lag : lag + 20], pair.tokens[1, :20]])
    pos = np.stack([np.arange(lag, lag + 20), np.arange(0, 20)])
    logits = pair.run_jax([(pair.tokens[:, :lag], positions(0, lag)), (rows, pos)])[1][0]
    assert rel_err(logits[0], pair.ref.logits[0, lag : lag + 20].numpy()) <= TOL
    assert rel_err(logits[1], pair.ref.logits[1, :20].numpy()) <= TOL


def test_hidden_states_of_chosen_layers(pair):
    (_, hidden), = pair.run_jax([(pair.tokens, positions(0, N))])
    for j, layer in enumerate(pair.taps):
        assert rel_err(hidden[:, :, j], pair.ref.hidden_states[layer + 1].numpy()) <= TOL


def test_packed_projections_compute_the_same_model(pair):
    """The engines' weights: each layer's q/k/v (those it has) and gate/up in one matrix, read by one GEMM."""
    packed = gemma_jax.pack_projections(pair.params)
    for spec in pair.cfg.layers:
        p = f"layers.{spec.index}."
        members = ["q_proj"] + (["k_proj"] + ([] if spec.k_eq_v else ["v_proj"]) if spec.owns_cache else [])
        attention = [f"{p}self_attn.{m}.weight" for m in members]
        if len(members) > 1:
            assert not any(name in packed for name in attention)
            assert np.array_equal(packed[gemma_jax.packed_name(p + "self_attn.", members)],
                                  np.concatenate([pair.params[name] for name in attention]))
        else:
            assert packed[attention[0]] is pair.params[attention[0]]
        assert gemma_jax.packed_name(p + "mlp.", ["gate_proj", "up_proj"]) in packed
        assert f"{p}mlp.gate_proj.weight" not in packed and f"{p}mlp.down_proj.weight" in packed
    pair.params, original = packed, pair.params
    try:  # a wider product may round otherwise: held to transformers as the unpacked weights are
        (logits, hidden), = pair.run_jax([(pair.tokens, positions(0, N))])
    finally:
        pair.params = original
    assert rel_err(logits, pair.ref.logits.numpy()) <= TOL
    for j, layer in enumerate(pair.taps):
        assert rel_err(hidden[:, :, j], pair.ref.hidden_states[layer + 1].numpy()) <= TOL


def test_random_weights_made_packed_are_the_packed_random_weights(pair):
    key = jax.random.key(1)
    packed = gemma_jax.random_params(pair.cfg, key, jnp.float32, pack=True)
    expected = gemma_jax.pack_projections(gemma_jax.random_params(pair.cfg, key, jnp.float32))
    assert packed.keys() == expected.keys()
    assert all(np.array_equal(packed[name], expected[name]) for name in expected)


def test_random_weights_placed_a_layer_at_a_time_are_the_random_weights(pair):
    key, placed = jax.random.key(1), []

    def to_host(layer):
        placed.append(sorted({gemma_jax.layer_prefix(name) for name in layer}))
        return jax.device_get(layer)

    on_host = gemma_jax.random_params(pair.cfg, key, jnp.float32, place=to_host)
    expected = gemma_jax.random_params(pair.cfg, key, jnp.float32)
    assert all(len(prefixes) == 1 for prefixes in placed)  # one layer's, or tensors of no layer, a call
    assert len({prefix for prefix, in placed}) == pair.cfg.num_layers + 1
    assert on_host.keys() == expected.keys() and all(isinstance(a, np.ndarray) for a in on_host.values())
    assert all(np.array_equal(on_host[name], expected[name]) for name in expected)


def test_multimodal_checkpoint_loads_the_text_model(random_checkpoints):
    cfg, params = gemma_jax.load_params(random_checkpoints[MULTIMODAL_VARIANT], jnp.float32)
    dense_cfg, dense = gemma_jax.load_params(random_checkpoints["gemma4_dense"], jnp.float32)
    assert cfg == dense_cfg and params.keys() == dense.keys()
    assert all(np.array_equal(params[name], dense[name]) for name in dense)


# -- the real Gemma 3 270M -------------------------------------------------------------------------------

PROMPTS = {
    "code": "def fibonacci(n):",
    "prose": "The old lighthouse keeper",
    "question": "Question: What is the capital of France?\nAnswer:",
}
NEW_TOKENS = 64


@pytest.mark.slow
def test_real_gemma3_270m_greedy_matches_transformers():
    from transformers import Gemma3ForCausalLM

    from specdec.engines.verifier_jax import JaxEngine
    from specdec.models.gguf_import import default_checkpoint
    from specdec.models.tokenizer import Tokenizer

    path = default_checkpoint()
    tokenizer = Tokenizer.from_dir(path)
    hf = Gemma3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    engine = JaxEngine.from_checkpoint(path, dtype=jnp.float32, max_seq_len=256)
    for name, text in PROMPTS.items():
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_id
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = out[0, len(ids) :].tolist()
        assert engine.generate_fused(ids, NEW_TOKENS, eos) == expected, name


def test_a_split_linear_is_the_product_in_slices_added_in_order():
    """The 270M's gate/up (640 -> 4,096) at a decode forward's 8 rows runs as 4 slices of 160, added in float32 and
    rounded once: the product itself to float32 rounding; E4B's (20,480 columns) stays one product."""
    key_x, key_w = jax.random.split(jax.random.key(5))
    x = jax.random.normal(key_x, (1, 8, 640), jnp.float32)
    weight = jax.random.normal(key_w, (4096, 640), jnp.float32)
    assert gemma_jax._split_product(x, weight, multiple=32).shape == (4, 1, 8, 4096)
    assert gemma_jax._split_product(x, weight).shape == (2, 1, 8, 4096)  # q/k/v's slices: a multiple of 64
    slices = np.asarray(gemma_jax._split_product(x, weight, multiple=32))
    in_order = ((slices[0] + slices[1]) + slices[2]) + slices[3]
    assert np.array_equal(np.asarray(gemma_jax._split_linear(x, weight)), in_order)
    np.testing.assert_allclose(in_order, np.asarray(gemma_jax._linear(x, weight)), rtol=1e-4, atol=1e-3)
    wide = jax.random.normal(key_w, (20480, 64), jnp.float32)
    assert gemma_jax._split_product(x[..., :64], wide, multiple=32).shape[0] == 1


def test_a_decode_forwards_down_proj_splits_in_eight_where_its_weight_is_large(monkeypatch):
    """A down_proj of DOWN_SPLIT_BYTES or more for each 8 rows (at 8 rows E4B's in bf16, the 31B's in bf16 and FP8;
    at 16 the 31B's) in a decode forward: 8 slices (gemma_jax.DOWN_SPLITS); a smaller one (the 270M's, E4B's in FP8,
    E4B's at 16 rows) 4, which ran as fast or faster."""
    key_x, key_w = jax.random.split(jax.random.key(6))
    cases = [(fp8, rows, large) for fp8 in (False, True) for rows in (8, 16) for large in (False, True)]
    for fp8, rows, large in cases:
        x = jax.random.normal(key_x, (1, rows, 640), jnp.float32)
        params = {"mlp.gate_proj.weight": jax.random.normal(key_w, (2048, 640), jnp.float32),
                  "mlp.up_proj.weight": jax.random.normal(key_w, (2048, 640), jnp.float32),
                  "mlp.down_proj.weight": jax.random.normal(key_w, (640, 2048), jnp.float32)}
        if fp8:
            params = {name: quantize(weight) for name, weight in params.items()}
        down = params["mlp.down_proj.weight"]
        per_8_rows = (down.values if fp8 else down).nbytes // (rows // 8)
        monkeypatch.setattr(gemma_jax, "DOWN_SPLIT_BYTES", per_8_rows if large else per_8_rows + 1)
        splits = 8 if large else 4
        assert gemma_jax._mlp(params, "mlp.", x, split=True).shape == (splits, 1, rows, 640), (fp8, rows, large)
