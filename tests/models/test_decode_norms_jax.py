"""decode_norms_jax: the residual-add kernel, run by Pallas's interpreter on the CPU, against the layer's own XLA path
and a row independent of the others; on a GPU, compiled in bf16 against float32. The engine with it is tested with
every kernel in test_decode_attention_jax.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.models import decode_attention_jax, decode_norms_jax
from specdec.models.gemma_jax import _rms_norm
from tests.models.test_decode_attention_jax import in_float32, jax_gpu, norm_config

# batch, tokens, hidden, splits of the product's reduction (1: the product itself), Gemma 4 (a layer scalar)
SHAPES = {
    "270m": (1, 8, 640, 4, False),
    "270m down_proj: eight slices": (1, 8, 640, 8, False),
    "e4b per-layer projection: one product": (1, 8, 2560, 1, True),
    "31b, batch 2: three runs": (2, 8, 5376, 4, True),
    "test model": (1, 8, 128, 2, False),
}


def case(shape, seed: int, dtype):
    """The splits' products (float32 where split, else in the model's dtype), the residual, the two norms' weights
    and the layer scalar (Gemma 4; else None)."""
    batch, tokens, hidden, splits, gemma4 = shape
    rng = np.random.default_rng(seed)
    partials = jnp.asarray(rng.standard_normal((splits, batch, tokens, hidden)) / splits,
                           jnp.float32 if splits > 1 else dtype)
    residual = jnp.asarray(rng.standard_normal((batch, tokens, hidden)) * 4, dtype)
    post, after = (jnp.asarray(rng.standard_normal(hidden) * 0.3, dtype) for _ in range(2))
    scale = jnp.asarray([0.7], dtype) if gemma4 else None
    return partials, residual, post, after, scale


def xla_residual_norms(partials, residual, post, after, scale):
    """What gemma_jax's layer computes without the kernel: the product in the model's dtype, its norm, the residual
    add, the layer scalar, the next norm."""
    cfg = norm_config(gemma4=scale is not None)
    x = residual + _rms_norm(sum(partials[1:], partials[0]).astype(residual.dtype), post, cfg)
    if scale is not None:
        x = x * scale
    return x, _rms_norm(x, after, cfg)


def residual_norms_kernel(args, prefetch=()):
    """decode_norms_jax.residual_norms for a case's arguments (Gemma 4's where it has a layer scalar)."""
    cfg = norm_config(gemma4=args[4] is not None)
    return functools.partial(decode_norms_jax.residual_norms, eps=cfg.rms_norm_eps,
                             weight_offset=cfg.norm_weight_offset, prefetch=prefetch)


def run(args, kernel=True, prefetch=()):
    return jax.jit(residual_norms_kernel(args, prefetch) if kernel else xla_residual_norms)(*args)


def same_bits_with_weights_to_prefetch(args):
    """The kernel's outputs with spare programs reading two weights into L2 are the bits it gives without them."""
    block = decode_attention_jax.PREFETCH_BLOCK
    weights = (jnp.ones((2, block), jnp.bfloat16), jnp.full((block // 4, 4), 2.0, jnp.bfloat16))
    for got, want in zip(run(args, prefetch=weights), run(args)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_runs_are_powers_of_two_covering_the_row():
    assert decode_norms_jax.runs(640) == [(0, 512), (512, 128)]
    assert decode_norms_jax.runs(5376) == [(0, 4096), (4096, 1024), (5120, 256)]
    assert decode_norms_jax.runs(128) == [(0, 128)]


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_kernel_computes_what_the_layer_computes_without_it(name):
    args = case(SHAPES[name], seed=1, dtype=jnp.float32)
    with in_float32():
        assert decode_norms_jax.takes(SHAPES[name][2], jnp.float32)
        ours = run(args)
    theirs = run(args, kernel=False)
    for got, want in zip(ours, theirs):
        assert got.shape == want.shape
        assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-5 * np.abs(np.asarray(want)).max()


def test_a_rows_outputs_depend_on_its_own_row_alone():
    args = case(SHAPES["31b, batch 2: three runs"], seed=2, dtype=jnp.float32)
    other = (args[0].at[:, :, 1:].set(-args[0][:, :, 1:]), args[1].at[:, 1:].multiply(2)) + args[2:]
    with in_float32():
        first, again = run(args), run(other)
    for a, b in zip(first, again):
        assert np.array_equal(np.asarray(a[:, 0]), np.asarray(b[:, 0]))
        assert not np.array_equal(np.asarray(a[:, 1]), np.asarray(b[:, 1]))


def same_x_without_the_next_norm(args):
    """With no next norm (next_weight None, as a layer with per-layer inputs adds after down_proj), the kernel gives
    x alone, the bits of x with it."""
    x_only, normed = run(args[:3] + (None,) + args[4:])
    assert normed is None
    np.testing.assert_array_equal(np.asarray(x_only, np.float32), np.asarray(run(args)[0], np.float32))


@pytest.mark.parametrize("name", ["e4b per-layer projection: one product", "test model"])
def test_without_the_next_norm_x_alone(name):
    with in_float32():
        same_x_without_the_next_norm(case(SHAPES[name], seed=9, dtype=jnp.float32))


@pytest.mark.parametrize("name", ["270m", "31b, batch 2: three runs"])
def test_weights_to_prefetch_change_no_output(name):
    with in_float32():
        same_bits_with_weights_to_prefetch(case(SHAPES[name], seed=6, dtype=jnp.float32))


def test_what_the_kernel_does_not_take():
    with decode_attention_jax.interpreted():
        assert not decode_norms_jax.takes(31, jnp.bfloat16)  # five runs: 16, 8, 4, 2, 1
    if jax.default_backend() != "gpu":
        assert not decode_norms_jax.takes(640, jnp.bfloat16)  # compiled on GPUs alone


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_compiled_kernel_in_bf16_against_float32(name):
    """Within a bf16 step of the largest float32 value, as the XLA layer in bf16 is: a run, row or split gone wrong is
    off by the values themselves."""
    args = case(SHAPES[name], seed=3, dtype=jnp.bfloat16)
    assert decode_norms_jax.takes(SHAPES[name][2], jnp.bfloat16)
    exact = run(tuple(None if a is None else a.astype(jnp.float32) for a in args), kernel=False)
    for got, xla, want in zip(run(args), run(args, kernel=False), exact):
        want = np.asarray(want, np.float64)
        step = 2.0**-7 * np.abs(want).max()
        errors = [np.abs(np.asarray(t, np.float64) - want).max() for t in (got, xla)]
        assert max(errors) <= step, (errors, step)


def test_kernels_trigger_dependents_on_hopper_gpus_alone():
    with decode_attention_jax.interpreted():
        assert not decode_attention_jax.triggers_dependents()
    if jax.default_backend() != "gpu":
        assert not decode_attention_jax.triggers_dependents()


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_early_launch_trigger_changes_no_bit(name, monkeypatch):
    """launch_dependents passes its value through: the kernel's outputs with and without it are the same bits."""
    if float(jax.devices()[0].compute_capability) < 9.0:
        pytest.skip("needs a GPU with programmatic dependent launch (compute capability 9.0 or more)")
    assert decode_attention_jax.triggers_dependents()
    args = case(SHAPES[name], seed=5, dtype=jnp.bfloat16)
    triggered = run(args)
    monkeypatch.setattr(decode_attention_jax, "triggers_dependents", lambda: False)
    for got, want in zip(triggered, run(args)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_compiled_weights_to_prefetch_change_no_bit(name):
    same_bits_with_weights_to_prefetch(case(SHAPES[name], seed=8, dtype=jnp.bfloat16))


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_compiled_without_the_next_norm_x_alone(name):
    same_x_without_the_next_norm(case(SHAPES[name], seed=10, dtype=jnp.bfloat16))
