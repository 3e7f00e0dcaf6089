"""A decode forward's attention over the static cache as two Triton kernels: split-softmax partials over the cache's
slots, then their combination. Their blocks are decode_plan's, which the JAX engine's Pallas kernel shares.

Compiled, a decode forward's attention ran as a batched GEMM for the scores, a fused mask-and-softmax kernel and a
batched GEMM for the values: three kernels of 1.7-3.4 us a layer on the 270M, latency rather than bytes (its cache
is 0.3-0.5 MB a layer). Here one kernel, launched under programmatic dependent launch as inductor's are, splits the
cache's slots among programs (flash-decoding): each scores a block of slots against a block of query rows of one KV
head, masks them by the positions the slots hold, and keeps its own softmax maximum, sum and value product in
float32. A second kernel, launched the same way, combines the splits' partials in a fixed order into the layout
o_proj reads.

Rows stay bitwise invariant: the blocks depend on the cache alone, never on how many rows a forward has, and what a
program computes for a row depends on that row and the slots alone.
"""

from __future__ import annotations

import functools

import torch

from specdec.models import skinny_gemm
from specdec.models.decode_plan import MAX_HEAD_DIM, MAX_SLOTS, plan


def takes(q: torch.Tensor, keys: torch.Tensor, softcap: float | None) -> bool:
    """Whether a compiled decode forward's attention of q over keys [B, n_kv, slots, hd] runs here: bf16/fp16 on
    Hopper (skinny_gemm.available), a power-of-two head_dim of 16-256, at most MAX_SLOTS slots, and no logit softcap
    (no Gemma 3 or 4 has one)."""
    head_dim = q.shape[-1]
    return (torch.compiler.is_compiling() and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and softcap is None and 16 <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
            and keys.shape[2] <= MAX_SLOTS and skinny_gemm.available())


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_partials_kernel(q, k, v, stored, lowest, highest, acc_out, top_out, sum_out, rows, groups,
                                  heads, slots, chunk, scale, sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                                  ss_b, sl_b, sh_b, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_S: tl.constexpr, STEPS: tl.constexpr):
        split, row_block, program = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        d_blocks: tl.constexpr = HEAD_DIM // D_BLOCK
        b, h, d_block = program // (heads * d_blocks), program // d_blocks % heads, program % d_blocks
        r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        dv = d_block * D_BLOCK + tl.arange(0, D_BLOCK)
        r_in = r < rows
        token = r // groups
        # The bounds are written at the forward's start: under PDL, when this kernel starts, every kernel but the
        # one before it has finished. q and this forward's cache slots are that kernel's output.
        low = tl.load(lowest + b * sl_b + token, mask=r_in, other=1)
        high = tl.load(highest + b * sh_b + token, mask=r_in, other=0)
        tl.extra.cuda.gdc_wait()
        query = tl.load(q + b * sq_b + h * sq_h + r[:, None] * sq_r + d[None, :], mask=r_in[:, None], other=0.0)
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_BLOCK], tl.float32)
        for step in range(STEPS):
            s = split * chunk + step * BLOCK_S + tl.arange(0, BLOCK_S)
            s_in = s < slots
            keys = tl.load(k + b * sk_b + h * sk_h + s[:, None] * sk_s + d[None, :], mask=s_in[:, None], other=0.0)
            values = tl.load(v + b * sv_b + h * sv_h + s[:, None] * sv_s + dv[None, :], mask=s_in[:, None], other=0.0)
            position = tl.load(stored + b * ss_b + s, mask=s_in, other=-1)
            allowed = (position[None, :] >= low[:, None]) & (position[None, :] <= high[:, None])
            scores = tl.where(allowed, tl.dot(query, tl.trans(keys)) * scale, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # no slot yet: exp(-inf) = 0, not NaN
            p = tl.exp(scores - shift[:, None])
            rescale = tl.exp(top - shift)
            acc = acc * rescale[:, None] + tl.dot(p.to(values.dtype), values)
            total = total * rescale + tl.sum(p, 1)
            top = new_top
        tl.extra.cuda.gdc_launch_dependents()
        at = ((b * heads + h) * tl.num_programs(0) + split) * rows + r
        tl.store(acc_out + at[:, None] * HEAD_DIM + dv[None, :], acc, mask=r_in[:, None])
        if d_block == 0:
            tl.store(top_out + at, top, mask=r_in)
            tl.store(sum_out + at, total, mask=r_in)

    return attention_partials_kernel


def launch(q, keys, values, stored, lowest, highest, scale: float, groups: int, config: dict, outs) -> None:
    """The kernel with `config` as plan() gives it into outs (acc, top, total), launched under PDL."""
    import triton

    B, heads, rows, head_dim = q.shape
    grid = (config["splits"], triton.cdiv(rows, config["BLOCK_M"]), B * heads * (head_dim // config["D_BLOCK"]))
    _kernel()[grid](q, keys, values, stored, lowest, highest, *outs, rows, groups, heads,
                    keys.shape[2], config["chunk"], scale, *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3],
                    stored.stride(0), lowest.stride(0), highest.stride(0), HEAD_DIM=head_dim, D_BLOCK=config["D_BLOCK"],
                    BLOCK_M=config["BLOCK_M"], BLOCK_S=config["BLOCK_S"], STEPS=config["chunk"] // config["BLOCK_S"],
                    num_warps=config["num_warps"], num_stages=2, launch_pdl=True)


def empty_partials(q: torch.Tensor, splits: int):
    """The partials' buffers (acc, top, total) for q [B, n_kv, rows, hd] and `splits` splits."""
    B, heads, rows, head_dim = q.shape
    top = q.new_empty(B, heads, splits, rows, dtype=torch.float32)
    return q.new_empty(B, heads, splits, rows, head_dim, dtype=torch.float32), top, torch.empty_like(top)


@functools.cache
def _combine_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def combine_partials_kernel(acc, top, total, out, rows, groups, heads, so_b, so_t, SPLITS: tl.constexpr,
                                SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr,
                                BLOCK_M: tl.constexpr):
        row_block, program = tl.program_id(0), tl.program_id(1)
        d_blocks: tl.constexpr = HEAD_DIM // D_BLOCK
        bh, d_block = program // d_blocks, program % d_blocks
        r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        r_in = r < rows
        split = tl.arange(0, SPLITS_P2)
        dv = d_block * D_BLOCK + tl.arange(0, D_BLOCK)
        at = bh * SPLITS * rows + r  # (b, h, split 0, r)
        both_in = (split[:, None] < SPLITS) & r_in[None, :]
        tl.extra.cuda.gdc_wait()
        tops = tl.load(top + at[None, :] + split[:, None] * rows, mask=both_in, other=float("-inf"))
        best = tl.max(tops, 0)  # finite: every row attends to its own slot
        norm = tl.sum(tl.load(total + at[None, :] + split[:, None] * rows, mask=both_in, other=0.0)
                      * tl.exp(tops - best[None, :]), 0)
        o = tl.zeros([BLOCK_M, D_BLOCK], tl.float32)
        for s in tl.static_range(SPLITS):  # one by one, in split order
            weight = tl.exp(tl.load(top + at + s * rows, mask=r_in, other=0.0) - best)
            o += tl.load(acc + (at + s * rows)[:, None] * HEAD_DIM + dv[None, :], mask=r_in[:, None], other=0.0) \
                * weight[:, None]
        tl.extra.cuda.gdc_launch_dependents()
        b, h = bh // heads, bh % heads
        column = (h * groups + r % groups) * HEAD_DIM  # token t's query head h * groups + g
        tl.store(out + b * so_b + (r // groups)[:, None] * so_t + column[:, None] + dv[None, :],
                 (o / norm[:, None]).to(out.dtype.element_ty), mask=r_in[:, None])

    return combine_partials_kernel


# Many small programs, each reading splits x 8 x 32 float32 partials: the smallest blocks swept were the fastest, by
# 1.1-1.9 us a layer against 16 x 64 (scripts/tune_decode_attention.py, H200).
COMBINE_BLOCK_M, COMBINE_D_BLOCK = 8, 32


def combine(partials, out: torch.Tensor, groups: int, block_m: int = COMBINE_BLOCK_M,
            d_block: int = COMBINE_D_BLOCK) -> None:
    """The splits' partials (acc, top, total) into out [B, T, n_kv * groups * hd], launched under PDL."""
    import triton

    acc = partials[0]
    B, heads, splits, rows, head_dim = acc.shape
    d_block = min(head_dim, d_block)
    grid = (triton.cdiv(rows, block_m), B * heads * (head_dim // d_block))
    _combine_kernel()[grid](*partials, out, rows, groups, heads, out.stride(0), out.stride(1), SPLITS=splits,
                            SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=head_dim, D_BLOCK=d_block,
                            BLOCK_M=block_m, num_warps=4, launch_pdl=True)


def _empty_out(q: torch.Tensor, groups: int) -> torch.Tensor:
    B, heads, rows, head_dim = q.shape
    return q.new_empty(B, rows // groups, heads * groups * head_dim)


@torch.library.custom_op("specdec::decode_attention", mutates_args=())
def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, stored: torch.Tensor, lowest: torch.Tensor,
           highest: torch.Tensor, scale: float, groups: int) -> torch.Tensor:
    """softmax(q keys^T * scale over the slots whose positions lie in lowest..highest of the row's token) values.
    q [B, n_kv, rows, hd] (row = token * groups + query head of the KV head), keys and values [B, n_kv, slots, hd],
    the position each slot holds [B, slots], the lowest and highest position each token attends [B, T]; the output
    [B, T, n_kv * groups * hd] in q's dtype, query heads in order."""
    config = plan(keys.shape[2], q.shape[-1], keys.shape[1])
    q, keys, values, stored, lowest, highest = (t if t.stride(-1) == 1 else t.contiguous()  # the kernels' layout
                                                for t in (q, keys, values, stored, lowest, highest))
    partials = empty_partials(q, config["splits"])
    launch(q, keys, values, stored, lowest, highest, scale, groups, config, partials)
    out = _empty_out(q, groups)
    combine(partials, out, groups)
    return out


@attend.register_fake
def _(q, keys, values, stored, lowest, highest, scale, groups):
    return _empty_out(q, groups)
