"""FP8 weights: a linear's weight [N, K] as float8_e4m3fn values and a float32 scale for each output row.

A row's scale is its largest magnitude over e4m3's largest value (448; 1 for a row of zeros), and its values are the
row over its scale, rounded to nearest. A product reads the values, converted exactly to the activations' dtype,
accumulates in float32, and multiplies each output column by its row's scale before rounding:
`y = round((x @ values.T) * scale)`. So the weights move at one byte each, and the scale costs one multiply a
column. Both engines follow this spec (fp8_jax, fp8_torch); dequantizing a weight before its product would write the
whole bf16 weight every step, about 3x slower than bf16 (docs/journal).

What is quantized: every linear whose rows are output features (the attention and MLP projections, Gemma 4's
per-layer gates and projections, the LM head). Norms, token tables (a lookup reads one row), MoE experts and the
router stay in the model's dtype. A tied LM head gets an FP8 copy of its own (`lm_head.weight`), so the token
table's lookups keep their exact rows.

The engine's gates compare an FP8 engine with itself (speculative against plain decode), so they hold as in bf16:
FP8 changes the model, not whether a run of it is lossless.
"""

E4M3_MAX = 448.0


def quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether weight `name` is stored in FP8: a 2-D linear whose rows are output features (module docstring)."""
    linear = name.endswith(("_proj.weight", "per_layer_input_gate.weight", "per_layer_projection.weight",
                            "per_layer_model_projection.weight", "lm_head.weight"))
    return linear and len(shape) == 2
