"""FP8 weights: a linear's weight [N, K] as float8_e4m3fn values and a float32 scale for each output row.

A row's scale is its largest magnitude over e4m3's largest value (448; 1 for a row of zeros), and its values are the
row over its scale, rounded to nearest. A product reads the values, converted exactly to the activations' dtype,
accumulates in float32, and multiplies each output column by its row's scale before rounding:
`y = round((x @ values.T) * scale)`. So the weights move at one byte each, and the scale costs one multiply a
column. XLA fuses the conversion into its GEMM (on an H200, the 31B's down and gate/up products 1.5x and 2.0x
faster than bf16's); dequantizing the weight before the product instead made XLA write the bf16 weight every step,
about 3x slower than bf16 (docs/benchmarks.md).

What is quantized: every linear whose rows are output features (the attention and MLP projections, Gemma 4's
per-layer gates and projections, the LM head). Norms, token tables (a lookup reads one row), MoE experts and the
router stay in the model's dtype. A tied LM head gets an FP8 copy of its own (`lm_head.weight`), so the token
table's lookups keep their exact rows.

The engine's gates compare an FP8 engine with itself (speculative against plain decode), so they hold as in bf16:
FP8 changes the model, not whether a run of it is lossless.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0


class Fp8Weight(NamedTuple):
    """A linear's weight as FP8 values [N, K] and float32 scales [N] (a pytree: params hold it as an array)."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether weight `name` is stored in FP8: a 2-D linear whose rows are output features (module docstring)."""
    linear = name.endswith(("_proj.weight", "per_layer_input_gate.weight", "per_layer_projection.weight",
                            "per_layer_model_projection.weight", "lm_head.weight"))
    return linear and len(shape) == 2


def quantize(weight) -> Fp8Weight:
    """weight [N, K] (any float dtype) -> Fp8Weight, a scale per row (module docstring)."""
    w = weight.astype(jnp.float32)
    peak = jnp.max(jnp.abs(w), axis=1)
    scale = jnp.where(peak > 0, peak / E4M3_MAX, 1.0)
    # e4m3fn has no infinity: a quotient rounded past 448 would convert to NaN, so it is clipped first
    values = jnp.clip(w / scale[:, None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return Fp8Weight(values, scale)


def quantize_params(params: dict, tied_head: str | None = None) -> dict:
    """params with every weight that quantizes() as Fp8Weight; `tied_head`: the name of the token table that is also
    the LM head, which gets an FP8 copy as `lm_head.weight`."""
    out = {name: quantize(w) if quantizes(name, w.shape) else w for name, w in params.items()}
    if tied_head is not None:
        out["lm_head.weight"] = quantize(params[tied_head])
    return out


def product(x, weight: Fp8Weight):
    """x [..., K] by weight's rows in float32, each output column times its row's scale: [..., N] float32."""
    acc = jnp.matmul(x, weight.values.astype(x.dtype).T, preferred_element_type=jnp.float32)
    return acc * weight.scale


def dequantized(weight: Fp8Weight, dtype=jnp.float32):
    """The weight its values and scales stand for, [N, K] in `dtype` (for tests and references)."""
    return (weight.values.astype(jnp.float32) * weight.scale[:, None]).astype(dtype)
