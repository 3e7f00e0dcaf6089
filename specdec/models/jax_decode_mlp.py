"""A JAX decode forward's gate/up product with its GELU as one Pallas kernel (Triton on GPUs).

XLA ran a decode forward's feed-forward after its norm as three kernels: gate/up's product, a loop fusion applying
gelu_tanh(gate) * up (1.4 us a layer on the 270M, 1.5 on E4B, H200), and down's product. gated() runs the first two
as one: a program takes BLOCK_COLUMNS features of gate and the same features of up, reduces whole rows of both
weights against the rows of x, and applies the GELU to its own outputs. On E4B it moves the weight at XLA's GEMM's
rate, so the GELU's kernel is what it saves. The 31B's 462 MB weight XLA moves at the copy rate, and there the
kernel took 122 us against XLA's 110, which is why it takes weights of at most MAX_WEIGHT_BYTES (docs/benchmarks.md).

A program's dot takes BLOCK_ROWS rows, the forward's and masked ones, and what it computes for a row depends on
that row alone, so a row's bits do not depend on the forward's other rows. Forwards of more rows (batches of more than
two at generate's width) keep XLA's path: the kernel would read its weight once for every block of rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from specdec.models.jax_decode_attention import interpreting, on_device, rounded

BLOCK_ROWS = 16  # a Triton dot's rows at least, and the most a forward may have here
# Swept on E4B's and the 270M's layers (H200): other columns, stages and warps ran slower (docs/benchmarks.md)
BLOCK_COLUMNS = 32  # features of gate (and of up) a program: 320 programs on E4B's 10,240, 64 on the 270M's 2,048
BLOCK_REDUCTION = 128  # the reduction a step
STAGES = 3  # steps in flight
# Gemma 4's per-layer gate (E4B: 256 features of 2,560): (features a program, the reduction a step, steps in flight).
# Its 16 programs each stream 82 KB of the weight, so a step is wide to keep enough of it in flight. Not yet swept.
PER_LAYER_BLOCKS = (16, 512, 3)
MAX_WEIGHT_BYTES = 128 << 20  # E4B's 105 MB; not the 31B's 462 MB


def _blocks(hidden: int, per_layer_gate: bool) -> tuple[int, int, int]:
    """(features a program, the reduction a step, steps in flight) for a weight of `hidden` columns."""
    if not per_layer_gate:
        return BLOCK_COLUMNS, BLOCK_REDUCTION, STAGES
    columns, reduction, stages = PER_LAYER_BLOCKS
    return columns, math.gcd(hidden, reduction), stages


def takes(weight, rows: int, dtype, per_layer_gate: bool = False) -> bool:
    """Whether a decode forward of `rows` rows runs its gate/up with the packed `weight` [2 x features, hidden] here
    (with `per_layer_gate`, Gemma 4's per-layer gate with its weight [features, hidden]): bf16/fp16 on a GPU with
    Pallas's Triton backend (or interpreted()), at most BLOCK_ROWS rows and MAX_WEIGHT_BYTES, and whole blocks of
    features and of the reduction."""
    if getattr(weight, "ndim", None) != 2:  # gate and up unpacked (None) or FP8 (values and scales): XLA's path
        return False
    features, hidden = weight.shape[0] // (1 if per_layer_gate else 2), weight.shape[1]
    columns, reduction, _ = _blocks(hidden, per_layer_gate)
    return (on_device(dtype) and rows <= BLOCK_ROWS and weight.size * weight.dtype.itemsize <= MAX_WEIGHT_BYTES
            and features % columns == 0 and hidden % reduction == 0 and reduction >= 16)


def _kernel(x_ref, weight_ref, *refs, rows: int, features: int, steps: int, columns: int, reduction: int,
            layer: int | None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    out_ref = refs[-1]  # refs: (the per-layer inputs,) out
    block = pl.program_id(0)
    live, row_slice = (jnp.arange(BLOCK_ROWS) < rows)[:, None], pl.ds(0, BLOCK_ROWS)
    own = pl.ds(block * columns, columns)
    parts = (own,) if layer is not None else (own, pl.ds(features + block * columns, columns))

    def step(i, sums):
        span = pl.ds(i * reduction, reduction)
        x = plgpu.load(x_ref.at[row_slice, span], mask=live, other=0.0)
        return tuple(total + plgpu.dot(x, weight_ref[part, span], trans_b=True) for total, part in zip(sums, parts))

    zeros = jnp.zeros((BLOCK_ROWS, columns), jnp.float32)
    products = jax.lax.fori_loop(0, steps, step, (zeros,) * len(parts))
    dtype = out_ref.dtype

    # rounded where the layer rounds: each product, the GELU, its product with up (or the per-layer input)
    gelu = rounded(jax.nn.gelu(rounded(products[0], dtype), approximate=True), dtype)
    if layer is None:
        other = rounded(products[1], dtype)
    else:  # the layer's own per-layer input, read from all layers' [rows, layers, features] (traced indices)
        other = plgpu.load(refs[0].at[row_slice, jnp.int32(layer), own], mask=live, other=0.0).astype(jnp.float32)
    plgpu.store(out_ref.at[row_slice, own], rounded(gelu * other, dtype).astype(dtype), mask=live)


def gated(x, weight, per_layer=None, layer: int | None = None):
    """gelu_tanh(gate) * up for x [B, T, hidden] (B x T rows, at most BLOCK_ROWS) and gate/up's packed weight
    [2 x features, hidden] (gate's rows, then up's): [B, T, features] in x's dtype, each product rounded to it as
    jax_gemma._linear's is, then the GELU, then their product, as jax_gemma._mlp rounds. The reduction is a program's
    own, in steps of BLOCK_REDUCTION.

    With `per_layer` (all layers' per-layer inputs [B, T, layers, features]) and `layer`, Gemma 4's per-layer gate
    instead: gelu_tanh(x gate^T) * per_layer[:, :, layer] for its gate `weight` [features, hidden], as
    jax_gemma._decoder_layer rounds it. The kernel reads its layer's inputs from the whole array, which XLA computes
    once for every layer (sliced, XLA fused each layer's into a kernel of its own)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    B, T, hidden = x.shape
    rows = B * T
    per_layer_gate = per_layer is not None
    features = weight.shape[0] if per_layer_gate else weight.shape[0] // 2
    columns, reduction, stages = _blocks(hidden, per_layer_gate)
    kernel = functools.partial(_kernel, rows=rows, features=features, steps=hidden // reduction, columns=columns,
                               reduction=reduction, layer=layer if per_layer_gate else None)
    operands = [x.reshape(rows, hidden), weight]
    if per_layer_gate:
        operands.append(per_layer.reshape(rows, per_layer.shape[2], features))
    out = pl.pallas_call(
        kernel,
        grid=(features // columns,),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((rows, features), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=stages),
        interpret=interpreting(),
        name="decode_per_layer_gated" if per_layer_gate else "decode_gated",
    )(*operands)
    return out.reshape(B, T, features)
