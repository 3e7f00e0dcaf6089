"""FP8 weights (specdec.models.fp8): the quantization's bounds, the product against the dequantized weight, the JAX
engine with FP8 linears computing the model its values and scales stand for, losslessly (speculative = plain), with
and without the decode kernels, and the errors of what it does not take."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.engines.verifier_jax import JaxEngine
from specdec.models import decode_attention_jax, fp8, fp8_jax, gemma_jax
from specdec.models.random_init import write_random_checkpoint
from specdec.models.sharding_jax import make_mesh
from tests.models.test_decode_attention_jax import plain_and_speculative

E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: a normal value is within half a step of its own magnitude


def test_quantize_keeps_each_row_within_e4m3s_rounding():
    w = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32) * jnp.logspace(-3, 1, 64)[:, None]
    w = w.at[5].set(0.0)
    q = fp8_jax.quantize(w)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == (64,)
    values = np.asarray(q.values.astype(jnp.float32))
    assert np.isfinite(values).all() and np.abs(values).max() <= fp8.E4M3_MAX
    assert np.allclose(np.abs(values).max(axis=1)[np.arange(64) != 5], fp8.E4M3_MAX)  # each row's peak at 448
    assert q.scale[5] == 1.0 and not values[5].any()  # a row of zeros
    error = np.abs(np.asarray(fp8_jax.dequantized(q)) - np.asarray(w))
    # half a step: of the value's own magnitude for normals, of 2**-9 (times the scale) below 2**-6 (subnormals)
    bound = np.maximum(np.abs(np.asarray(w)) * E4M3_STEP / 2, np.asarray(q.scale)[:, None] * 2.0**-10)
    assert (error <= bound * (1 + 1e-6)).all(), float((error / bound).max())


def test_what_is_stored_in_fp8():
    assert fp8.quantizes("layers.0.self_attn.q_proj+k_proj+v_proj.weight", (96, 32))
    assert fp8.quantizes("layers.0.mlp.down_proj.weight", (32, 64))
    assert fp8.quantizes("layers.0.per_layer_input_gate.weight", (8, 32))
    assert fp8.quantizes("per_layer_model_projection.weight", (64, 32))
    assert fp8.quantizes("lm_head.weight", (256, 32))
    assert not fp8.quantizes("embed_tokens.weight", (256, 32))  # a lookup reads one row
    assert not fp8.quantizes("layers.0.router.proj.weight", (4, 32))
    assert not fp8.quantizes("layers.0.experts.gate_up_proj", (4, 64, 32))
    assert not fp8.quantizes("layers.0.input_layernorm.weight", (32,))


def test_the_product_is_the_dequantized_weights():
    q = fp8_jax.quantize(jax.random.normal(jax.random.key(1), (40, 24)))
    x = jax.random.normal(jax.random.key(2), (3, 5, 24))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(fp8_jax.product(x, q), x @ fp8_jax.dequantized(q).T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gemma_jax._linear(x, q), x @ fp8_jax.dequantized(q).T, rtol=1e-5, atol=1e-5)
        # the slices of a split reduction, each scaled, add up to the product
        wide, rows = fp8_jax.quantize(jax.random.normal(jax.random.key(3), (1024, 256))), jnp.ones((1, 8, 256))
        split = gemma_jax._split_product(rows, wide)
        assert split.shape[0] > 1
        np.testing.assert_allclose(split.sum(0), gemma_jax._linear(rows, wide), rtol=1e-5, atol=1e-4)


def dequantized_params(params):
    return {name: fp8_jax.dequantized(w) if isinstance(w, fp8_jax.Fp8Weight) else w for name, w in params.items()}


@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e", "gemma4_moe"])
def test_an_fp8_engine_computes_the_model_its_weights_stand_for(random_checkpoints, variant):
    """A decode forward over FP8 linears (packed, a tied head's FP8 copy) gives the logits of the same forward over
    their dequantized float32 weights; the token table keeps its exact rows."""
    with jax.default_matmul_precision("highest"):
        engine = JaxEngine.from_checkpoint(random_checkpoints[variant], dtype=jnp.float32, fp8=True, max_seq_len=64,
                                           k_max=4)
        params = engine.params
        assert engine.fp8 and isinstance(params["lm_head.weight"], fp8_jax.Fp8Weight)
        assert params["embed_tokens.weight"].dtype == jnp.float32
        assert any("+" in name and isinstance(w, fp8_jax.Fp8Weight) for name, w in params.items())  # packed q/k/v
        tokens = jnp.asarray([[2, 17, 40, 9, 33, 5, 1, 60]], jnp.int32)
        positions = jnp.arange(8, dtype=jnp.int32)[None]

        def run(params, cfg):
            return jax.jit(lambda p: gemma_jax.forward(p, cfg, tokens, positions, engine.cache, commit_first=True)[0])(
                params)

        # the reference reads its head as lm_head.weight, as an untied model does
        untied = dataclasses.replace(engine.cfg, tie_word_embeddings=False)
        logits, reference = run(params, engine.cfg), run(dequantized_params(params), untied)
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant, kernels", [("gemma3", False), ("gemma4_e", True)])
def test_fp8_greedy_speculative_output_is_the_plain_decodes(tmp_path, variant, kernels):
    """The lossless gate on FP8 weights, through XLA's layers (gemma3) and through every decode kernel, interpreted
    (gemma4_e: per-layer inputs, KV sharing): the fused loop with a drafter wrong at every 5th position emits the plain
    decode's tokens; the background transfer loads the same weights."""
    path = write_random_checkpoint(variant, tmp_path / variant, hidden_size=128, intermediate_size=128)
    with jax.default_matmul_precision("highest"), \
            (decode_attention_jax.interpreted() if kernels else contextlib.nullcontext()):
        engine = JaxEngine.from_checkpoint(path, dtype=jnp.float32, fp8=True, max_seq_len=128, k_max=4)
        plain, speculative = plain_and_speculative(engine)
        background = JaxEngine.from_checkpoint(path, dtype=jnp.float32, fp8=True, max_seq_len=128, k_max=4,
                                               background=True)
        assert jax.tree.structure(background.param_shapes) == jax.tree.structure(engine.param_shapes)
        assert background.generate([1, 2, 3], 6) == engine.generate([1, 2, 3], 6)
    assert speculative == plain


def test_fp8_weights_on_a_mesh_and_in_one_part_decode_as_on_one_device(random_checkpoints):
    """float32 on the CPU: FP8 weights placed on a mesh of one device, or computed in one tensor-parallel part,
    decode one device's tokens (two devices: test_jax_engine's parts tests)."""
    path = random_checkpoints["gemma3"]
    cfg, params = gemma_jax.load_params(path, jnp.float32, fp8=True)
    tokens = JaxEngine(cfg, params, max_seq_len=64, k_max=4).generate([1, 2, 3], 8)
    assert JaxEngine(cfg, params, mesh=make_mesh(1), max_seq_len=64, k_max=4).generate([1, 2, 3], 8) == tokens
    in_parts = JaxEngine.from_checkpoint(path, dtype=jnp.float32, fp8=True, tp_parts=1, max_seq_len=64, k_max=4)
    assert in_parts.fp8 and in_parts.generate([1, 2, 3], 8) == tokens


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs JAX on a GPU")
@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e"])
def test_on_a_gpu_fp8_weights_keep_speculative_output_plain_decodings(tmp_path, variant, monkeypatch):
    """bf16 with FP8 linears through the compiled decode kernels, whose spare programs read the FP8 values ahead as
    bytes: the fused loop's speculative output is the plain decode's."""
    from specdec.models import decode_norms_jax

    read_ahead = []
    traced = decode_norms_jax.residual_norms
    monkeypatch.setattr(decode_norms_jax, "residual_norms",
                        lambda *a, **kw: read_ahead.append(len(kw.get("prefetch", ()))) or traced(*a, **kw))
    path = write_random_checkpoint(variant, tmp_path / variant, hidden_size=128, intermediate_size=128)
    engine = JaxEngine.from_checkpoint(path, dtype=jnp.bfloat16, fp8=True, max_seq_len=128, k_max=4)
    plain, speculative = plain_and_speculative(engine)
    assert max(read_ahead) > 0  # the next layer's FP8 q/k/v, read ahead
    assert speculative == plain
