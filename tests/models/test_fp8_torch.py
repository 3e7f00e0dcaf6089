"""FP8 weights in the torch engine (specdec.models.fp8_torch): the JAX engine's quantized bits, what the model stores,
the model its values and scales stand for, the error of what it does not take; on Hopper, skinny_gemm's FP8 products
against float64 and the compiled engine's rows bitwise invariant, so greedy speculative output is the plain decode's."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specdec.models import fp8, fp8_jax, fp8_torch, skinny_gemm
from specdec.models.checkpoint import load_checkpoint
from specdec.models.gemma_torch import GemmaModel
from tests.models.test_skinny_gemm import bf16

hopper = pytest.mark.skipif(not skinny_gemm.available(), reason="needs Triton and Hopper")


def test_quantize_holds_the_jax_engines_bits():
    """One spec, two engines: the same values and scales, bit for bit, rows of zeros and of wide range included."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=generator) * torch.logspace(-4, 2, 96)[:, None]
    w[7] = 0.0
    values, scale = fp8_torch.quantize(w)
    reference = fp8_jax.quantize(jnp.asarray(w.numpy()))
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert np.array_equal(values.view(torch.uint8).numpy(), np.asarray(reference.values).view(np.uint8))
    assert np.array_equal(scale.numpy(), np.asarray(reference.scale))


def test_the_product_is_the_dequantized_weights():
    generator = torch.Generator().manual_seed(1)
    values, scale = fp8_torch.quantize(torch.randn(40, 24, generator=generator))
    x = torch.randn(2, 3, 24, generator=generator)
    out = fp8_torch.product(x, values, scale)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ fp8_torch.dequantized(values, scale).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e", "gemma4_moe"])
def test_what_the_model_stores_in_fp8(random_checkpoints, variant):
    model = GemmaModel.from_checkpoint(random_checkpoints[variant], fp8=True, max_seq_len=64)
    assert model.fp8 and model.lm_head.weight.dtype == torch.float8_e4m3fn  # a tied head's own copy
    assert model.embed_tokens.weight.dtype == torch.float32  # a lookup reads exact rows
    attention = model.layers[0].self_attn
    assert attention.packed.dtype == torch.float8_e4m3fn and attention.packed_scale.dtype == torch.float32
    assert attention.q_proj.weight.data_ptr() == attention.packed.data_ptr()  # a view of the packed matrix
    assert attention.o_proj.weight.dtype == torch.float8_e4m3fn
    if variant == "gemma4_moe":
        assert model.layers[0].experts.gate_up_proj.dtype == torch.float32
        assert model.layers[0].router.proj.weight.dtype == torch.float32
    quantized = {name for name, module in model.named_modules() if hasattr(module, "weight_scale")}
    assert all(fp8.quantizes(f"{name}.weight", (1, 1)) for name in quantized)


@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e", "gemma4_moe"])
def test_an_fp8_model_computes_the_model_its_weights_stand_for(random_checkpoints, variant):
    """A prefill and a decode forward over FP8 linears give the logits of the same forwards over their dequantized
    float32 weights (a tied head's FP8 copy read as an untied head)."""
    path = random_checkpoints[variant]
    model = GemmaModel.from_checkpoint(path, fp8=True, max_seq_len=64)
    cfg, tensors = load_checkpoint(path, framework="pt", dtype=torch.float32)
    for name, weight in list(tensors.items()):
        if fp8.quantizes(name, weight.shape):
            tensors[name] = fp8_torch.dequantized(*fp8_torch.quantize(weight))
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = fp8_torch.dequantized(*fp8_torch.quantize(tensors["embed_tokens.weight"]))
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    with torch.device("meta"):
        reference = GemmaModel(cfg, 64)
    reference.load_state_dict(tensors, strict=True, assign=True)
    reference._build_rope_tables()
    reference = reference.eval().pack_projections()
    tokens = torch.tensor([[2, 17, 40, 9, 33, 5, 1, 60]])
    with torch.inference_mode():
        for commit_first in (False, True):
            logits = [m(tokens, torch.arange(8)[None], m.allocate_cache(1, k_max=8), commit_first=commit_first)[0]
                      for m in (model, reference)]
            torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_fp8_weights_in_two_parts_on_one_device_decode_as_unsplit(random_checkpoints):
    """float32 on the CPU: FP8 weights in two tensor-parallel parts (the parts' scales packed as their rows, the
    row-parallel linears' whole rows' scales for each part) decode the unsplit FP8 model's tokens (two devices:
    test_torch_tensor_parallel)."""
    from specdec.engines.verifier_torch import TorchEngine

    path = random_checkpoints["gemma4_e"]
    whole = GemmaModel.from_checkpoint(path, fp8=True, max_seq_len=64)
    parts = GemmaModel.from_checkpoint(path, fp8=True, tp_parts=2, max_seq_len=64)
    assert parts.fp8 and parts.layers[0].mlp.packed_scale.shape[0] == 2
    tokens = TorchEngine(whole, max_seq_len=64, k_max=4).greedy_decode([2, 5, 6, 7], 12)
    assert len(set(tokens)) > 3 and TorchEngine(parts, max_seq_len=64, k_max=4).greedy_decode([2, 5, 6, 7], 12) == tokens


SHAPES = {  # columns, reduction: one step a slice, unrolled steps, a pipelined loop (E4B's down, a 31B-like head)
    "270m o_proj": (640, 1024), "270m gate/up": (4096, 640), "e4b per-layer proj": (2560, 256),
    "e4b down": (2560, 10240), "head": (8192, 5376),
}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_each_fp8_slice_is_its_scaled_product(name, rows):
    columns, reduction = SHAPES[name]
    x = bf16(rows, reduction, seed=0)
    values, scale = fp8_torch.quantize(bf16(columns, reduction, seed=1))
    splits = skinny_gemm.fp8_splits(rows, columns, reduction)
    products = torch.ops.specdec.split_products(x, values, splits, scale)
    assert products.shape == (splits, rows, columns) and products.dtype == torch.float32
    part = reduction // splits
    for s in range(splits):  # bf16 x FP8 products are exact in float64; float32 accumulation and the scale round
        cut = slice(s * part, (s + 1) * part)
        exact = (x[:, cut].double() @ values[:, cut].double().T) * scale.double()
        assert float((products[s].double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())


@pytest.mark.gpu
@hopper
def test_the_kernel_reads_every_fp8_value_exactly():
    """The kernel places an FP8 byte's bits into a bf16 itself: each of e4m3's 254 numbers (subnormals, zeros and
    both signs included), taken by one-hot rows at unit scales, comes out as itself. A slice within 1e-5 would
    not tell a wrong subnormal."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)  # not the NaNs
    weight = torch.zeros(len(codes), 256, dtype=torch.uint8)
    weight[:, 5] = codes
    weight = weight.view(torch.float8_e4m3fn).cuda()
    x = torch.zeros(8, 256, dtype=torch.bfloat16, device="cuda")
    x[2, 5] = 1
    products = torch.ops.specdec.split_products(x, weight, 1, torch.ones(len(codes), device="cuda"))
    assert torch.equal(products[0, 2], weight[:, 5].float())
    assert not products[0, [0, 1, 3]].any()


@pytest.mark.gpu
@hopper
def test_a_rows_fp8_products_do_not_depend_on_the_other_rows():
    columns, reduction = SHAPES["e4b down"]
    values, scale = fp8_torch.quantize(bf16(columns, reduction, seed=3))
    x = bf16(16, reduction, seed=2)
    splits = skinny_gemm.fp8_splits(16, columns, reduction)
    reference = torch.ops.specdec.split_products(x, values, splits, scale)
    moved = bf16(16, reduction, seed=4)
    moved[11] = x[3]
    assert torch.equal(torch.ops.specdec.split_products(moved, values, splits, scale)[:, 11], reference[:, 3])


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e", "gemma4_moe"])
def test_on_a_gpu_fp8_rows_are_bitwise_invariant(random_checkpoints, variant):
    """bf16 activations over FP8 linears through torch.compile (skinny_gemm's FP8 kernel) and CUDA graph replays: a
    token's logits, taps and committed keys/values are the same at any row of any verify width as in plain decode."""
    from tests.engines.test_row_invariance import WIDTHS, assert_same, feed, torch_engine

    engine = torch_engine(random_checkpoints[variant], "bfloat16", device="cuda", fp8=True)
    assert engine.use_graphs and engine.model.fp8
    plain = feed(engine, 1)
    for width in WIDTHS:
        assert_same(plain, feed(engine, width, 2), f"cuda fp8/{variant} T={width}")


PRODUCTS = {  # columns, reduction: every product of the 270M, E4B and the 31B that tune_fp8_products.py swept
    "270m qkv": (1536, 640), "270m o_proj": (640, 1024), "270m gate/up": (4096, 640), "270m down": (640, 2048),
    "270m lm_head": (262144, 640), "e4b qkv": (3072, 2560), "e4b o_proj": (2560, 2048), "e4b gate": (256, 2560),
    "e4b proj": (2560, 256), "e4b gate/up": (20480, 2560), "e4b down": (2560, 10240), "31b qkv": (16384, 5376),
    "31b o_proj": (5376, 16384), "31b down": (5376, 21504), "31b gate/up": (43008, 5376), "31b lm_head": (262144, 5376),
}


@pytest.mark.parametrize("name", PRODUCTS)
@pytest.mark.parametrize("rows", [8, 16])
def test_fp8_slices_and_blocks(name, rows):
    """Slices a multiple of 16 and at least FP8_MIN_PART deep, doubled only while the product had fewer than
    FP8_PROGRAMS programs, their float32 partials within 1 MB or an eighth of the weight; steps that cover a slice,
    pipelined where there are several."""
    columns, reduction = PRODUCTS[name]
    splits = skinny_gemm.fp8_splits(rows, columns, reduction)
    part = reduction // splits
    assert reduction % splits == 0 and part % 16 == 0 and splits <= skinny_gemm.MAX_SPLITS
    assert splits == 1 or part >= skinny_gemm.FP8_MIN_PART
    assert splits == 1 or -(-columns // skinny_gemm.FP8_BLOCK_N) * splits // 2 < skinny_gemm.FP8_PROGRAMS
    assert splits == 1 or 4 * splits * rows * columns <= max(1e6, columns * reduction / 8)
    config = skinny_gemm.plan(rows, columns, splits, part, processors=132, itemsize=1)
    assert config["BLOCK_N"] == skinny_gemm.FP8_BLOCK_N and config["STEPS"] * config["BLOCK_K"] >= part
    assert (config["STAGES"] > 0) == (config["STEPS"] > 1)
