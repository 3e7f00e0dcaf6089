"""Row invariance, bitwise: a token's logits, its hidden-state taps and the keys/values it commits are the
same whether a decode forward holds it alone (plain decode, T = 1) or at any row of T = 2, 5 or 9 tokens,
and whatever the rows after it or the other batch rows hold. Both engines, every variant, fp32 and bf16.

This is what makes greedy speculative decoding emit exactly the plain decode's tokens, near-ties included.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.models.random_init import VARIANTS

K_MAX = 8  # decode width 16: T = 9 is a full verify
WIDTHS = (2, 5, 9)
PROMPT = [2] + np.random.default_rng(1).integers(3, 500, 21).tolist()
TOKENS = np.random.default_rng(2).integers(3, 500, 27).tolist()  # fed after the prompt: 3 chunks of 9
TAPS = (0, 2)


def torch_engine(path, dtype, batch=1, invariant=True, device="cpu", fp8=False):
    """On CUDA with its defaults: torch.compile and CUDA graphs."""
    import torch

    from specdec.engines.verifier_torch import TorchEngine
    from specdec.models.gemma_torch import GemmaModel

    model = GemmaModel.from_checkpoint(path, dtype=getattr(torch, dtype), device=device, max_seq_len=128, fp8=fp8)
    return TorchEngine(model, batch=batch, max_seq_len=128, k_max=K_MAX, hidden_layers=TAPS, invariant=invariant)


def jax_engine(path, dtype, batch=1, invariant=True, prefill_chunk=None):
    import jax.numpy as jnp

    from specdec.engines.verifier_jax import JaxEngine

    return JaxEngine.from_checkpoint(path, dtype=getattr(jnp, dtype), batch=batch, max_seq_len=128, k_max=K_MAX,
                                     hidden_layers=TAPS, invariant=invariant, prefill_chunk=prefill_chunk)


def jax_engine_prefill_chunk(path, dtype, batch=1, invariant=True):
    """Prefill through a forward of its own, as `specdec.load(compile=True)` gives a server."""
    from specdec.engines.verifier_jax import PREFILL_CHUNK

    return jax_engine(path, dtype, batch, invariant, prefill_chunk=PREFILL_CHUNK)


ENGINES = {"torch": torch_engine, "jax": jax_engine, "jax_prefill_chunk": jax_engine_prefill_chunk}


def host(array) -> np.ndarray:
    return np.asarray(array.cpu() if hasattr(array, "cpu") else array)


def as_numpy(array) -> np.ndarray:
    """Bit patterns, so comparisons are exact for bf16 too."""
    if hasattr(array, "detach"):
        import torch

        array = array.detach().cpu()
        return (array.view(torch.int16) if array.dtype == torch.bfloat16 else array).numpy()
    array = np.asarray(array)
    return array.view(np.uint16) if array.dtype.itemsize == 2 else array


def committed_cache(engine) -> list[np.ndarray]:
    """The keys and values (row 0) of every committed position the next query can see, in position order
    (sliding layers: the last `window` positions; older ones may be overwritten by pad rows)."""
    if hasattr(engine, "model"):
        cache = engine.cache
        keys, values, slot_pos = cache.keys, cache.values, cache.slot_pos
    else:
        keys, values, slot_pos = engine.cache["keys"], engine.cache["values"], engine.cache["slot_pos"]
    length = int(host(engine.lengths)[0])
    cfg = engine.cfg
    out = []
    for layer, (k, v) in enumerate(zip(keys, values)):
        if k is None:
            continue
        kind = cfg.layers[layer].kind
        pos = host(slot_pos[kind][0])
        oldest = length - cfg.sliding_window + 1 if kind == "sliding_attention" else 0
        keep = np.flatnonzero((pos >= max(oldest, 0)) & (pos < length))
        order = keep[np.argsort(pos[keep])]
        out += [as_numpy(k[0])[:, order]] + ([as_numpy(v[0])[:, order]] if v is not None else [])
    return out


def feed(engine, width: int, offset: int = 0, filler=None):
    """Prefill PROMPT, feed its last token then TOKENS through verifies of `width` tokens (after `offset`
    single-token steps), committing all of them. Returns per fed token its logits and taps (row 0), and
    the committed cache. `filler(tokens)` may rewrite the tokens of other batch rows."""
    import jax.numpy as jnp

    batch = engine.batch
    engine.prefill([PROMPT] * batch)
    stream = [PROMPT[-1]] + TOKENS
    logits, hidden, i = [], [], 0
    while i < len(stream):
        n = 1 if i < offset else min(width, len(stream) - i)
        chunk = np.array([stream[i : i + n]] * batch)
        if filler is not None:
            chunk = filler(chunk)
        if hasattr(engine, "model"):
            import torch

            out = engine.verify(torch.as_tensor(chunk, device=engine.device))
            engine.commit(torch.full((batch,), n, device=engine.device))
        else:
            out = engine.verify(jnp.asarray(chunk, jnp.int32))
            engine.commit(jnp.full((batch,), n, jnp.int32))
        logits += list(as_numpy(out.logits[0]))
        hidden += list(as_numpy(out.hidden[0]))
        i += n
    return np.stack(logits), np.stack(hidden), committed_cache(engine)


def assert_same(a, b, what):
    la, ha, ca = a
    lb, hb, cb = b
    assert la.shape == lb.shape
    for t in range(len(la)):
        assert np.array_equal(la[t], lb[t]), f"{what}: logits of fed token {t} differ"
        assert np.array_equal(ha[t], hb[t]), f"{what}: hidden taps of fed token {t} differ"
    assert len(ca) == len(cb) and all(np.array_equal(x, y) for x, y in zip(ca, cb)), f"{what}: committed K/V differ"


@pytest.fixture(scope="module", params=["torch", "jax"])
def framework(request):
    pytest.importorskip(request.param)
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rows_bitwise_invariant_to_forward_width_and_position(framework, random_checkpoints, variant, dtype):
    engine = ENGINES[framework](random_checkpoints[variant], dtype)
    plain = feed(engine, 1)
    assert len(plain[0]) == len(TOKENS) + 1
    for width in WIDTHS:
        for offset in (0, 3):  # every row index of the chunks, shifted against the ring and positions
            assert_same(plain, feed(engine, width, offset), f"{framework}/{variant}/{dtype} T={width} offset={offset}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_bitwise_invariant_to_other_batch_rows(framework, random_checkpoints, dtype):
    """Row 0 of a batch of 3 is the same whatever rows 1 and 2 are fed."""
    engine = ENGINES[framework](random_checkpoints["gemma4_e"], dtype, batch=3)
    rng = np.random.default_rng(3)

    def noise(chunk):
        chunk[1:] = rng.integers(3, 500, chunk[1:].shape)
        return chunk

    alone = feed(engine, 5)
    assert_same(alone, feed(engine, 5, filler=noise), f"{framework}/{dtype} other rows")
    assert_same(alone, feed(engine, 1, filler=noise), f"{framework}/{dtype} other rows, T=1")


def test_without_invariance_rows_differ(random_checkpoints):
    """The property is not vacuous: fp32 forwards of their own width round differently (a negative control
    for the test above; the PyTorch engine on CPU)."""
    pytest.importorskip("torch")
    engine = torch_engine(random_checkpoints["gemma3"], "float32", invariant=False)
    plain, verified = feed(engine, 1), feed(engine, 5)
    assert not all(np.array_equal(a, b) for a, b in zip(plain[0], verified[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_graphs_and_compile_rows_bitwise_invariant(random_checkpoints, variant):
    """bf16 on the GPU, through torch.compile and CUDA graph replays (one graph per forward width)."""
    engine = torch_engine(random_checkpoints[variant], "bfloat16", device="cuda")
    assert engine.use_graphs
    plain = feed(engine, 1)
    for width in WIDTHS:
        assert_same(plain, feed(engine, width, 2), f"cuda/{variant} T={width}")
    other_rows = torch_engine(random_checkpoints[variant], "bfloat16", batch=3, device="cuda")
    rng = np.random.default_rng(4)

    def noise(chunk):
        chunk[1:] = rng.integers(3, 500, chunk[1:].shape)
        return chunk

    assert_same(feed(other_rows, 5), feed(other_rows, 5, filler=noise), f"cuda/{variant} other rows")
