"""A JAX decode forward's gate/up product with its GELU as one Pallas kernel (Triton on GPUs).

XLA ran a decode forward's feed-forward after its norm as three kernels: gate/up's product, a loop fusion applying
gelu_tanh(gate) * up (1.4 us a layer on the 270M, 1.5 on E4B, H200), and down's product. gated() runs the first two
as one: a program takes BLOCK_COLUMNS features of gate and the same features of up, reduces whole rows of both
weights against the rows of x, and applies the GELU to its own outputs. On E4B it moves the weight at XLA's GEMM's
rate, so the GELU's kernel is what it saves. The 31B's 462 MB weight XLA moves at the copy rate, and there the
kernel took 122 us against XLA's 110, which is why it takes weights of at most MAX_WEIGHT_BYTES (docs/journal).

A program's dot takes BLOCK_ROWS rows, the forward's and masked ones, and what it computes for a row depends on
that row alone, so a row's bits do not depend on the forward's other rows. Forwards of more rows (batches of more than
two at generate's width) keep XLA's path: the kernel would read its weight once for every block of rows.

per_layer_gated() runs Gemma 4's per-layer gate, its GELU and its product with the layer's per-layer input as one
kernel too, split over the reduction as well (its weight has 256 features).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from specdec.models.decode_attention_jax import interpreting, on_device, rounded, summed_splits

BLOCK_ROWS = 16  # a Triton dot's rows at least, and the most a forward may have here
# Swept on E4B's and the 270M's layers (H200): other columns, stages and warps ran slower (docs/journal)
BLOCK_COLUMNS = 32  # features of gate (and of up) a program: 320 programs on E4B's 10,240, 64 on the 270M's 2,048
BLOCK_REDUCTION = 128  # the reduction a step, 3 steps in flight
MAX_WEIGHT_BYTES = 128 << 20  # E4B's 105 MB; not the 31B's 462 MB


def takes(weight, rows: int, dtype) -> bool:
    """Whether a decode forward of `rows` rows runs its gate/up with the packed `weight` [2 x features, hidden] here:
    bf16/fp16 on a GPU with Pallas's Triton backend (or interpreted()), at most BLOCK_ROWS rows and MAX_WEIGHT_BYTES,
    and whole blocks of features and of the reduction."""
    if getattr(weight, "ndim", None) != 2:  # gate and up unpacked (None) or FP8 (values and scales): XLA's path
        return False
    features, hidden = weight.shape[0] // 2, weight.shape[1]
    return (on_device(dtype) and rows <= BLOCK_ROWS and weight.size * weight.dtype.itemsize <= MAX_WEIGHT_BYTES
            and features % BLOCK_COLUMNS == 0 and hidden % BLOCK_REDUCTION == 0)


def _kernel(x_ref, weight_ref, out_ref, *, rows: int, features: int, steps: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    block = pl.program_id(0)
    live, row_slice = (jnp.arange(BLOCK_ROWS) < rows)[:, None], pl.ds(0, BLOCK_ROWS)
    gate_rows, up_rows = pl.ds(block * BLOCK_COLUMNS, BLOCK_COLUMNS), pl.ds(features + block * BLOCK_COLUMNS,
                                                                            BLOCK_COLUMNS)

    def step(i, sums):
        reduction = pl.ds(i * BLOCK_REDUCTION, BLOCK_REDUCTION)
        x = plgpu.load(x_ref.at[row_slice, reduction], mask=live, other=0.0)
        return tuple(total + plgpu.dot(x, weight_ref[part, reduction], trans_b=True)
                     for total, part in zip(sums, (gate_rows, up_rows)))

    zeros = jnp.zeros((BLOCK_ROWS, BLOCK_COLUMNS), jnp.float32)
    gate, up = jax.lax.fori_loop(0, steps, step, (zeros, zeros))
    dtype = out_ref.dtype

    # rounded where the layer rounds: each product, the GELU, the product of both
    gelu = rounded(jax.nn.gelu(rounded(gate, dtype), approximate=True), dtype)
    hidden = rounded(gelu * rounded(up, dtype), dtype)
    plgpu.store(out_ref.at[row_slice, pl.ds(block * BLOCK_COLUMNS, BLOCK_COLUMNS)], hidden.astype(dtype), mask=live)


def gated(x, weight):
    """gelu_tanh(gate) * up for x [B, T, hidden] (B x T rows, at most BLOCK_ROWS) and gate/up's packed weight
    [2 x features, hidden] (gate's rows, then up's): [B, T, features] in x's dtype, each product rounded to it as
    gemma_jax._linear's is, then the GELU, then their product, as gemma_jax._mlp rounds. The reduction is a program's
    own, in steps of BLOCK_REDUCTION."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, T, hidden = x.shape
    rows, features = B * T, weight.shape[0] // 2
    kernel = functools.partial(_kernel, rows=rows, features=features, steps=hidden // BLOCK_REDUCTION)
    out = pl.pallas_call(
        kernel,
        grid=(features // BLOCK_COLUMNS,),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((rows, features), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpreting(),
        name="decode_gated",
    )(x.reshape(rows, hidden), weight)
    return out.reshape(B, T, features)


# -- Gemma 4's per-layer gate ------------------------------------------------------------------------------------
# E4B's gate is 256 features of 2,560: split by features alone, 16 programs each streamed 82 KB, and took 7.3 us
# against the 6.3 of XLA's product and its fusion for the GELU times the input (H200, docs/journal). So the
# reduction is split over programs too, and the last program of a block of features to arrive adds the splits'
# partials in order: 5.1 us for XLA's two kernels, E4B's JAX cycle 0.7% shorter. Swept: 32 features, 128 or 512
# of the reduction, and 1, 2 or 8 warps ran slower.
PER_LAYER_COLUMNS = 16  # features a program
PER_LAYER_REDUCTION = 256  # the most of the reduction a program takes: 10 splits of E4B's 2,560, 160 programs


def _per_layer_reduction(hidden: int) -> int:
    """The reduction a program takes, a power of two: a whole split of `hidden`."""
    return math.gcd(hidden, PER_LAYER_REDUCTION)


def takes_per_layer_gate(weight, rows: int, dtype) -> bool:
    """Whether a decode forward of `rows` rows runs Gemma 4's per-layer gate with its `weight` [features, hidden] in
    per_layer_gated(): as takes(), with whole blocks of PER_LAYER_COLUMNS features and splits of at least 16."""
    return (getattr(weight, "ndim", None) == 2 and on_device(dtype) and rows <= BLOCK_ROWS
            and weight.shape[0] % PER_LAYER_COLUMNS == 0 and _per_layer_reduction(weight.shape[1]) >= 16)


def _per_layer_kernel(x_ref, weight_ref, per_layer_ref, _arrivals_in, out_ref, partials_ref, arrivals_ref, *,
                      rows: int, splits: int, reduction: int, layer: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    block, split = pl.program_id(0), pl.program_id(1)
    live, row_slice = (jnp.arange(BLOCK_ROWS) < rows)[:, None], pl.ds(0, BLOCK_ROWS)
    own = pl.ds(block * PER_LAYER_COLUMNS, PER_LAYER_COLUMNS)
    span = pl.ds(split * reduction, reduction)
    x = plgpu.load(x_ref.at[row_slice, span], mask=live, other=0.0)
    # the layer's own per-layer input, from all layers' [rows, layers, features]: read before the product, so that
    # the last program has it by the time it needs it
    other = plgpu.load(per_layer_ref.at[row_slice, jnp.int32(layer), own], mask=live, other=0.0)
    plgpu.store(partials_ref.at[split, row_slice, own], plgpu.dot(x, weight_ref[own, span], trans_b=True))
    if not interpreting():  # every thread's partial stored before the arrival releases them
        plgpu.debug_barrier()
    arrived = plgpu.atomic_add(arrivals_ref, block, jnp.int32(1))  # acquire-release at the GPU's scope

    @pl.when(arrived == splits - 1)
    def _last():  # in the splits' order, whichever arrived last; past L1, which may hold stale lines
        dtype = out_ref.dtype
        product = summed_splits(lambda s: plgpu.load(partials_ref.at[jnp.int32(s), row_slice, own], volatile=True),
                                splits, dtype)
        gelu = rounded(jax.nn.gelu(product, approximate=True), dtype)
        plgpu.store(out_ref.at[row_slice, own], rounded(gelu * other.astype(jnp.float32), dtype).astype(dtype),
                    mask=live)
        plgpu.atomic_add(arrivals_ref, block, jnp.int32(-splits))  # zero again for the next layer's


def per_layer_gated(x, weight, per_layer, layer: int, arrivals=None):
    """Gemma 4's per-layer gate gelu_tanh(x gate^T) * per_layer[:, :, layer], for x [B, T, hidden] (B x T rows, at
    most BLOCK_ROWS), its gate `weight` [features, hidden] and every layer's per-layer inputs [B, T, layers,
    features], rounded as gemma_jax._decoder_layer rounds it: [B, T, features] in x's dtype. It reads its layer's
    inputs from the whole array, which XLA computes once for every layer.

    -> (the gate, `arrivals`). `arrivals`: int32 [features / PER_LAYER_COLUMNS] zeros, which the kernel counts on
    and leaves zero, so one forward's layers pass it on (a new one where None). A program takes PER_LAYER_COLUMNS
    features over a split of the reduction (at most PER_LAYER_REDUCTION); the last of a block's programs to arrive
    adds the splits in order, so the sum is the same whichever arrives last, and a row's bits do not depend on the
    other rows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, T, hidden = x.shape
    rows, features = B * T, weight.shape[0]
    reduction = _per_layer_reduction(hidden)
    blocks, splits = features // PER_LAYER_COLUMNS, hidden // reduction
    if arrivals is None:
        arrivals = jnp.zeros((blocks,), jnp.int32)
    out, _, arrivals = pl.pallas_call(
        functools.partial(_per_layer_kernel, rows=rows, splits=splits, reduction=reduction, layer=layer),
        grid=(blocks, splits),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=[pl.no_block_spec] * 3,
        out_shape=[jax.ShapeDtypeStruct((rows, features), x.dtype),
                   jax.ShapeDtypeStruct((splits, BLOCK_ROWS, features), jnp.float32),
                   jax.ShapeDtypeStruct((blocks,), jnp.int32)],
        input_output_aliases={3: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpreting(),
        name="decode_per_layer_gated",
    )(x.reshape(rows, hidden), weight, per_layer.reshape(rows, per_layer.shape[2], features), arrivals)
    return out.reshape(B, T, features), arrivals
