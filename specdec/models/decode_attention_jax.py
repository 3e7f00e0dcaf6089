"""A JAX decode forward's attention over the static cache as three Pallas kernels (Triton on GPUs).

XLA ran a sliding layer's decode attention on the 270M as five kernels: the scores' product, the masked softmax, the
value product split over the slots, its reduction and a transpose (docs/journal). This is the flash-decoding
split the torch engine runs (decode_attention_torch), with the same blocks (decode_plan): each program scores a block of
slots against 16 query rows of one KV head, masks them by the positions the slots hold against each row's lowest and
highest attended position, and keeps its own float32 softmax maximum, sum and value product. A second kernel combines
the splits in split order and writes the output in the layout o_proj reads.

Before them, one kernel takes the layer's packed q/k/v projection and does what XLA ran as five kernels (q's norm, q's
RoPE, k's norm with RoPE, the key and the value writes): each program normalises and rotates one token's query and
key heads, normalises its value heads (Gemma 4), and writes the keys and values into their slots of the cache in place.

Every decode forward of an engine runs one width, so its programs are the same in a plain step and in a verify, and
what a program computes for a row depends on that row and the slots alone.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from specdec.models.decode_plan import BLOCK_M, MAX_HEAD_DIM, plan

_interpret = False  # tests: run the kernel through Pallas's interpreter on any backend (interpreted())


@contextlib.contextmanager
def interpreted():
    """Inside, forwards traced on any backend (the CPU too) take the Pallas kernels (these and decode_norms_jax'), run
    by Pallas's interpreter."""
    global _interpret
    before, _interpret = _interpret, True
    try:
        yield
    finally:
        _interpret = before


def interpreting() -> bool:
    """Whether Pallas kernels built now run through the interpreter (inside interpreted())."""
    return _interpret


@functools.cache
def _pallas_triton() -> bool:
    """Whether this JAX has Pallas's Triton backend. jax 0.11 deprecates it (for Mosaic GPU): without it, decode
    forwards keep XLA's attention."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def on_device(dtype) -> bool:
    """Whether a decode forward in `dtype` runs Pallas kernels: bf16/fp16 on a GPU with Pallas's Triton backend, or
    any inside interpreted()."""
    return _interpret or (jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16) and _pallas_triton())


def takes(q, keys, softcap: float | None) -> bool:
    """Whether a decode forward's attention of q [B, T, n_kv, groups, hd] over keys [B, n_kv, slots, hd] runs here:
    bf16/fp16 on a GPU with Pallas's Triton backend (or interpreted()), a power-of-two head_dim of 16-256, rows
    (T x groups) in whole blocks of 16, slots in whole splits, query heads per KV head a power of two up to 8 (the
    combine's rows are whole tokens), and no logit softcap (no Gemma 3 or 4 has one)."""
    _, tokens, kv_heads, groups, head_dim = q.shape
    slots = keys.shape[2]
    return (on_device(q.dtype) and softcap is None and 16 <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0
            and tokens * groups % BLOCK_M == 0 and slots % plan(slots, head_dim, kv_heads)["chunk"] == 0
            and groups <= COMBINE_ROWS and groups & (groups - 1) == 0)


@functools.cache
def _hopper_or_later() -> bool:
    return jax.default_backend() == "gpu" and all(
        float(getattr(device, "compute_capability", 0) or 0) >= 9.0 for device in jax.devices())


def triggers_dependents() -> bool:
    """Whether kernels here signal PDL's early launch (launch_dependents): on GPUs of compute capability 9.0 or more
    (Hopper on), whose PTX has griddepcontrol, and not inside interpreted()."""
    return not _interpret and _hopper_or_later()


def launch_dependents(value):
    """value as is, once this program has let the next kernel in the stream launch (griddepcontrol.launch_dependents).

    XLA launches every kernel under programmatic dependent launch (PDL) and compiles a wait on entry into each
    (griddepcontrol.wait: this kernel finished, its writes visible). The next kernel still launches only once every
    program here has triggered or exited; triggering once the inputs are in lets its launch overlap the rest of this
    kernel, and changes no value. Pallas's Triton backend has no primitive for the trigger: it rides on an inline
    assembly that passes `value` (float32) through, so it runs where `value` is used."""
    if not triggers_dependents():
        return value
    from jax.experimental.pallas import triton as pltriton

    [out] = pltriton.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[value], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(value.shape, value.dtype)])
    return out


PREFETCH_BLOCK = 16384  # weight elements a prefetch program reads: 32 KB in bf16 (16 and 8 KB ran slower, H200)
PREFETCH_MAX_BYTES = 8 << 20  # larger weights would crowd L2 (50-60 MB) and hold their kernel up for long


def prefetched(*weights) -> tuple:
    """Of `weights` (None for none), those a decode kernel reads ahead into L2 for the product after it
    (with_prefetch): whole blocks of PREFETCH_BLOCK elements, PREFETCH_MAX_BYTES at most."""
    return tuple(w for w in weights if w is not None and w.size % PREFETCH_BLOCK == 0
                 and w.size * w.dtype.itemsize <= PREFETCH_MAX_BYTES)


def with_prefetch(kernel, grid: tuple[int, ...], in_specs: list, out_specs: list, out_shape: list, weights):
    """A pallas_call's (kernel, grid, in_specs, out_specs, out_shape) and its extra operands, with the grid's first
    axis extended by programs that each read a block of `weights` (prefetched()). `kernel(position, *refs)` takes
    its program's grid position: its body runs inside a condition, where Pallas's interpreter cannot evaluate
    pl.program_id.

    A decode forward's products are latency-bound on small models, and XLA's wait on entry keeps them from loading
    their weights before the kernel ahead of them ends, as the torch engine's products do. Read by this kernel's
    spare programs, a weight sits in L2 when the product after it starts. A program writes its block's maximum to
    an extra output that nothing reads; the kernel's own programs and outputs are unchanged."""
    from jax.experimental import pallas as pl

    weights = [w.reshape(-1, PREFETCH_BLOCK) for w in weights]
    if not weights:
        return (lambda *refs: kernel([pl.program_id(axis) for axis in range(len(grid))], *refs), grid, in_specs,
                out_specs, out_shape, [])
    counts = [len(w) for w in weights]
    inner, first = math.prod(grid[1:]), grid[0]
    extra = -(-sum(counts) // inner)

    def clamped(spec):  # the prefetch programs' blocks of the kernel's operands: the last program's, never read
        if spec is pl.no_block_spec:
            return spec
        return pl.BlockSpec(spec.block_shape, lambda p, *rest: spec.index_map(jnp.minimum(p, first - 1), *rest))

    def extended(*refs):
        operands, prefetch_refs = refs[:len(in_specs)], refs[len(in_specs):len(in_specs) + len(weights)]
        *outputs, maxima_ref = refs[len(in_specs) + len(weights):]
        position = [pl.program_id(axis) for axis in range(len(grid))]
        pl.when(position[0] < first)(lambda: kernel(position, *operands, *outputs))
        block = position[0] - first  # a prefetch program's place, in row-major order of its grid position
        for axis in range(1, len(grid)):
            block = block * grid[axis] + position[axis]
        start = 0
        for weight_ref, count in zip(prefetch_refs, counts):
            @pl.when((position[0] >= first) & (block >= start) & (block < start + count))
            def _(weight_ref=weight_ref, start=start):
                values = weight_ref[pl.ds(block - start, 1), :].astype(jnp.float32)
                maxima_ref[pl.ds(block, 1)] = jnp.max(values, axis=1)
            start += count

    return (extended, (first + extra, *grid[1:]), [clamped(s) for s in in_specs] + [pl.no_block_spec] * len(weights),
            [clamped(s) for s in out_specs] + [pl.no_block_spec],
            [*out_shape, jax.ShapeDtypeStruct((extra * inner,), jnp.float32)], weights)


def rounded(value, dtype):
    """value rounded to the model's `dtype` where the layer rounds, and on in float32 (in the kernels here, in
    decode_norms_jax' and in decode_mlp_jax's)."""
    return value.astype(dtype).astype(jnp.float32)


def summed_splits(load, splits: int, dtype):
    """The float32 products `load(s)` of a reduction's splits s (in a kernel, or arrays outside one), added in order
    and rounded as one product in the model's `dtype` is, on in float32."""
    return rounded(functools.reduce(lambda total, s: total + load(s).astype(jnp.float32), range(1, splits),
                                    load(0).astype(jnp.float32)), dtype)


def takes_inputs(q_heads: int, kv_heads: int, head_dim: int, dtype) -> bool:
    """Whether a decode forward's q/k/v epilogue of a layer with `q_heads` over `kv_heads` runs in inputs(): bf16/fp16
    on a GPU with Pallas's Triton backend (or interpreted()), and whole tiles of a KV head's query heads by half a head
    (powers of two)."""
    groups = q_heads // kv_heads
    return (on_device(dtype) and q_heads % kv_heads == 0 and all(n & (n - 1) == 0 for n in (groups, head_dim))
            and head_dim >= 16)


def _inputs_kernel(proj_ref, q_weight_ref, k_weight_ref, cos_ref, sin_ref, slot_ref, *refs, q_heads: int, groups: int,
                   writes: bool, half: int, eps: float, weight_offset: float, v_norm: bool):
    from jax.experimental import pallas as pl

    q_ref = refs[-3] if writes else refs[-1]  # refs: (keys, values,) q, keys, values (aliased) or q alone
    token, position, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_heads = q_heads // groups
    halves = (pl.ds(0, half), pl.ds(half, half))
    cos1, cos2 = (cos_ref[token, position, h].astype(jnp.float32)[None, :] for h in halves)
    sin1, sin2 = (sin_ref[token, position, h].astype(jnp.float32)[None, :] for h in halves)
    dtype = q_ref.dtype

    def projected(first, count: int):
        """Heads first.. of the token's projection, its halves apart, [count, half] float32 twice: the splits'
        products added in order and rounded as a product in the model's dtype is."""
        return tuple(summed_splits(lambda s: proj_ref[s, token, position, pl.ds(first, count), h],
                                   proj_ref.shape[0], dtype) for h in halves)

    def normed(first, count: int, weight_ref):
        """Through the RMS norm, rounded as gemma_jax._rms_norm rounds (weight_ref None: Gemma 4's scale-free norm)."""
        x1, x2 = projected(first, count)
        scale = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) * (0.5 / half) + eps)[:, None]
        x1, x2 = x1 * scale, x2 * scale
        if weight_ref is not None:
            x1, x2 = (x * (weight_offset + weight_ref[h].astype(jnp.float32))[None, :]
                      for x, h in zip((x1, x2), halves))
        return rounded(x1, dtype), rounded(x2, dtype)

    def rotated(x1, x2):  # RoPE's rotate-half: the first half pairs with the second
        return (x1 * cos1 - x2 * sin1).astype(dtype), (x2 * cos2 + x1 * sin2).astype(dtype)

    for h, value in zip(halves, rotated(*normed(kv_head * groups, groups, q_weight_ref))):
        q_ref[:, h] = value
    if writes:
        keys_ref, values_ref = refs[-2:]
        slot, head = slot_ref[token, position], pl.ds(kv_head, 1)
        for h, value in zip(halves, rotated(*normed(q_heads + kv_head, 1, k_weight_ref))):
            keys_ref[token, head, slot, h] = value
        v_head = q_heads + kv_heads + kv_head
        values = normed(v_head, 1, None) if v_norm else projected(v_head, 1)
        for h, value in zip(halves, values):
            values_ref[token, head, slot, h] = value.astype(dtype)


def inputs(partials, q_weight, k_weight, cos, sin, slots, keys, values, *, q_heads: int, kv_heads: int, eps: float,
           weight_offset: float, v_norm: bool, dtype):
    """A decode forward's q/k/v epilogue in one kernel, a program per token and KV head: from the products of the
    packed projection's `partials` [splits, B, T, heads, hd] (the splits of its reduction, added here in order; the
    q heads, then k's, then v's; q's alone for a KV-shared layer, whose `keys` and `values` are None), q and k
    RMS-normed with weights q_weight and k_weight [hd] (times weight_offset + w) and rotated by cos and sin [B, T, hd],
    v normed without a weight where `v_norm` (Gemma 4), each rounded to the model's `dtype` where the layer rounds.
    Returns q [B, T, q_heads, hd] and the cache's keys and values [B, kv_heads, slots, hd] with the chunk's written
    at `slots` [B, T] (the same buffers, updated in place).

    q is written by KV head, then token ([B, kv_heads, T, groups, hd]), as attend() reads it: XLA cancels the
    transpose back against attend's, where a transpose kernel ran otherwise (1.3 us a layer on E4B's 2 KV heads)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    _, B, T, _, head_dim = partials.shape
    groups, writes = q_heads // kv_heads, keys is not None
    kernel = functools.partial(_inputs_kernel, q_heads=q_heads, groups=groups, writes=writes, half=head_dim // 2,
                               eps=eps, weight_offset=weight_offset, v_norm=v_norm)
    operands = [partials, q_weight, q_weight if k_weight is None else k_weight, cos, sin, slots]
    out_shape = [jax.ShapeDtypeStruct((B, kv_heads, T, groups, head_dim), dtype)]
    out_specs = [pl.BlockSpec((None, None, None, groups, head_dim), lambda b, t, g: (b, g, t, 0, 0))]
    if writes:  # written where the slots say: the whole cache is the block, aliased to the output
        operands += [keys, values]
        out_shape += [jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct(values.shape, values.dtype)]
        out_specs += [pl.no_block_spec, pl.no_block_spec]
    results = pl.pallas_call(
        kernel,
        grid=(B, T, kv_heads),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={6: 1, 7: 2} if writes else {},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),  # 3.0 against 3.5 us with 4 (270M, H100)
        interpret=_interpret,
        name="decode_attention_inputs",
    )(*operands)
    q = results[0].transpose(0, 2, 1, 3, 4).reshape(B, T, q_heads, head_dim)
    return (q, *results[1:]) if writes else (q, keys, values)


def _partials_kernel(_position, q_ref, k_ref, v_ref, stored_ref, low_ref, high_ref, acc_ref, top_ref, total_ref, *,
                     scale: float, steps: int, block_s: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    query, low, high = q_ref[...], low_ref[...], high_ref[...]

    def step(i, carry):
        top, total, acc = carry
        window = pl.ds(i * block_s, block_s)
        keys, values, position = k_ref[window, :], v_ref[window, :], stored_ref[window]
        allowed = (position[None, :] >= low[:, None]) & (position[None, :] <= high[:, None])
        scores = jnp.where(allowed, plgpu.dot(query, keys, trans_b=True) * scale, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(axis=1))
        shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # no slot yet: exp(-inf) = 0, not NaN
        p = jnp.exp(scores - shift[:, None])
        rescale = jnp.exp(top - shift)
        acc = acc * rescale[:, None] + plgpu.dot(p.astype(values.dtype), values)
        return new_top, total * rescale + p.sum(axis=1), acc

    rows, d_block = acc_ref.shape
    start = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, d_block), jnp.float32))
    top, total, acc = jax.lax.fori_loop(0, steps, step, start)
    acc_ref[...] = acc
    top_ref[...] = top  # the same values from every program of the row block's value columns
    total_ref[...] = total


def _batch_and_head(program, heads: int, d_blocks: int):
    """A program's batch row and KV head: programs along the grid's first axis run (batch, KV head, value columns)."""
    return program // (heads * d_blocks), program // d_blocks % heads


def partials(q, keys, values, stored, low, high, scale: float, prefetch=()):
    """The splits' float32 partials (acc [B, n_kv, splits, rows, hd], top and total [B, n_kv, splits, rows]) of q
    [B, n_kv, rows, hd] over keys and values [B, n_kv, slots, hd], the position each slot holds [B, slots] and each
    row's lowest and highest attended position [B, rows]. Spare programs read `prefetch` into L2 (with_prefetch)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, heads, rows, head_dim = q.shape
    config = plan(keys.shape[2], head_dim, heads)
    chunk, d_block = config["chunk"], config["D_BLOCK"]
    d_blocks, splits = head_dim // d_block, config["splits"]

    head = functools.partial(_batch_and_head, heads=heads, d_blocks=d_blocks)
    kernel = functools.partial(_partials_kernel, scale=scale, steps=chunk // config["BLOCK_S"],
                               block_s=config["BLOCK_S"])
    partial_shape = (B, heads, splits, rows)
    in_specs = [
        pl.BlockSpec((None, None, BLOCK_M, head_dim), lambda p, r, s: (*head(p), r, 0)),
        pl.BlockSpec((None, None, chunk, head_dim), lambda p, r, s: (*head(p), s, 0)),
        pl.BlockSpec((None, None, chunk, d_block), lambda p, r, s: (*head(p), s, p % d_blocks)),
        pl.BlockSpec((None, chunk), lambda p, r, s: (head(p)[0], s)),
        pl.BlockSpec((None, BLOCK_M), lambda p, r, s: (head(p)[0], r)),
        pl.BlockSpec((None, BLOCK_M), lambda p, r, s: (head(p)[0], r)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, BLOCK_M, d_block), lambda p, r, s: (*head(p), s, r, p % d_blocks)),
        pl.BlockSpec((None, None, None, BLOCK_M), lambda p, r, s: (*head(p), s, r)),
        pl.BlockSpec((None, None, None, BLOCK_M), lambda p, r, s: (*head(p), s, r)),
    ]
    out_shape = [jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct(partial_shape, jnp.float32), jax.ShapeDtypeStruct(partial_shape, jnp.float32)]
    kernel, grid, in_specs, out_specs, out_shape, weights = with_prefetch(
        kernel, (B * heads * d_blocks, rows // BLOCK_M, splits), in_specs, out_specs, out_shape, prefetch)
    results = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config["num_warps"], num_stages=2),
        interpret=_interpret,
        name="decode_attention_partials",
    )(q, keys, values, stored, low, high, *weights)
    return results[:3]


COMBINE_ROWS, COMBINE_COLUMNS = 8, 32  # a combine program's query rows and value columns, as torch's combine kernel


def _combine_kernel(acc_ref, top_ref, total_ref, out_ref, *, splits: int):
    tops = [top_ref[s] for s in range(splits)]
    best = functools.reduce(jnp.maximum, tops)  # finite: every row attends to its own slot
    out = norm = 0.0
    for s in range(splits):  # one by one, in split order
        weight = jnp.exp(tops[s] - best)
        out, norm = out + acc_ref[s] * weight[..., None], norm + total_ref[s] * weight
    out_ref[...] = (out / norm[..., None]).astype(out_ref.dtype)


def combine(acc, top, total, dtype):
    """The splits' partials (acc [B, n_kv, splits, T, groups, hd], top and total [B, n_kv, splits, T, groups]) ->
    [B, T, n_kv, groups, hd] in `dtype`, the layout o_proj reads, in one kernel."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, heads, splits, T, groups, head_dim = acc.shape
    tokens, columns = COMBINE_ROWS // groups, min(COMBINE_COLUMNS, head_dim)
    d_blocks = head_dim // columns

    head = functools.partial(_batch_and_head, heads=heads, d_blocks=d_blocks)
    partial_spec = pl.BlockSpec((None, None, splits, tokens, groups), lambda p, t: (*head(p), 0, t, 0))
    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits),
        grid=(B * heads * d_blocks, T // tokens),
        in_specs=[pl.BlockSpec((None, None, splits, tokens, groups, columns),
                               lambda p, t: (*head(p), 0, t, 0, p % d_blocks)), partial_spec, partial_spec],
        out_specs=pl.BlockSpec((None, tokens, None, groups, columns),
                               lambda p, t: (head(p)[0], t, head(p)[1], 0, p % d_blocks)),
        out_shape=jax.ShapeDtypeStruct((B, T, heads, groups, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=_interpret,
        name="decode_attention_combine",
    )(acc, top, total)


def attend(q, keys, values, stored, lowest, highest, scale: float, prefetch=()):
    """softmax(q keys^T * scale over the slots whose positions lie in lowest..highest of the row's token) values:
    q [B, T, n_kv, groups, hd], keys and values [B, n_kv, slots, hd], the position each slot holds [B, slots], the
    lowest and highest position each token attends [B, T]. -> [B, T, n_kv, groups, hd] in q's dtype. The partials'
    kernel reads the weights `prefetch` into L2 on the side (with_prefetch)."""
    B, T, heads, groups, head_dim = q.shape
    rows = q.transpose(0, 2, 1, 3, 4).reshape(B, heads, T * groups, head_dim)  # by token, then query head
    low, high = (jnp.repeat(bound, groups, axis=1) for bound in (lowest, highest))  # a bound a row
    acc, top, total = partials(rows, keys, values, stored, low, high, scale, prefetch=prefetch)
    splits = top.shape[2]
    return combine(acc.reshape(B, heads, splits, T, groups, head_dim), top.reshape(B, heads, splits, T, groups),
                   total.reshape(B, heads, splits, T, groups), q.dtype)
