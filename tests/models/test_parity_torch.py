"""The PyTorch model against transformers on random checkpoints of every variant (fp32).

Error is max |ours - reference| / max |reference| over the compared logits. Sequences run to 40 tokens:
past the sliding window (8), inside the ring (64 slots: its wrap is tests/engines/test_sliding_ring.py's).
"""

import pytest
import torch

from specdec.models.gemma_torch import GemmaModel
from specdec.models.random_init import VARIANTS, build_hf_model

TOL = 1e-4
N = 40
K_MAX = 8


def rel_err(ours, ref):
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, random_checkpoints):
    variant = request.param
    hf = build_hf_model(variant)
    ours = GemmaModel.from_checkpoint(random_checkpoints[variant], max_seq_len=128)
    tokens = torch.randint(3, ours.cfg.vocab_size, (2, N), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
    return variant, ours, tokens, ref


def positions(start, stop, batch=2):
    return torch.arange(start, stop)[None].expand(batch, -1)


@torch.no_grad()
def test_prefill(pair):
    _, model, tokens, ref = pair
    logits, _ = model(tokens, positions(0, N), model.allocate_cache(2, K_MAX))
    assert rel_err(logits, ref.logits) <= TOL


@torch.no_grad()
def test_token_by_token_decode(pair):
    _, model, tokens, ref = pair
    cache = model.allocate_cache(2, K_MAX)
    logits = torch.cat([model(tokens[:, t : t + 1], positions(t, t + 1), cache)[0] for t in range(N)], dim=1)
    assert rel_err(logits, ref.logits) <= TOL


@torch.no_grad()
@pytest.mark.parametrize("prefix", [3, 11])
def test_chunks_after_prefix(pair, prefix):
    _, model, tokens, ref = pair
    cache = model.allocate_cache(2, K_MAX)
    model(tokens[:, :prefix], positions(0, prefix), cache)
    t, sizes, outs = prefix, [K_MAX + 1, 2, 5, 1, 9, 3, 7], []
    while t < N:
        size = min(sizes[len(outs) % len(sizes)], N - t)
        outs.append(model(tokens[:, t : t + size], positions(t, t + size), cache)[0])
        t += size
    assert rel_err(torch.cat(outs, dim=1), ref.logits[:, prefix:]) <= TOL


@torch.no_grad()
def test_rejected_drafts_leave_no_trace(pair):
    """Verify K+1 tokens of which only some are right, then continue from the first wrong one: the
    stale entries in the cache (and the ring slots they took) must not change any later logit."""
    _, model, tokens, ref = pair
    cache = model.allocate_cache(2, K_MAX)
    model(tokens[:, :4], positions(0, 4), cache)
    t, outs, gen = 4, [], torch.Generator().manual_seed(3)
    while t < N:
        size = min(K_MAX + 1, N - t)
        chunk = tokens[:, t : t + size].clone()
        keep = int(torch.randint(1, size + 1, (1,), generator=gen))
        chunk[:, keep:] = torch.randint(3, model.cfg.vocab_size, (2, size - keep), generator=gen)
        logits, _ = model(chunk, positions(t, t + size), cache)
        outs.append(logits[:, :keep])
        t += keep
    assert rel_err(torch.cat(outs, dim=1), ref.logits[:, 4:]) <= TOL


@torch.no_grad()
def test_rows_at_different_positions(pair):
    """Batch rows advance independently: row 0 continues after its prefix while row 1 starts over
    (a new request in that slot), in one forward."""
    _, model, tokens, ref = pair
    cache = model.allocate_cache(2, K_MAX)
    lag = 5
    model(tokens[:, :lag], positions(0, lag), cache)
    row_tokens = torch.stack([tokens[0, lag : lag + 20], tokens[1, :20]])
    pos = torch.stack([torch.arange(lag, lag + 20), torch.arange(0, 20)])
    logits, _ = model(row_tokens, pos, cache)
    assert rel_err(logits[0], ref.logits[0, lag : lag + 20]) <= TOL
    assert rel_err(logits[1], ref.logits[1, :20]) <= TOL


@torch.no_grad()
def test_hidden_states_of_chosen_layers(pair):
    _, model, tokens, ref = pair
    taps = (0, model.cfg.num_layers // 2)
    _, hidden = model(tokens, positions(0, N), model.allocate_cache(2, K_MAX), hidden_layers=taps)
    for j, layer in enumerate(taps):
        assert rel_err(hidden[:, :, j], ref.hidden_states[layer + 1]) <= TOL


@pytest.mark.parametrize("splits", [2, 4])
def test_a_split_reduction_is_the_same_product(splits):
    """A batched GEMM over slices of the reduction, the slices' products added, computes x @ W.T, for rows of any
    leading shape; in float32 to rounding."""
    from specdec.models.gemma_torch import split_products, sum_products

    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2, 8, 512, generator=g), torch.randn(96, 512, generator=g)
    assert torch.allclose(sum_products(split_products(x, weight, splits), x), x @ weight.T, rtol=1e-5, atol=1e-4)


def test_which_products_split_their_reduction():
    """A decode forward's 16 rows split the reduction of a weight of few columns (E4B's o_proj: 4 slices; the
    270M's q/k/v, whose 640 inputs are not a multiple of 256: 2), not of a wide one (E4B's gate/up), nor a
    prefill chunk's rows."""
    from specdec.models.gemma_torch import reduction_splits

    assert reduction_splits(16, 2560, 2048) == 4
    assert reduction_splits(16, 1536, 640) == 2
    assert reduction_splits(16, 20480, 2560) == 1
    assert reduction_splits(64, 2560, 2048) == 1
    assert reduction_splits(16, 2560, 96) == 1  # no slice of a multiple of 64
    assert reduction_splits(16, 4096, 640, multiple=32) == 4  # JAX's gate/up for the 270M: slices of 160
    assert reduction_splits(16, 2560, 10240, most=8) == 8  # JAX's down for E4B
    assert reduction_splits(16, 640, 768, most=8) == 4  # 768: no 8 slices of a multiple of 64


@pytest.mark.gpu
def test_compiled_products_split_and_eager_ones_do_not():
    """On a GPU the compiled product of a weight above skinny_gemm's size is one batched GEMM over slices of the
    reduction (its bf16 result the product's to bf16's rounding); the eager one is cuBLAS's product itself."""
    from torch._inductor.utils import run_and_get_code

    from specdec.models.gemma_torch import linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 16, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(2560, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    assert torch.equal(linear(x, weight), torch.nn.functional.linear(x, weight))
    compiled, code = run_and_get_code(torch.compile(linear, fullgraph=True), x, weight)
    assert "extern_kernels.bmm" in "".join(code) and "extern_kernels.mm" not in "".join(code)
    exact = x.double() @ weight.double().T
    assert float((compiled.double() - exact).abs().max() / exact.abs().max()) < 1e-2
