"""The Pallas kernels lower to Triton for CUDA on any machine, the CPU too (jax.export for the "cuda" platform runs
Pallas's Triton lowering without a GPU). A primitive Pallas's Triton lowering lacks (a slice of a value, say) fails
here, in CI, not on the device; what Triton's own compiler does with the kernel after that runs on a GPU alone."""

import functools

import jax
import jax.numpy as jnp
import pytest

from specdec.models import decode_attention_jax, decode_mlp_jax
from tests.models import test_decode_attention_jax as attention
from tests.models import test_decode_mlp_jax as mlp
from tests.models import test_decode_norms_jax as norms

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call that carries a Triton kernel


def lowered_for_cuda(fn, *args) -> str:
    """fn(*args) lowered for CUDA, as MLIR text with its Triton kernels inside (a lowering error raises)."""
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exported.mlir_module()


def weights_to_prefetch():
    return (jnp.ones((4, decode_attention_jax.PREFETCH_BLOCK), jnp.bfloat16),)


def attention_case(name):
    args = attention.case(attention.SHAPES[name], seed=1, dtype=jnp.bfloat16)
    return lambda *a: decode_attention_jax.attend(*a, 0.0625, prefetch=weights_to_prefetch()), args


def inputs_case(name):
    shape = attention.INPUT_SHAPES[name]
    return attention.inputs_kernel(shape, jnp.bfloat16), attention.inputs_case(shape, seed=1, dtype=jnp.bfloat16)


def norms_case(name):
    args = norms.case(norms.SHAPES[name], seed=1, dtype=jnp.bfloat16)
    return norms.residual_norms_kernel(args, prefetch=weights_to_prefetch()), args


def gated_case(name):
    return decode_mlp_jax.gated, mlp.case(mlp.SHAPES[name], seed=1, dtype=jnp.bfloat16)


def per_layer_gate_case(name):
    x, weight, per_layer = mlp.per_layer_case(mlp.PER_LAYER_SHAPES[name], seed=1, dtype=jnp.bfloat16)
    return lambda *a: decode_mlp_jax.per_layer_gated(*a, per_layer.shape[2] - 1), (x, weight, per_layer)


CASES = {  # kernel and shape -> (the function and its arguments, its Triton kernels, whether it triggers on Hopper)
    "attention: 270m sliding": (functools.partial(attention_case, "270m sliding"), 2, False),
    "attention: 31b ring": (functools.partial(attention_case, "31b ring: whole heads"), 2, False),
    "inputs: e4b sliding": (functools.partial(inputs_case, "e4b sliding"), 1, False),
    "inputs: kv-shared": (functools.partial(inputs_case, "kv-shared: q alone"), 1, False),
    "residual norms: 270m": (functools.partial(norms_case, "270m"), 1, True),
    "residual norms: 31b, batch 2": (functools.partial(norms_case, "31b, batch 2: three runs"), 1, True),
    "gate/up and GELU: e4b": (functools.partial(gated_case, "e4b"), 1, False),
    "gate/up and GELU: 12 rows": (functools.partial(gated_case, "12 rows: 4 masked"), 1, False),
    "per-layer gate: e4b": (functools.partial(per_layer_gate_case, "e4b"), 1, False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("hopper", [False, True])
def test_the_kernel_lowers_to_triton_for_cuda(name, hopper, monkeypatch):
    """As many Triton kernels as the function launches; on Hopper GPUs the residual-add kernel triggers its
    dependents' launch with inline PTX (griddepcontrol), lowered both ways."""
    monkeypatch.setattr(decode_attention_jax, "triggers_dependents", lambda: hopper)
    make, kernels, triggers = CASES[name]
    fn, args = make()
    module = lowered_for_cuda(fn, *args)
    assert module.count(f"@{TRITON_CALL}(") == kernels
    assert ("griddepcontrol" in module) == (hopper and triggers)
