"""jax_decode_attention: the Pallas kernels, run by Pallas's interpreter on the CPU, against float64 and a row
independent of the others; the JAX engine with them, whose greedy speculative output is the plain decode's and whose
plain decode is the XLA attention's; on a GPU, the compiled kernels in bf16 against float64, and in the engine."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.models import jax_decode_attention
from specdec.verifiers.jax_engine import JaxEngine

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
            jax_decode_attention.interpreted() if interpreted else contextlib.nullcontext():
        yield


def attend(*args):
    return jax.jit(lambda *a: jax_decode_attention.attend(*a, 0.0625))(*args)


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_kernel_against_float64(name):
    args = case(SHAPES[name], seed=1, dtype=jnp.float32)
    with in_float32():
        assert jax_decode_attention.takes(args[0], args[1], None)
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
    with jax_decode_attention.interpreted():
        assert not jax_decode_attention.takes(q, keys, 50.0)  # a logit softcap
        assert not jax_decode_attention.takes(q[:, :4], keys, None)  # 8 rows: not a whole block of 16
        assert not jax_decode_attention.takes(q, keys[:, :, :40], None)  # slots in no whole split
    if jax.default_backend() != "gpu":
        assert not jax_decode_attention.takes(q, keys, None)  # compiled on GPUs alone


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


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """The key shapes of the forwards traced through the kernel."""
    calls = []
    monkeypatch.setattr(jax_decode_attention, "attend",
                        lambda *a, attend=jax_decode_attention.attend: calls.append(a[1].shape) or attend(*a))
    return calls


@pytest.mark.parametrize("variant", ["gemma3", "gemma4_dense"])
def test_the_engine_with_the_kernel_decodes_what_it_decodes_without(random_checkpoints, variant, kernel_calls):
    """Greedy plain decode through the kernel (interpreted, fp32) emits the XLA attention's tokens, and speculative
    decoding inside the fused loop emits exactly the plain decode's. gemma4_dense's globals are k_eq_v, whose keys
    the layer rebuilds before the kernel reads them."""
    path = random_checkpoints[variant]
    with in_float32(interpreted=False):
        reference = JaxEngine.from_checkpoint(path, dtype=jnp.float32, max_seq_len=128, k_max=K_MAX).generate(
            PROMPT, NEW_TOKENS)
    assert not kernel_calls
    with in_float32():
        plain, speculative = plain_and_speculative(
            JaxEngine.from_checkpoint(path, dtype=jnp.float32, max_seq_len=128, k_max=K_MAX))
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
    assert jax_decode_attention.takes(args[0], args[1], None)
    exact = float64_attention(*args, 0.0625)
    ours = np.abs(np.asarray(attend(*args), np.float64) - exact).max()
    q, keys, values, stored, lowest, highest = args
    seen = (stored[:, None, None, None, :] >= lowest[:, :, None, None, None]) & \
        (stored[:, None, None, None, :] <= highest[:, :, None, None, None])
    scores = jnp.where(seen, jnp.einsum("btkgd,bksd->btkgs", q, keys) * 0.0625, -jnp.inf)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    theirs = np.abs(np.asarray(jnp.einsum("btkgs,bksd->btkgd", probs, values), np.float64) - exact).max()
    assert ours <= 1.5 * theirs

