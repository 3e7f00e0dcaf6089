"""decode_attention_torch: how the cache's slots are split (anywhere), and on Hopper the attention itself against float64,
rows independent of the forward's width, and a compiled forward under programmatic dependent launch in a CUDA
graph reading each replay's new query and cache slot."""

import pytest
import torch

from specdec.models import decode_attention_torch, decode_plan, skinny_gemm

hopper = pytest.mark.skipif(not skinny_gemm.available(), reason="needs Triton and Hopper")

SHAPES = {  # batch, KV heads, query heads per KV head, slots, head_dim, sliding window (0: none)
    "270m sliding": (1, 1, 4, 576, 256, 512), "270m full": (1, 1, 4, 1024, 256, 0),
    "long context": (1, 2, 4, 4096, 256, 0), "31b sliding, batch 2": (2, 16, 2, 1088, 256, 1024),
    "random test model": (1, 2, 2, 40, 16, 8), "128 query rows": (1, 1, 8, 300, 128, 0),
}


@pytest.mark.parametrize("slots", [1, 40, 64, 576, 1024, 1088, 4096, 32768])
@pytest.mark.parametrize("head_dim", [16, 128, 256])
@pytest.mark.parametrize("kv_heads", [1, 16])
def test_splits_cover_the_slots_in_whole_blocks(slots, head_dim, kv_heads):
    config = decode_plan.plan(slots, head_dim, kv_heads)
    splits, chunk, block = config["splits"], config["chunk"], config["BLOCK_S"]
    assert chunk % block == 0 and 1 <= splits <= decode_plan.MAX_SPLITS
    assert (splits - 1) * chunk < slots <= splits * chunk  # no split past the cache, none missing
    assert chunk == block or -(-slots // (chunk - block)) > decode_plan.MAX_SPLITS  # the shortest that fits
    assert head_dim % config["D_BLOCK"] == 0
    assert (chunk == block) == (slots <= decode_plan.MAX_SLOTS)  # the engine's caches: a block a split


def test_the_31bs_ring_takes_a_block_a_split_and_whole_heads():
    """The blocks measured fastest on the 31B's sliding ring; the 270M's single KV head keeps narrower programs."""
    assert decode_plan.plan(1088, 256, 16) == {"splits": 17, "chunk": 64, "BLOCK_S": 64, "BLOCK_M": 16,
                                               "D_BLOCK": 256, "num_warps": 4}
    assert decode_plan.plan(1024, 256, 1)["D_BLOCK"] == 128


def bf16(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)


def case(name: str, tokens: int = 16, seed: int = 0):
    """q [B, n_kv, tokens * groups, hd], a cache holding positions 0..slots-1 in shuffled slots, and the decode
    bounds of `tokens` rows at the last positions (sliding: within the window), as arguments of attend."""
    B, nkv, groups, slots, hd, window = SHAPES[name]
    q, keys, values = bf16(B, nkv, tokens * groups, hd, seed=seed), bf16(B, nkv, slots, hd, seed=seed + 1), \
        bf16(B, nkv, slots, hd, seed=seed + 2)
    stored = torch.randperm(slots, generator=torch.Generator().manual_seed(seed)).cuda()[None].repeat(B, 1)
    stored[:, :3] = -1  # empty slots
    highest = torch.arange(slots - tokens, slots, device="cuda")[None].repeat(B, 1)
    lowest = (highest - window + 1).clamp(min=0) if window else torch.zeros_like(highest)
    return q, keys, values, stored, lowest, highest, groups


def exact_attention(q, keys, values, stored, lowest, highest, groups, scale):
    mask = (stored[:, None, :] >= lowest[:, :, None]) & (stored[:, None, :] <= highest[:, :, None])
    token_mask = mask.repeat_interleave(groups, dim=1)[:, None]  # [B, 1, rows, slots]
    scores = (q.double() @ keys.double().transpose(-1, -2) * scale).masked_fill(~token_mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values.double(), token_mask


def by_token(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, n_kv, T * groups, hd] as attend's output lays it out, [B, T, n_kv * groups * hd]."""
    B, nkv, _, hd = rows.shape
    return rows.view(B, nkv, -1, groups, hd).transpose(1, 2).reshape(B, -1, nkv * groups * hd)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", SHAPES)
def test_attention_against_float64(name):
    """Within bf16's rounding of the probabilities, and no further from float64 than the products and softmax
    it replaces (bf16 scores and probabilities, float32 softmax)."""
    q, keys, values, stored, lowest, highest, groups = case(name)
    scale = q.shape[-1] ** -0.5
    out = decode_attention_torch.attend(q, keys, values, stored, lowest, highest, scale, groups)
    assert out.dtype == q.dtype
    exact, mask = exact_attention(q, keys, values, stored, lowest, highest, groups, scale)
    scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(~mask, -torch.inf)
    replaced = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values
    exact, replaced = by_token(exact, groups), by_token(replaced, groups)
    assert out.shape == exact.shape
    error, replaced_error = [float((t.double() - exact).abs().max()) for t in (out, replaced)]
    assert error <= 0.02 * float(exact.abs().max())
    assert error <= 1.5 * replaced_error


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", ["270m sliding", "128 query rows", "31b sliding, batch 2"])
def test_a_rows_attention_does_not_depend_on_the_forwards_width(name):
    """A one-token forward's output is bitwise that of the same token first in a 16-token forward."""
    q, keys, values, stored, lowest, highest, groups = case(name)
    scale = q.shape[-1] ** -0.5
    wide = decode_attention_torch.attend(q, keys, values, stored, lowest, highest, scale, groups)
    one = decode_attention_torch.attend(q[:, :, :groups], keys, values, stored, lowest[:, :1], highest[:, :1], scale, groups)
    assert torch.equal(one, wide[:, :1])


@pytest.mark.gpu
@hopper
def test_compiled_attention_in_a_graph_reads_each_replays_query_and_slot():
    """Compiled, the kernel runs after inductor's kernels that write its query and the new cache slot (under PDL:
    it waits for them in-kernel); replayed from a CUDA graph on new inputs, it gives the compiled function's bits."""
    from torch._inductor.utils import run_and_get_code

    from specdec.engines.verifier_torch import _configure_compile, capture_graph

    _configure_compile()
    _, keys, values, stored, lowest, highest, groups = case("270m sliding")
    slot = int((stored[0] == highest[0, -1]).nonzero())  # the last row's own

    def step(x, new_key, keys, values):
        keys[:, :, slot] = new_key * 2  # the slot this forward commits, written by a kernel before the attention
        q = (x.float() * 1.5).to(x.dtype)
        return decode_attention_torch.attend(q, keys, values, stored, lowest, highest, 0.0625, groups) + 1

    compiled = torch.compile(step, fullgraph=True)
    first, key = bf16(1, 1, 64, 256, seed=40), bf16(1, 1, 256, seed=41)
    _, code = run_and_get_code(compiled, first, key, keys, values)
    assert "specdec.decode_attention" in "".join(code) and "extern_kernels.bmm" not in "".join(code)
    static_x, static_key = first.clone(), key.clone()
    graph, out = capture_graph(lambda: compiled(static_x, static_key, keys, values))
    for seed in range(42, 47):
        x, key = bf16(1, 1, 64, 256, seed=seed), bf16(1, 1, 256, seed=seed + 100)
        static_x.copy_(x)
        static_key.copy_(key)
        graph.replay()
        assert torch.equal(out, compiled(x, key, keys, values))
