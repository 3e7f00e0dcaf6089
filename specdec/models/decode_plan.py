"""How a decode forward splits its work: the blocks of attention over the static cache (flash-decoding) both engines'
kernels use (torch: decode_attention_torch's Triton kernels; JAX: decode_attention_jax's Pallas kernels), and the slices a
product of few rows splits its reduction into. Framework-free, so that neither engine imports the other's framework
for it.

Rows stay bitwise invariant because the blocks depend on the cache alone, never on how many rows a forward has.
"""

from __future__ import annotations

MAX_SPLITS = 32  # programs along the slots at most: the combine reads splits x rows x head_dim float32 partials
BLOCK_S = 64  # slots a program scores at a time
BLOCK_M = 16  # query rows a program
MAX_HEAD_DIM = 256  # 512-wide heads (E4B's full layers) ran slower than the products they would replace (H200)
# Caches of at most this many slots (the 31B's sliding ring of 1,088 among them): a block a split. Longer ones (long
# contexts) loop over blocks in each program. The torch engine takes none of them: that lost to its products on the
# 31B's ring in 16-token forwards. The JAX engine takes them: the 270M's 4,096-slot caches ran faster than XLA's
# attention (docs/journal).
MAX_SLOTS = MAX_SPLITS * BLOCK_S
WIDE_PROGRAMS = 128  # from this many (KV head, split) programs, each takes all of a head's value columns


def split_slots(slots: int) -> int:
    """The slots each split of a cache of `slots` takes (plan): whole blocks, as few as MAX_SPLITS splits allow."""
    blocks = -(-slots // BLOCK_S)
    return BLOCK_S * -(-blocks // MAX_SPLITS)


def whole_splits(slots: int) -> int:
    """The fewest slots, at least `slots`, that split into whole splits (GemmaConfig.cache_slots allocates these):
    the JAX engine's attention kernels take no others. A multiple of BLOCK_S, and split_slots of the result is
    split_slots(slots)."""
    chunk = split_slots(slots)
    return -(-slots // chunk) * chunk


def plan(slots: int, head_dim: int, kv_heads: int) -> dict:
    """Blocks for a cache of `slots` and `kv_heads` (never for a forward's rows, so that a row's bits do not depend
    on how many there are): 16 query rows a program, the slots in splits of whole blocks of 64, a block a split
    where there are at most MAX_SPLITS blocks, and 128 value columns a program unless the heads and splits make
    WIDE_PROGRAMS programs without them: a program of all the columns reads its keys once. Swept by
    scripts/tune_decode_attention.py: within 0.2 us of the fastest partials kernel on the 270M's layers (0.7 us on
    E4B's, H200), and the fastest on the 31B's ring in a one-token forward (H100; docs/journal)."""
    chunk = split_slots(slots)
    splits = -(-slots // chunk)
    wide = kv_heads * splits >= WIDE_PROGRAMS
    return {"splits": splits, "chunk": chunk, "BLOCK_S": BLOCK_S, "BLOCK_M": BLOCK_M,
            "D_BLOCK": head_dim if wide else min(head_dim, 128), "num_warps": 4}


SPLIT_MAX_ROWS = 32  # products of more rows keep one GEMM (reduction_splits)
MOST_SPLITS = 4  # slices a product takes at most unless it asks for more (reduction_splits)


def reduction_splits(rows: int, columns: int, reduction: int, multiple: int = 64, most: int = MOST_SPLITS) -> int:
    """1, or the slices a product of `rows` rows with a [columns, reduction] weight splits its reduction into (torch:
    gemma_torch.linear; JAX: a decode forward's q/k/v, o_proj, gate/up and down): for at most SPLIT_MAX_ROWS rows,
    where a weight's 128-column tiles would not reach half an H100's or H200's 132 SMs, the first of `most`, ...,
    4, 2 slices (powers of two) that are each a multiple of `multiple`. `most` is 4 by default: 8 was slower on an
    H200 for E4B's down projection in torch; JAX's down takes 8 where its weight is large (gemma_jax.DOWN_SPLITS)."""
    if rows > SPLIT_MAX_ROWS or columns > 66 * 128:
        return 1
    counts = [1 << bit for bit in range(most.bit_length() - 1, 0, -1)]  # most, ..., 4, 2
    return next((s for s in counts if reduction % (multiple * s) == 0), 1)
