"""FP8 weights in the torch engine (the spec: specdec.models.fp8). A quantized nn.Linear holds its FP8 values as its
`weight` and a float32 `weight_scale` buffer, one per output row (GemmaModel.quantize_fp8). A decode forward's
products of few rows run in skinny_gemm's kernel, which converts the values as it loads them and scales its
float32 products (cuBLAS takes no FP8 weight beside bf16 activations); the rest (prefill, eager forwards, the CPU)
run `product` here."""

from __future__ import annotations

import torch

from specdec.models.fp8 import E4M3_MAX


def quantize(weight: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (float8_e4m3fn values [N, K], float32 scales [N]): fp8_jax.quantize's
    arithmetic, so both engines hold the same bits. `group`: the tensor-parallel group over which `weight` is this
    device's slice of the reduction (a row-parallel linear's columns): each row's peak is then the whole row's, so
    every device count quantizes to the same bits."""
    w = weight.float()
    peak = w.abs().amax(dim=1)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(peak, dist.ReduceOp.MAX, group)
    scale = torch.where(peak > 0, peak * (1 / E4M3_MAX), torch.ones_like(peak))  # as fp8_jax's
    # e4m3fn has no infinity: a quotient rounded past 448 would convert to NaN, so it is clipped first
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def product(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] by FP8 `values` [N, K] in float32, each column times its row's `scale`, rounded once to x's dtype.
    The values convert exactly to x's dtype: on CUDA one GEMM of those with a float32 output; elsewhere in float32."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda and x.dtype != torch.float32:
        acc = torch.mm(flat, values.to(x.dtype).T, out_dtype=torch.float32)
    else:
        acc = flat.float() @ values.float().T
    return (acc * scale).to(x.dtype).view(*x.shape[:-1], values.shape[0])


def dequantized(values: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The weight FP8 values and scales stand for, [N, K] in `dtype` (for tests and references)."""
    return (values.float() * scale[:, None]).to(dtype)
