"""Triton kernels for a decode forward's few rows: a layer's GEMM with the residual add and RMSNorms that feed it
as its prologue, and Gemma's gated GELU as the gate/up GEMM's epilogue. Opt-in (GemmaModel.fuses): not yet faster.

Compiled, a 270M decode layer ran 12 kernels on an H100, each of 1-4 us, most of it launch and ramp: the norms
that join a sublayer's output to the residual stream and normalise it for the next GEMM were kernels of their
own, as was the GELU between gate/up and down (docs/benchmarks.md, issue 11). Here the GEMM reads the residual
stream as `base + delta_norm(delta)` (the previous sublayer's output not yet added), adds and normalises each
row block itself, and the program holding the first columns writes the added stream out for the next residual.
The stream's RMS is summed in the GEMM's loop and applied to the products (a row's scale is a factor of each of
its products); only the delta's RMS needs a pass of its own first. A first version that normalised before its
GEMM loop, in two dependent passes, took 12.6 us where the norm and cuBLAS GEMM it replaced took 5-6;
scripts/bench_fused_norm_linear.py times this one against that pair.

Row invariance: a program computes 16 rows at a time with the same blocks and the same loop over the reduction
whatever the other rows hold and however many there are, so each row's output is bitwise the same in a forward
of any width (torch_gemma's decode forwards). The block sizes depend on the weight's shape alone.
"""

from __future__ import annotations

import torch

BLOCK_M = 16  # rows per program: the smallest tile of tl.dot


try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # the CPU build of torch comes without Triton; the forward then runs unfused
    triton = None


def available() -> bool:
    return triton is not None


def block_sizes(columns: int, reduction: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a weight of `columns` outputs (per accumulator) over `reduction` inputs: blocks of
    columns small enough to give ~128 programs, one wave of an H100's or H200's 132 SMs, at 16 to 128 columns."""
    block_n = 16
    while block_n < 128 and columns // (2 * block_n) >= 128:
        block_n *= 2
    block_k = 128 if reduction % 128 == 0 else 64
    return block_n, block_k


if available():

    @triton.jit
    def _rms_scale(sum_sq, width, eps, GEMMA4: tl.constexpr):
        mean_sq = sum_sq / width + eps
        if GEMMA4:  # as rms_norm: Gemma 4 by pow(-0.5), Gemma 3 by rsqrt
            return 1.0 / tl.sqrt(mean_sq)
        return tl.math.rsqrt(mean_sq)

    @triton.jit
    def _stream_block(base_ptr, delta_ptr, delta_w_ptr, rows, cols, row_ok, k_ok, stride_base, stride_delta,
                     delta_scale, offset, HAS_DELTA: tl.constexpr):
        """The residual stream's block [BLOCK_M, BLOCK_K]: base + delta_norm(delta), computed in float32 and each
        rounded to the stream's dtype as the layer's own operations round them."""
        mask = row_ok[:, None] & k_ok[None, :]
        base = tl.load(base_ptr + rows[:, None] * stride_base + cols[None, :], mask=mask, other=0.0)
        if HAS_DELTA:
            delta = tl.load(delta_ptr + rows[:, None] * stride_delta + cols[None, :], mask=mask, other=0.0)
            w = tl.load(delta_w_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
            normed = (delta.to(tl.float32) * delta_scale[:, None] * (offset + w[None, :])).to(base.dtype)
            return (base.to(tl.float32) + normed.to(tl.float32)).to(base.dtype)
        return base

    @triton.jit
    def _norm_linear_kernel(
        base_ptr, delta_ptr, delta_w_ptr, norm_w_ptr, weight_ptr, out_ptr, stream_ptr,
        rows_total, hidden: tl.constexpr, columns: tl.constexpr,
        stride_base, stride_delta, stride_weight, stride_out, stride_stream,
        eps, offset,
        HAS_DELTA: tl.constexpr, GEMMA4: tl.constexpr, GELU: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < rows_total
        ks = tl.arange(0, BLOCK_K)

        # The delta's RMS first (the stream needs it), in a loop of independent loads. The stream's own RMS is
        # summed in the GEMM's loop: a row's scale is a factor of its products, applied after them.
        delta_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if HAS_DELTA:
            sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in tl.static_range(0, hidden, BLOCK_K):
                cols = k0 + ks
                mask = row_ok[:, None] & (cols[None, :] < hidden)
                d = tl.load(delta_ptr + rows[:, None] * stride_delta + cols[None, :], mask=mask, other=0.0)
                d = d.to(tl.float32)
                sum_sq += tl.sum(d * d, axis=1)
            delta_scale = _rms_scale(sum_sq, hidden, eps, GEMMA4)

        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < columns
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in tl.static_range(0, hidden, BLOCK_K):
            cols = k0 + ks
            k_ok = cols < hidden
            h = _stream_block(base_ptr, delta_ptr, delta_w_ptr, rows, cols, row_ok, k_ok, stride_base, stride_delta,
                             delta_scale, offset, HAS_DELTA)
            if pid_n == 0:
                tl.store(stream_ptr + rows[:, None] * stride_stream + cols[None, :], h,
                         mask=row_ok[:, None] & k_ok[None, :])
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, axis=1)
            w = tl.load(norm_w_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
            x = (hf * (offset + w[None, :])).to(h.dtype)
            w_mask = n_ok[:, None] & k_ok[None, :]
            block = tl.load(weight_ptr + ns[:, None] * stride_weight + cols[None, :], mask=w_mask, other=0.0)
            acc = tl.dot(x, tl.trans(block), acc)
            if GELU:  # the up projection's rows follow the gate's
                up = tl.load(weight_ptr + (ns + columns)[:, None] * stride_weight + cols[None, :], mask=w_mask,
                             other=0.0)
                acc_up = tl.dot(x, tl.trans(up), acc_up)
        scale = _rms_scale(sum_sq, hidden, eps, GEMMA4)[:, None]
        acc = acc * scale
        acc_up = acc_up * scale

        out_dtype = out_ptr.dtype.element_ty
        out = acc.to(out_dtype)
        if GELU:  # gelu_tanh(gate) * up, each rounded as gelu_gate's operations round it
            gate = out.to(tl.float32)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
            gelu = (0.5 * gate * (1.0 + tanh)).to(out_dtype)
            out = (gelu.to(tl.float32) * acc_up.to(out_dtype).to(tl.float32)).to(out_dtype)
        tl.store(out_ptr + rows[:, None] * stride_out + ns[None, :], out, mask=row_ok[:, None] & n_ok[None, :])

    @triton_op("specdec::norm_linear", mutates_args=())
    def _norm_linear_op(base: torch.Tensor, delta: torch.Tensor | None, delta_weight: torch.Tensor | None,
                       norm_weight: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma4: bool,
                       gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = base.shape[-1]
        rows = base.numel() // hidden
        base2 = base.reshape(rows, hidden).contiguous()
        delta2 = base2 if delta is None else delta.reshape(rows, hidden).contiguous()
        columns = weight.shape[0] // 2 if gelu else weight.shape[0]
        out = base.new_empty(rows, columns)
        stream = torch.empty_like(base2)
        block_n, block_k = block_sizes(columns, hidden)
        grid = (triton.cdiv(columns, block_n), triton.cdiv(rows, BLOCK_M))
        wrap_triton(_norm_linear_kernel)[grid](
            base2, delta2, norm_weight if delta_weight is None else delta_weight,  # (placeholders without a delta)
            norm_weight, weight, out, stream,
            rows, hidden, columns,
            base2.stride(0), delta2.stride(0), weight.stride(0), out.stride(0), stream.stride(0),
            eps, offset,
            HAS_DELTA=delta is not None, GEMMA4=gemma4, GELU=gelu,
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        )
        return out.view(*base.shape[:-1], columns), stream.view(base.shape)


def norm_linear(base: torch.Tensor, delta: torch.Tensor | None, delta_weight: torch.Tensor | None,
                norm_weight: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gemma4: bool,
                gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(stream, norm_weight) @ weight.T, stream) with stream = base + rms_norm(delta, delta_weight)
    (base alone where delta is None), for rows [..., hidden] of a bf16 or fp16 stream; with `gelu`, weight is
    gate/up packed [2 * I, hidden] and the output gelu_tanh(gate) * up, [..., I]."""
    return _norm_linear_op(base, delta, delta_weight, norm_weight, weight, eps, offset, gemma4, gelu)
