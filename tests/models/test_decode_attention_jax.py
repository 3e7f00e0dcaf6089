"""decode_attention_jax: the Pallas kernels, run by Pallas's interpreter on the CPU, against float64 and a row
independent of the others; the JAX engine with them, whose greedy speculative output is the plain decode's and whose
plain decode is the XLA attention's; on a GPU, the compiled kernels in bf16 against float64, and in the engine."""

import contextlib
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.engines.verifier_jax import JaxEngine
from specdec.models import decode_attention_jax, decode_mlp_jax, decode_norms_jax, gemma_jax
from specdec.models.gemma_jax import _apply_rope, _rms_norm, _rope_cos_sin
from specdec.models.random_init import write_random_checkpoint

SHAPES = {  # batch, KV heads, query heads per KV head, tokens, slots, head_dim, sliding window (0: none)
    "270m sliding": (1, 1, 4, 16, 576, 256, 512),
    "two blocks a split, two value blocks, batch 2": (2, 2, 4, 16, 4096, 256, 0),
    "31b ring: whole heads": (1, 16, 2, 16, 1088, 256, 1024),
    "random test model": (1, 2, 2, 8, 64, 16, 8),
}
jax_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs JAX on a GPU")


def case(shape, seed: int, dtype):
    """q, keys, values, the slots' positions (a ring written up to the forward's tokens, some slots empty where the
    cache is longer than what was written) and each token's lowest and highest attended position."""
    batch, heads, groups, tokens, slots, head_dim, window = shape
    rng = np.random.default_rng(seed)
    q, keys, values = (jnp.asarray(rng.standard_normal(s), dtype) for s in
                       ((batch, tokens, heads, groups, head_dim), (batch, heads, slots, head_dim),
                        (batch, heads, slots, head_dim)))
    stored = np.full((batch, slots), -1, np.int32)
    positions = np.zeros((batch, tokens), np.int32)
    for b in range(batch):
        start = int(rng.integers(1, 2 * slots))
        written = np.arange(start + tokens)
        stored[b, written[-slots:] % slots] = written[-slots:]
        positions[b] = start + np.arange(tokens)
    lowest = np.maximum(positions - window + 1, 0) if window else np.zeros_like(positions)
    return q, keys, values, jnp.asarray(stored), jnp.asarray(lowest), jnp.asarray(positions)


def float64_attention(q, keys, values, stored, lowest, highest, scale):
    q, keys, values = (np.asarray(t, np.float64) for t in (q, keys, values))
    scores = np.einsum("btkgd,bksd->btkgs", q, keys) * scale
    slot = np.asarray(stored)[:, None, None, None, :]
    seen = (slot >= np.asarray(lowest)[:, :, None, None, None]) & (slot <= np.asarray(highest)[:, :, None, None, None])
    scores = np.where(seen, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("btkgs,bksd->btkgd", probs / probs.sum(-1, keepdims=True), values)


@contextlib.contextmanager
def in_float32(interpreted: bool = True):
    """float32 products in float32 (JAX's default on GPUs is TF32), and the kernels through Pallas's interpreter."""
    with jax.default_matmul_precision("highest"), \
            decode_attention_jax.interpreted() if interpreted else contextlib.nullcontext():
        yield


def attend(*args):
    return jax.jit(lambda *a: decode_attention_jax.attend(*a, 0.0625))(*args)


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_kernel_against_float64(name):
    args = case(SHAPES[name], seed=1, dtype=jnp.float32)
    with in_float32():
        assert decode_attention_jax.takes(args[0], args[1], None)
        out = attend(*args)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    assert np.abs(np.asarray(out, np.float64) - float64_attention(*args, 0.0625)).max() < 1e-5


def test_a_rows_output_depends_on_its_own_query_alone():
    q, *rest = case(SHAPES["random test model"], seed=2, dtype=jnp.float32)
    other = q.at[:, 1:].set(-q[:, 1:])  # every token but the first changed
    with in_float32():
        first, again = attend(q, *rest), attend(other, *rest)
    assert np.array_equal(np.asarray(first[:, 0]), np.asarray(again[:, 0]))
    assert not np.array_equal(np.asarray(first[:, 1]), np.asarray(again[:, 1]))


def test_what_the_kernel_does_not_take():
    q, keys, *_ = case(SHAPES["random test model"], seed=3, dtype=jnp.bfloat16)
    with decode_attention_jax.interpreted():
        assert not decode_attention_jax.takes(q, keys, 50.0)  # a logit softcap
        assert not decode_attention_jax.takes(q[:, :4], keys, None)  # 8 rows: not a whole block of 16
        assert not decode_attention_jax.takes(q, keys[:, :, :40], None)  # slots in no whole split
    if jax.default_backend() != "gpu":
        assert not decode_attention_jax.takes(q, keys, None)  # compiled on GPUs alone


PROMPT, NEW_TOKENS, K_MAX = [2] + list(np.random.default_rng(0).integers(3, 512, 30)), 48, 4


def plain_and_speculative(engine) -> tuple[list[int], list[int]]:
    """Greedy plain decode, and the fused loop's with a drafter that is wrong at every 5th position."""
    plain = engine.generate(PROMPT, NEW_TOKENS)
    sequence = jnp.asarray(PROMPT + plain + [0] * K_MAX, jnp.int32)

    def draft_fn(tokens, context_len):
        index = context_len[:, None] + jnp.arange(K_MAX)
        drafts = jnp.where(index % 5 == 2, (sequence[index] + 1) % engine.vocab_size, sequence[index])
        return drafts, jnp.full(context_len.shape, K_MAX)

    return plain, engine.generate_fused(PROMPT, NEW_TOKENS, draft_fn=draft_fn)


def reference_plain_and_speculative(path, *calls: list) -> tuple[list[int], list[int], list[int]]:
    """Greedy plain decode without the kernels (XLA's layers; each of `calls` stays empty), then
    plain_and_speculative with them, interpreted; float32 throughout."""
    with in_float32(interpreted=False):
        reference = JaxEngine.from_checkpoint(path, dtype=jnp.float32, max_seq_len=128, k_max=K_MAX).generate(
            PROMPT, NEW_TOKENS)
    assert not any(calls)
    with in_float32():
        return reference, *plain_and_speculative(
            JaxEngine.from_checkpoint(path, dtype=jnp.float32, max_seq_len=128, k_max=K_MAX))


def recorded_calls(monkeypatch, module, name: str, record) -> list:
    """record(args, kwargs) for each call of module.name traced from now on (the function patched to note it, then
    run)."""
    calls = []

    def noted(*args, function=getattr(module, name), **kwargs):
        calls.append(record(args, kwargs))
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, noted)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """The key shapes of the forwards traced through the kernel."""
    return recorded_calls(monkeypatch, decode_attention_jax, "attend", lambda args, _: args[1].shape)


@pytest.mark.parametrize("variant", ["gemma3", "gemma4_dense"])
def test_the_engine_with_the_kernel_decodes_what_it_decodes_without(random_checkpoints, variant, kernel_calls):
    """Greedy plain decode through the kernel (interpreted, fp32) emits the XLA attention's tokens, and speculative
    decoding inside the fused loop emits exactly the plain decode's. gemma4_dense's globals are k_eq_v, whose keys
    the layer rebuilds before the kernel reads them."""
    reference, plain, speculative = reference_plain_and_speculative(random_checkpoints[variant], kernel_calls)
    assert {slots for _, _, slots, _ in kernel_calls} == {64, 128}  # the sliding ring and the full cache
    assert plain == reference
    assert speculative == plain


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e"])
def test_on_a_gpu_the_kernel_keeps_speculative_output_plain_decodings(random_checkpoints, variant, kernel_calls):
    engine = JaxEngine.from_checkpoint(random_checkpoints[variant], dtype=jnp.bfloat16, max_seq_len=128, k_max=K_MAX)
    plain, speculative = plain_and_speculative(engine)
    assert kernel_calls
    assert speculative == plain


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_compiled_kernel_in_bf16_against_float64(name):
    """No further from float64 than XLA's own attention in bf16 (products, softmax in float32, products)."""
    args = case(SHAPES[name], seed=4, dtype=jnp.bfloat16)
    assert decode_attention_jax.takes(args[0], args[1], None)
    exact = float64_attention(*args, 0.0625)
    ours = np.abs(np.asarray(attend(*args), np.float64) - exact).max()
    q, keys, values, stored, lowest, highest = args
    seen = (stored[:, None, None, None, :] >= lowest[:, :, None, None, None]) & \
        (stored[:, None, None, None, :] <= highest[:, :, None, None, None])
    scores = jnp.where(seen, jnp.einsum("btkgd,bksd->btkgs", q, keys) * 0.0625, -jnp.inf)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    theirs = np.abs(np.asarray(jnp.einsum("btkgs,bksd->btkgd", probs, values), np.float64) - exact).max()
    assert ours <= 1.5 * theirs



# -- the q/k/v epilogue kernel (inputs) ---------------------------------------------------------------------------

# batch, tokens, query heads, KV heads, head_dim, slots, Gemma 4, whether it writes keys (a KV-shared layer does not)
INPUT_SHAPES = {
    "270m": (1, 8, 4, 1, 256, 576, False, True),
    "e4b sliding": (1, 8, 8, 2, 256, 576, True, True),
    "e4b full, 512-wide heads": (1, 8, 8, 2, 512, 1024, True, True),
    "kv-shared: q alone": (1, 8, 8, 2, 256, 576, True, False),
    "31b sliding, batch 2": (2, 8, 32, 16, 256, 1088, True, True),
}
SPLITS = 2  # of the projection's reduction


def inputs_case(shape, seed: int, dtype):
    """The splits' float32 products of the packed projection, q/k norm weights, RoPE rows at each token's position,
    its slot, and a cache of noise."""
    batch, tokens, q_heads, kv_heads, head_dim, slots, _, writes = shape
    rng = np.random.default_rng(seed)
    heads = q_heads + 2 * kv_heads * writes
    partials = jnp.asarray(rng.standard_normal((SPLITS, batch, tokens, heads, head_dim)) / SPLITS, jnp.float32)
    q_weight, k_weight = (jnp.asarray(rng.standard_normal(head_dim) * 0.3, dtype) for _ in range(2))
    positions = jnp.asarray(rng.integers(0, 4 * slots, (batch, 1)) + np.arange(tokens), jnp.int32)
    cos, sin = _rope_cos_sin(1.0 / 10_000 ** (np.arange(0, head_dim, 2) / head_dim), positions, dtype)
    cache = [jnp.asarray(rng.standard_normal((batch, kv_heads, slots, head_dim)), dtype) if writes else None
             for _ in range(2)]
    return partials, q_weight, k_weight, cos, sin, positions % slots, *cache


def norm_config(gemma4: bool):
    """The config fields gemma_jax's norms read: Gemma 4 scales by w, Gemma 3 by 1 + w."""
    return types.SimpleNamespace(is_gemma4=gemma4, rms_norm_eps=1e-6, norm_weight_offset=0.0 if gemma4 else 1.0)


def xla_inputs(partials, q_weight, k_weight, cos, sin, slots, keys, values, *, q_heads, gemma4):
    """What gemma_jax's decode forward computes without the kernel: the product in the model's dtype, then its own
    norm, RoPE and cache writes."""
    cfg = norm_config(gemma4)
    projected = sum(partials[1:], partials[0]).astype(cos.dtype)
    kv_heads = (projected.shape[2] - q_heads) // 2
    rope = lambda x: _apply_rope(x, cos[:, :, None], sin[:, :, None])  # noqa: E731
    q = rope(_rms_norm(projected[:, :, :q_heads], q_weight, cfg))
    if keys is None:
        return q, keys, values
    k = rope(_rms_norm(projected[:, :, q_heads:q_heads + kv_heads], k_weight, cfg))
    v = projected[:, :, q_heads + kv_heads:]
    v = _rms_norm(v, None, cfg) if gemma4 else v
    rows = jnp.arange(projected.shape[0])[:, None]
    return q, keys.at[rows, :, slots].set(k), values.at[rows, :, slots].set(v)


def inputs_kernel(shape, dtype):
    """decode_attention_jax.inputs for a case of `shape` in `dtype`."""
    _, _, q_heads, kv_heads, _, _, gemma4, _ = shape
    cfg = norm_config(gemma4)
    return functools.partial(decode_attention_jax.inputs, q_heads=q_heads, kv_heads=kv_heads, eps=cfg.rms_norm_eps,
                             weight_offset=cfg.norm_weight_offset, v_norm=gemma4, dtype=dtype)


def run_inputs(args, shape, kernel=True):
    _, _, q_heads, _, _, _, gemma4, _ = shape
    fn = inputs_kernel(shape, args[3].dtype) if kernel else functools.partial(xla_inputs, q_heads=q_heads,
                                                                               gemma4=gemma4)
    return jax.jit(fn)(*args)


@pytest.mark.parametrize("name", list(INPUT_SHAPES))
def test_the_inputs_kernel_computes_what_the_layer_computes_without_it(name):
    """q normed and rotated, the keys and values written at their slots and every other slot left as it was."""
    shape = INPUT_SHAPES[name]
    _, _, q_heads, kv_heads, head_dim, _, _, writes = shape
    args = inputs_case(shape, seed=5, dtype=jnp.float32)
    with in_float32():
        assert decode_attention_jax.takes_inputs(q_heads, kv_heads, head_dim, jnp.float32)
        ours = run_inputs(args, shape)
    theirs = run_inputs(args, shape, kernel=False)
    assert ours[0].shape == theirs[0].shape
    for got, want in zip(ours, theirs):
        if want is None:
            assert got is None
            continue
        assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-5
    if writes:  # the slots not written hold the cache's own values, exactly
        written = np.zeros(args[6].shape[2], bool)
        written[np.asarray(args[5][0])] = True
        assert np.array_equal(np.asarray(ours[1][0, :, ~written]), np.asarray(args[6][0, :, ~written]))


def test_a_tokens_inputs_depend_on_its_own_projection_alone():
    shape = INPUT_SHAPES["e4b sliding"]
    args = inputs_case(shape, seed=6, dtype=jnp.float32)
    other = (args[0].at[:, :, 1:].set(-args[0][:, :, 1:]),) + args[1:]  # every token but the first changed
    with in_float32():
        first, again = run_inputs(args, shape), run_inputs(other, shape)
    slot = int(args[5][0, 0])
    assert np.array_equal(np.asarray(first[0][:, 0]), np.asarray(again[0][:, 0]))
    assert np.array_equal(np.asarray(first[1][:, :, slot]), np.asarray(again[1][:, :, slot]))
    assert not np.array_equal(np.asarray(first[0][:, 1]), np.asarray(again[0][:, 1]))


def test_what_the_inputs_kernel_does_not_take():
    with decode_attention_jax.interpreted():
        assert not decode_attention_jax.takes_inputs(6, 2, 256, jnp.bfloat16)  # 3 query heads a KV head: no whole tile
        assert not decode_attention_jax.takes_inputs(4, 1, 96, jnp.bfloat16)
    if jax.default_backend() != "gpu":
        assert not decode_attention_jax.takes_inputs(4, 1, 256, jnp.bfloat16)  # compiled on GPUs alone


@pytest.fixture
def inputs_calls(monkeypatch) -> list:
    """(the projection's splits, whether the layer writes keys) of the layers traced through the inputs kernel."""
    return recorded_calls(monkeypatch, decode_attention_jax, "inputs",
                          lambda args, _: (args[0].shape[0], args[6] is not None))


@pytest.fixture
def norms_calls(monkeypatch) -> list:
    """(the product's splits, whether a layer scalar scales x, whether x is normed for what follows) of the residual
    adds traced through decode_norms_jax' kernel."""
    return recorded_calls(monkeypatch, decode_norms_jax, "residual_norms",
                          lambda args, _: (args[0].shape[0], len(args) > 4 and args[4] is not None,
                                           args[3] is not None))


@pytest.fixture
def gated_calls(monkeypatch) -> list:
    """The features of the feed-forwards traced through decode_mlp_jax's gate/up and GELU kernel."""
    return recorded_calls(monkeypatch, decode_mlp_jax, "gated", lambda args, _: args[1].shape[0] // 2)


@pytest.fixture
def per_layer_gate_calls(monkeypatch) -> list:
    """The features of the Gemma 4 per-layer gates traced through decode_mlp_jax's kernel."""
    return recorded_calls(monkeypatch, decode_mlp_jax, "per_layer_gated", lambda args, _: args[1].shape[0])


@pytest.fixture
def prefetch_calls(monkeypatch) -> dict:
    """How many weights each residual add and attention partials kernel traced reads ahead into L2, by kernel."""
    return {name: recorded_calls(monkeypatch, module, name, lambda _, kwargs: len(kwargs.get("prefetch", ())))
            for module, name in ((decode_norms_jax, "residual_norms"), (decode_attention_jax, "partials"))}


@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e"])
def test_the_engine_with_every_kernel_decodes_what_it_decodes_without(tmp_path, monkeypatch, variant, inputs_calls,
                                                                      norms_calls, gated_calls, per_layer_gate_calls,
                                                                      prefetch_calls):
    """Greedy plain decode through every kernel (interpreted, fp32) emits the XLA layers' tokens, and speculative
    decoding in the fused loop the plain decode's. A hidden size of 128 splits the projections' reduction in two
    (reduction_splits), which the kernels add; gemma4_e's KV-shared layers take the inputs kernel for q alone.
    Residual adds: after attention, on o_proj's product (a reduction of 64 on sliding layers: one product; of 128 on
    gemma4_e's full layers: two slices); each layer's last but the last layer's, on down_proj's product (an
    intermediate size of 512: eight slices, as large weights take them, gemma_jax.DOWN_SPLITS), or on gemma4_e's
    per-layer projection (one product) and layer scalar; gemma4_e's add after down_proj (eight slices, its KV-shared
    layers' double-wide MLP's too), with no norm after it.
    Read ahead into L2: by attention's partials, gate/up, down and o_proj where it is a whole block (gemma4_e's full
    layers' 128 x 128, not the 128 x 64 of the others); by each layer's last residual add, the next layer's q/k/v
    (not q alone, as gemma4_e's KV-shared layers have it: less than a block); by the last layer's, nothing.
    Gate/up with its GELU in decode_mlp_jax's kernel: 512 features, 1,024 on gemma4_e's double-wide MLP; and there
    gemma4_e's per-layer gates, with per-layer inputs of 16 (a whole block; the variant's own 8 is not)."""
    per_layer = {"hidden_size_per_layer_input": 16} if variant == "gemma4_e" else {}  # a whole block of the kernel's
    monkeypatch.setattr(gemma_jax, "DOWN_SPLIT_BYTES", 0)
    path = write_random_checkpoint(variant, tmp_path / variant, hidden_size=128, intermediate_size=512, **per_layer)
    reference, plain, speculative = reference_plain_and_speculative(path, inputs_calls, norms_calls, gated_calls,
                                                                    per_layer_gate_calls, *prefetch_calls.values())
    assert {splits for splits, _ in inputs_calls} == {2}
    assert {writes for _, writes in inputs_calls} == ({True, False} if variant == "gemma4_e" else {True})
    after_attention = {(1, False, True), (2, False, True)} if variant == "gemma4_e" else {(1, False, True)}
    last = {(1, True, True), (8, False, False)} if variant == "gemma4_e" else {(8, False, True)}
    assert set(norms_calls) == after_attention | last
    assert set(prefetch_calls["partials"]) == {0, 2} | ({3} if variant == "gemma4_e" else set())  # 3: with o_proj
    assert set(prefetch_calls["residual_norms"]) == {0, 1}
    assert set(gated_calls) == ({512, 1024} if variant == "gemma4_e" else {512})
    assert set(per_layer_gate_calls) == ({16} if variant == "gemma4_e" else set())
    assert plain == reference
    assert speculative == plain


@pytest.mark.gpu
@jax_gpu
@pytest.mark.parametrize("name", list(INPUT_SHAPES))
def test_the_compiled_inputs_kernel_in_bf16_against_float64(name):
    """Within a bf16 step of the largest exact value (a head, slot or rotation gone wrong is off by the values
    themselves), as the XLA layers in bf16 are, and the slots it does not write untouched (in place: the cache is the
    output's buffer)."""
    shape = INPUT_SHAPES[name]
    _, _, q_heads, kv_heads, head_dim, _, _, writes = shape
    args = inputs_case(shape, seed=7, dtype=jnp.bfloat16)
    assert decode_attention_jax.takes_inputs(q_heads, kv_heads, head_dim, jnp.bfloat16)
    exact = run_inputs(tuple(a.astype(jnp.float32) if a is not None and a.dtype == jnp.bfloat16 else a for a in args),
                       shape, kernel=False)
    ours, theirs = run_inputs(args, shape), run_inputs(args, shape, kernel=False)
    for got, xla, want in zip(ours, theirs, exact):
        if want is not None:
            want = np.asarray(want, np.float64)
            step = 2.0**-7 * np.abs(want).max()
            errors = [np.abs(np.asarray(t, np.float64) - want).max() for t in (got, xla)]
            assert max(errors) <= step, (errors, step)
    if writes:  # (a written value may equal the noise it replaced: bf16 has few)
        written = np.zeros(args[6].shape[:3], bool)
        for row, slots in enumerate(np.asarray(args[5])):
            written[row, :, slots] = True
        assert np.array_equal(np.asarray(ours[1])[~written], np.asarray(args[6])[~written])


def prefetching_copy(x, weights, interpret: bool):
    """x [4, 8, 128] copied by a pallas_call of grid (4, 2) through with_prefetch, and the prefetch programs' maxima."""
    from jax.experimental import pallas as pl

    def copy(_position, x_ref, out_ref):
        out_ref[...] = x_ref[...]

    spec = pl.BlockSpec((None, 4, 128), lambda i, j: (i, j, 0))
    kernel, grid, in_specs, out_specs, out_shape, blocks = decode_attention_jax.with_prefetch(
        copy, (4, 2), [spec], [spec], [jax.ShapeDtypeStruct(x.shape, x.dtype)], weights)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret)(x, *blocks)


def check_prefetching_copy(interpret: bool):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((4, 8, 128)), jnp.float32)
    block = decode_attention_jax.PREFETCH_BLOCK
    weights = [jnp.asarray(rng.standard_normal((2 * block // 64, 64)), jnp.bfloat16),
               jnp.asarray(rng.standard_normal((3, block)), jnp.bfloat16)]
    copied, maxima = jax.jit(lambda x, *w: prefetching_copy(x, w, interpret))(x, *weights)
    assert np.array_equal(np.asarray(copied), np.asarray(x))
    want = np.concatenate([np.asarray(w, np.float32).reshape(-1, block).max(axis=1) for w in weights])
    assert maxima.shape == (6,)  # 5 blocks, the grid's extension by whole rows of 2 programs
    assert np.array_equal(np.asarray(maxima)[:5], want)


def test_prefetch_programs_read_each_block_and_leave_the_kernel_alone():
    """with_prefetch: the kernel's own programs and outputs as without it, on a two-axis grid, and each spare
    program reading its own block of the weights, in order."""
    check_prefetching_copy(interpret=True)


def test_what_is_prefetched():
    block = decode_attention_jax.PREFETCH_BLOCK
    small, ragged = jnp.zeros((4, block), jnp.bfloat16), jnp.zeros((block + 64,), jnp.bfloat16)
    large = jax.ShapeDtypeStruct((decode_attention_jax.PREFETCH_MAX_BYTES // block + block, block // 2), jnp.bfloat16)
    assert decode_attention_jax.prefetched(small, None, ragged, large, small) == (small, small)


@pytest.mark.parametrize("name", ["270m sliding", "random test model"])
def test_the_partials_kernel_computes_the_same_with_weights_to_prefetch(name):
    args = case(SHAPES[name], seed=12, dtype=jnp.float32)
    q, keys, values, stored, lowest, highest = args
    B, T, heads, groups, head_dim = q.shape
    rows = q.transpose(0, 2, 1, 3, 4).reshape(B, heads, T * groups, head_dim)
    low, high = (jnp.repeat(bound, groups, axis=1) for bound in (lowest, highest))
    weights = [jnp.ones((decode_attention_jax.PREFETCH_BLOCK * 3,), jnp.bfloat16)]
    with in_float32():
        run = jax.jit(lambda prefetch: decode_attention_jax.partials(rows, keys, values, stored, low, high, 0.0625,
                                                                      prefetch))
        for got, want in zip(run(weights), run([])):
            assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@jax_gpu
def test_compiled_prefetch_programs_read_each_block_and_leave_the_kernel_alone():
    check_prefetching_copy(interpret=False)
