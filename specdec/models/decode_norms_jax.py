"""A JAX decode forward's residual adds, with the norms on either side of each, as one Pallas kernel (Triton on GPUs).

A Gemma layer adds a normed product to its residual twice, and norms the sum for what follows: after o_proj,
`x = residual + post_attention_norm(attn)` and `pre_feedforward_norm(x)`; after down_proj (or, with per-layer inputs,
the per-layer projection), `x = residual + post_norm(h)`, Gemma 4's layer scalar, and the next layer's input norm.
XLA ran the first as one kernel and the second as two on the 270M, and took 3.4-5.1 us a kernel on E4B's wider rows
(docs/journal). residual_norms runs each as one, a program a row, which also adds the splits of the product's
reduction (decode_plan.reduction_splits) that XLA had fused into its norms.

Triton's loads are powers of two, and hidden sizes are not (640, 2,560, 5,376): a row is read and written in
power-of-two runs of its columns (runs()).

A program reads and writes its own row alone, so a row's bits do not depend on the forward's other rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdec.models.decode_attention_jax import (interpreting, launch_dependents, on_device, rounded, summed_splits,
                                                 with_prefetch)


def runs(hidden: int) -> list[tuple[int, int]]:
    """hidden's columns as (start, size) runs of powers of two, largest first: 640 -> (0, 512), (512, 128)."""
    sizes = [1 << bit for bit in reversed(range(hidden.bit_length())) if hidden >> bit & 1]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes))


MAX_RUNS = 4  # a row's loads and stores per operand; 3,840 (Gemma 3 12B) needs 4


def takes(hidden: int, dtype) -> bool:
    """Whether a decode forward's residual adds run here: on_device, and a hidden size of at most MAX_RUNS runs."""
    return on_device(dtype) and len(runs(hidden)) <= MAX_RUNS


def _warps(hidden: int) -> int:
    """Warps a program: 8 for rows of up to 1,024 columns, else 16. A call on the 270M's rows took 2.7, 2.4 and
    2.3 us with 1, 4 and 8 warps; on E4B's, 4.1, 3.3 and 2.9 us with 4, 8 and 16 (H200). The 31B's rows ran with
    8 alone."""
    return 8 if hidden <= 1024 else 16


def _kernel(position, partials_ref, residual_ref, post_ref, next_ref, scale_ref, x_ref, normed_ref=None, *,
            hidden: int, eps: float, weight_offset: float, scaled: bool):
    from jax.experimental import pallas as pl

    row, dtype = position[0], x_ref.dtype
    columns = [pl.ds(start, size) for start, size in runs(hidden)]

    def normed(parts, weight_ref):
        """parts through the RMS norm with weight_ref (times weight_offset + w), as gemma_jax._rms_norm rounds."""
        scale = jax.lax.rsqrt(sum(jnp.sum(part * part) for part in parts) * (1.0 / hidden) + eps)
        return [rounded(part * scale * (weight_offset + weight_ref[c].astype(jnp.float32)), dtype)
                for part, c in zip(parts, columns)]

    products = [summed_splits(lambda s: partials_ref[s, row, c], partials_ref.shape[0], dtype)
                for c in columns]
    products[0] = launch_dependents(products[0])  # the next product (gate/up or q/k/v) launches while this norms
    x = [rounded(residual_ref[row, c].astype(jnp.float32) + post, dtype)
         for post, c in zip(normed(products, post_ref), columns)]
    if scaled:  # Gemma 4's layer scalar
        x = [rounded(part * scale_ref[0].astype(jnp.float32), dtype) for part in x]
    for part, c in zip(x, columns):
        x_ref[row, c] = part.astype(dtype)
    if normed_ref is None:
        return
    for part, c in zip(normed(x, next_ref), columns):
        normed_ref[row, c] = part.astype(dtype)


def residual_norms(partials, residual, post_weight, next_weight, scale=None, *, eps: float, weight_offset: float,
                   prefetch=()):
    """`x = residual + norm(product, post_weight)`, times `scale` (Gemma 4's layer scalar [1]) where given, and
    `norm(x, next_weight)` (None where next_weight is None), both [B, T, H] in residual's dtype, in one kernel. The
    product comes as the splits of its reduction, `partials` [splits, B, T, H] (float32 where split, else the one
    product in the model's dtype), added here in order and rounded to the model's dtype, as the product itself is.
    Norms scale by weight_offset + w, in float32, rounded as gemma_jax._rms_norm rounds. Spare programs read the
    weights `prefetch` into L2 for the product after this kernel (decode_attention_jax.with_prefetch)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    splits, B, T, hidden = partials.shape
    rows, dtype = B * T, residual.dtype
    kernel = functools.partial(_kernel, hidden=hidden, eps=eps, weight_offset=weight_offset, scaled=scale is not None)
    outputs = 1 if next_weight is None else 2
    operands = [partials.reshape(splits, rows, hidden), residual.reshape(rows, hidden), post_weight,
                post_weight if next_weight is None else next_weight,
                post_weight if scale is None else scale]  # (unread operands in next_weight's and scale's places)
    kernel, grid, in_specs, out_specs, out_shape, weights = with_prefetch(
        kernel, (rows,), [pl.no_block_spec] * len(operands), [pl.no_block_spec] * outputs,
        [jax.ShapeDtypeStruct((rows, hidden), dtype)] * outputs, prefetch)
    x, *normed = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=_warps(hidden), num_stages=1),
        interpret=interpreting(),
        name="decode_residual_norms",
    )(*operands, *weights)[:outputs]
    return x.reshape(B, T, hidden), normed[0].reshape(B, T, hidden) if normed else None
