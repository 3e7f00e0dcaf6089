"""decode_mlp_jax: the gate/up and GELU kernel, run by Pallas's interpreter on the CPU, against the layer's own XLA path
and a row independent of the others; on a GPU, compiled in bf16 against float64. The engine with it is tested with
every kernel in test_decode_attention_jax.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.models import decode_mlp_jax
from specdec.models.fp8_jax import quantize
from specdec.models.gemma_jax import _gelu, _linear
from tests.models.test_decode_attention_jax import in_float32, jax_gpu

SHAPES = {  # batch, tokens, hidden, features of gate (and of up)
    "270m": (1, 8, 640, 2048),
    "batch 2: one block of rows": (2, 8, 256, 64),
    "e4b": (1, 8, 2560, 10240),
    "12 rows: 4 masked": (1, 12, 128, 32),
    "test model": (1, 8, 128, 128),
}


def case(shape, seed: int, dtype):
    """x and gate/up's packed weight (gate's rows, then up's)."""
    batch, tokens, hidden, features = shape
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, tokens, hidden)), dtype)
    weight = jnp.asarray(rng.standard_normal((2 * features, hidden)) / np.sqrt(hidden), dtype)
    return x, weight


def xla_gated(x, weight):
    """What gemma_jax's feed-forward computes without the kernel: gate/up's product, then gelu_tanh(gate) * up."""
    gate, up = jnp.split(_linear(x, weight), 2, axis=-1)
    return _gelu(gate) * up


def gated(x, weight):
    return jax.jit(decode_mlp_jax.gated)(x, weight)


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_kernel_computes_what_the_layer_computes_without_it(name):
    x, weight = case(SHAPES[name], seed=1, dtype=jnp.float32)
    with in_float32():
        ours = gated(x, weight)
    theirs = jax.jit(xla_gated)(x, weight)
    assert ours.shape == theirs.shape == (*x.shape[:2], weight.shape[0] // 2)
    assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() < 1e-5 * np.abs(np.asarray(theirs)).max()


def test_a_rows_output_depends_on_its_own_row_alone():
    """Other rows changed, a row's outputs keep their bits."""
    x, weight = case(SHAPES["12 rows: 4 masked"], seed=2, dtype=jnp.float32)
    other = x.at[:, 1:].set(x[:, 1:] * -3 + 1)
    with in_float32():
        first, second = gated(x, weight), gated(other, weight)
    np.testing.assert_array_equal(np.asarray(first[:, 0]), np.asarray(second[:, 0]))
    assert not np.array_equal(np.asarray(first[:, 1:]), np.asarray(second[:, 1:]))


def test_what_the_kernel_does_not_take():
    def weight(features: int, hidden: int):  # gate/up's packed weight, its shape
        return jax.ShapeDtypeStruct((2 * features, hidden), jnp.bfloat16)

    def takes(weight, rows: int = 8):
        return decode_mlp_jax.takes(weight, rows, jnp.bfloat16)

    with in_float32():
        assert takes(weight(2048, 640))  # the 270M's 5 MB
        assert takes(weight(10240, 2560)) and takes(weight(10240, 2560), rows=16)  # E4B's 105 MB
        assert not takes(weight(10240, 2560), rows=24)  # two blocks of rows: the weight read twice
        assert not takes(weight(21504, 5376))  # the 31B's 462 MB
        assert not takes(weight(48, 128))  # 48 features
        assert not takes(weight(64, 96))  # a reduction of 96
        assert not takes(quantize(jnp.ones((2 * 64, 128), jnp.float32)))  # FP8
        assert not takes(None)  # gate and up unpacked
    if jax.default_backend() != "gpu":
        assert not takes(weight(64, 128))  # compiled on GPUs alone


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_compiled_kernel_in_bf16_against_float64(name):
    """Within two bf16 steps of the largest exact value, as XLA's feed-forward in bf16 is (the products, the GELU
    and their product each round); and a row's bits are its own, whatever the other rows hold."""
    x, weight = case(SHAPES[name], seed=3, dtype=jnp.bfloat16)
    x64, w64 = (np.asarray(t, np.float64) for t in (x, weight))
    gate, up = np.split(x64 @ w64.T, 2, axis=-1)
    exact = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up
    tolerance = np.abs(exact).max() * 2.0**-6
    ours, xla = np.asarray(gated(x, weight), np.float64), np.asarray(jax.jit(xla_gated)(x, weight), np.float64)
    assert np.abs(xla - exact).max() < tolerance
    assert np.abs(ours - exact).max() < tolerance
    other = np.asarray(gated(x.at[:, 1:].set(-x[:, 1:]), weight), np.float64)
    np.testing.assert_array_equal(ours[:, 0], other[:, 0])


# -- Gemma 4's per-layer gate: gelu_tanh(x gate^T) * the layer's per-layer input ----------------------------------

PER_LAYER_SHAPES = {  # batch, tokens, hidden, per-layer features, layers
    "e4b": (1, 8, 2560, 256, 42),
    "batch 2, a reduction of 640": (2, 8, 640, 32, 3),
    "12 rows: 4 masked": (1, 12, 128, 16, 2),
}


def per_layer_case(shape, seed: int, dtype):
    """x, the per-layer gate's weight, and every layer's per-layer inputs."""
    batch, tokens, hidden, features, layers = shape
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, tokens, hidden)), dtype)
    weight = jnp.asarray(rng.standard_normal((features, hidden)) / np.sqrt(hidden), dtype)
    per_layer = jnp.asarray(rng.standard_normal((batch, tokens, layers, features)), dtype)
    return x, weight, per_layer


def per_layer_gated(x, weight, per_layer, layer: int, kernel: bool = True):
    """The kernel, or what gemma_jax's layer computes without it."""
    if kernel:
        return jax.jit(lambda *a: decode_mlp_jax.per_layer_gated(*a, layer)[0])(x, weight, per_layer)
    return jax.jit(lambda x, w, p: _gelu(_linear(x, w)) * p[:, :, layer])(x, weight, per_layer)


@pytest.mark.parametrize("name", list(PER_LAYER_SHAPES))
def test_the_per_layer_gate_computes_what_the_layer_computes_without_it(name):
    x, weight, per_layer = per_layer_case(PER_LAYER_SHAPES[name], seed=4, dtype=jnp.float32)
    layer = per_layer.shape[2] - 1
    with in_float32():
        assert decode_mlp_jax.takes_per_layer_gate(weight, x.shape[0] * x.shape[1], x.dtype)
        ours = per_layer_gated(x, weight, per_layer, layer)
    theirs = per_layer_gated(x, weight, per_layer, layer, kernel=False)
    assert ours.shape == theirs.shape == (*x.shape[:2], weight.shape[0])
    assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() < 1e-5 * np.abs(np.asarray(theirs)).max()


def test_the_per_layer_gate_reads_its_own_layers_input_and_row_alone():
    x, weight, per_layer = per_layer_case(PER_LAYER_SHAPES["12 rows: 4 masked"], seed=5, dtype=jnp.float32)
    with in_float32():
        first = per_layer_gated(x, weight, per_layer, 1)
        other_layer = per_layer_gated(x, weight, per_layer.at[:, :, 0].set(7.0), 1)
        other_rows = per_layer_gated(x.at[:, 1:].set(-x[:, 1:]), weight, per_layer, 1)
        layer_zero = per_layer_gated(x, weight, per_layer, 0)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(other_layer))
    np.testing.assert_array_equal(np.asarray(first[:, 0]), np.asarray(other_rows[:, 0]))
    assert not np.array_equal(np.asarray(first), np.asarray(layer_zero))


def counters_after_two_layers(shape, dtype):
    """A forward's layers pass the counters on: (the counters after two layers, the second layer's gate, that gate
    from a call of its own, the first layer's gate)."""
    x, weight, per_layer = per_layer_case(shape, seed=7, dtype=dtype)

    @jax.jit
    def two_layers(x, weight, per_layer):
        first, arrivals = decode_mlp_jax.per_layer_gated(x, weight, per_layer, 0)
        second, arrivals = decode_mlp_jax.per_layer_gated(x, weight, per_layer, 1, arrivals)
        return arrivals, second, first

    arrivals, second, first = (np.asarray(a) for a in two_layers(x, weight, per_layer))
    return arrivals, second, np.asarray(per_layer_gated(x, weight, per_layer, 1)), first


def test_the_per_layer_gate_leaves_its_counters_zero_for_the_next_layer():
    """Each call leaves the counters zero, and the next computes what a fresh one would. The reduction of 640 is
    five splits, so four programs of a block arrive before the one that adds them."""
    with in_float32():
        arrivals, second, alone, first = counters_after_two_layers(PER_LAYER_SHAPES["batch 2, a reduction of 640"],
                                                                   jnp.float32)
    np.testing.assert_array_equal(arrivals, np.zeros(arrivals.shape, np.int32))
    np.testing.assert_array_equal(second, alone)
    assert not np.array_equal(first, second)


def test_what_the_per_layer_gate_does_not_take():
    def takes(features: int, hidden: int, rows: int = 8):
        weight = jax.ShapeDtypeStruct((features, hidden), jnp.bfloat16)
        return decode_mlp_jax.takes_per_layer_gate(weight, rows, jnp.bfloat16)

    with in_float32():
        assert takes(256, 2560)  # E4B's
        assert not takes(256, 2560, rows=24)
        assert not takes(24, 2560)  # no whole block of features
        assert takes(256, 640)  # splits of 128
        assert not takes(256, 24)  # splits under 16


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(PER_LAYER_SHAPES))
def test_the_compiled_per_layer_gate_in_bf16_against_float64(name):
    """Within two bf16 steps of the largest exact value, as the layer's XLA path is; a row's bits its own."""
    x, weight, per_layer = per_layer_case(PER_LAYER_SHAPES[name], seed=6, dtype=jnp.bfloat16)
    layer = per_layer.shape[2] // 2
    gate = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    exact = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * \
        np.asarray(per_layer[:, :, layer], np.float64)
    tolerance = np.abs(exact).max() * 2.0**-6
    ours = np.asarray(per_layer_gated(x, weight, per_layer, layer), np.float64)
    xla = np.asarray(per_layer_gated(x, weight, per_layer, layer, kernel=False), np.float64)
    assert np.abs(xla - exact).max() < tolerance
    assert np.abs(ours - exact).max() < tolerance
    other = np.asarray(per_layer_gated(x.at[:, 1:].set(-x[:, 1:]), weight, per_layer, layer), np.float64)
    np.testing.assert_array_equal(ours[:, 0], other[:, 0])
    for _ in range(20):  # the same bits in whichever order a block's programs arrive
        np.testing.assert_array_equal(np.asarray(per_layer_gated(x, weight, per_layer, layer), np.float64), ours)


@pytest.mark.gpu
@jax_gpu
def test_the_compiled_per_layer_gate_leaves_its_counters_zero_for_the_next_layer():
    arrivals, second, alone, first = counters_after_two_layers(PER_LAYER_SHAPES["e4b"], jnp.bfloat16)
    np.testing.assert_array_equal(arrivals, np.zeros(arrivals.shape, np.int32))
    np.testing.assert_array_equal(second, alone)
    assert not np.array_equal(first, second)
