"""The split products of a decode forward's few rows as a Triton kernel that loads its weights before it waits.

Under programmatic dependent launch (PDL, Hopper on; verifier_torch turns it on for inductor's kernels), a kernel
is launched while the one before it still runs and waits in-kernel (`griddepcontrol.wait`) before it reads that
kernel's output. A weight is no kernel's output: this kernel loads its tile of the weight first, then waits, then
reads the rows of x, so the weight streams in while the previous kernel (a norm, RoPE, the GELU) finishes. The 270M's
layer products move 1-5 MB each and took 3.3 us as cuBLAS's batched GEMM, mostly latency (docs/journal, issue
11). cuBLAS's kernels are not launched that way.

Each program computes one block of output columns of one slice of the reduction, in float32, over the whole slice:
what a row's value is depends on the slice, the block size and the row alone, never on the other rows, so rows stay
bitwise invariant as gemma_torch.split_products' do. The slices' sums stay to the kernel that reads them
(gemma_torch.sum_products), which inductor fuses.
"""

from __future__ import annotations

import functools

import torch

from specdec.models.decode_plan import SPLIT_MAX_ROWS

MAX_WEIGHT_BYTES = 8 * 2**20  # larger weights stream as fast or faster through cuBLAS (docs/journal)
SLICE = 256  # reduction elements per slice: one load of the weight tile, one product
MAX_SPLITS = 16  # slices at most (the kernels that read the products add them)
MAX_TILE = 128 * 128  # weight elements a program holds
# Rows a program at most; more rows (a server's decode forward) take a block of them each. A row's bits depend on
# the column block and the slice's steps alone: the same in blocks of 16, 32 or 64 rows, at 8 to 128 rows, for the
# 270M's and E4B's products (H200). At 64 rows, blocks of 64 ran the 270M's four products in 20.9 us, blocks of 32
# in 22.6, cuBLAS in 26.1 (docs/journal).
ROW_BLOCK = 64
# A static forward of up to this many rows (a server's 8 rows of 8 tokens) takes the kernel for bf16 weights too:
# a row then keeps its bits whatever the number of rows, so a server may run its cycles over the rows in use
# (cycle_torch.FusedCycle's widths). Not 128 (a 16-row server): reading each weight once per block of 64 rows made
# that server's full cycle 6.4% longer than cuBLAS's (H200, docs/journal), so it keeps cycles over every row.
WIDE_MAX_ROWS = 64
# FP8 weights, of any size (fp8_splits, plan): 32 columns a program, stepping through its slice 128 deep in a loop
# pipelined 4 deep. Swept by scripts/tune_fp8_products.py on an H200 over 20 products of the 270M, E4B and the 31B:
# the fastest block for 18 of them (docs/journal).
FP8_BLOCK_N, FP8_BLOCK_K, FP8_STAGES = 32, 128, 4
FP8_PROGRAMS = 1024  # programs an FP8 product aims for: about 8 a SM on an H100's or H200's 132
FP8_MIN_PART = 128


@torch.compiler.assume_constant_result  # a constant in the traced forward
def available() -> bool:
    """Triton with the PDL intrinsics, and an NVIDIA GPU that has PDL (Hopper or later)."""
    if not torch.cuda.is_available() or torch.version.hip or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def to_bf16(weight, dtype):
        """A weight tile in the activations' dtype. FP8 e4m3 to bf16 by placing bits, 4 values a register: each
        byte's sign to bit 15 and its exponent and mantissa 4 bits down make a bf16 of the value times 2^-120
        (e4m3's subnormals become bf16's), which one bf16x2 multiply by 2^120 makes the value, exactly. Triton's
        convert (to f16, then f32, then bf16) took 9-14% longer on the 31B's layer products
        (docs/journal)."""
        if weight.dtype == tl.float8e4nv and dtype == tl.bfloat16:  # constants: one branch is compiled
            result = tl.inline_asm_elementwise(
                """
                {
                .reg .b32 zero, lo, hi, sign, scale, minus_zero;
                mov.b32 zero, 0;
                mov.b32 scale, 0x7B807B80;
                mov.b32 minus_zero, 0x80008000;
                prmt.b32 lo, $2, zero, 0x1404;
                prmt.b32 hi, $2, zero, 0x3424;
                and.b32 sign, lo, 0x80008000;
                and.b32 lo, lo, 0x7F007F00;
                shr.b32 lo, lo, 4;
                or.b32 lo, lo, sign;
                and.b32 sign, hi, 0x80008000;
                and.b32 hi, hi, 0x7F007F00;
                shr.b32 hi, hi, 4;
                or.b32 hi, hi, sign;
                fma.rn.bf16x2 $0, lo, scale, minus_zero;
                fma.rn.bf16x2 $1, hi, scale, minus_zero;
                }
                """,
                "=r,=r,r", [weight.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            result = weight.to(dtype)
        return result

    @triton.jit
    def add_step(acc, x_tile, w_tile, step, k, m_in, n_in, part, stride_wk, BLOCK_K: tl.constexpr):
        offset = step * BLOCK_K
        k_in = (offset + k)[None, :] < part
        weight = tl.load(w_tile + offset * stride_wk, mask=n_in & k_in, other=0.0)
        rows = tl.load(x_tile + offset, mask=m_in & k_in, other=0.0)
        return acc + tl.dot(rows, tl.trans(to_bf16(weight, rows.dtype)))

    @triton.jit
    def split_products_kernel(x, w, scale, out, rows, columns, part, stride_xm, stride_wn, stride_wk,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              STEPS: tl.constexpr, STAGES: tl.constexpr):
        block, split, row_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        start = split * part
        w_tile = w + n[:, None] * stride_wn + (start + k)[None, :] * stride_wk
        x_tile = x + m[:, None] * stride_xm + (start + k)[None, :]
        m_in, n_in = m[:, None] < rows, n[:, None] < columns
        weight = tl.load(w_tile, mask=n_in & (k[None, :] < part), other=0.0)
        if scale is not None:
            scales = tl.load(scale + n, mask=n < columns, other=1.0)
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output; the weight is nobody's
        first = tl.load(x_tile, mask=m_in & (k[None, :] < part), other=0.0)
        acc = tl.dot(first, tl.trans(to_bf16(weight, first.dtype)))
        if STAGES == 0:  # a few steps, unrolled: their loads all issue at once
            for step in tl.static_range(1, STEPS):
                acc = add_step(acc, x_tile, w_tile, step, k, m_in, n_in, part, stride_wk, BLOCK_K)
        else:  # many steps (large weights), software-pipelined STAGES deep
            for step in tl.range(1, STEPS, num_stages=STAGES):
                acc = add_step(acc, x_tile, w_tile, step, k, m_in, n_in, part, stride_wk, BLOCK_K)
        tl.extra.cuda.gdc_launch_dependents()
        if scale is not None:  # an FP8 weight: each column times its row's scale (specdec.models.fp8)
            acc = acc * scales[None, :]
        tl.store(out + split * rows * columns + m[:, None] * columns + n[None, :], acc,
                 mask=(m[:, None] < rows) & (n[None, :] < columns))

    return split_products_kernel


def takes(weight: torch.Tensor, rows) -> bool:
    """Whether a product of `rows` rows with `weight` runs here. Up to SPLIT_MAX_ROWS rows: bf16 or fp16 weights up
    to MAX_WEIGHT_BYTES, FP8 weights of any size (cuBLAS has no product of them with bf16 rows). Up to WIDE_MAX_ROWS
    rows known when compiled (a decode forward's), those bf16 or fp16 weights: a prefill's rows are symbolic, and a
    bound on them would split its dynamic program in two. (FP8 slices by the rows: fp8_splits.)"""
    fp8 = weight.dtype == torch.float8_e4m3fn
    small = weight.dtype in (torch.bfloat16, torch.float16) and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES
    wide = small and isinstance(rows, int) and rows <= WIDE_MAX_ROWS
    return (((fp8 or small) and rows <= SPLIT_MAX_ROWS) or wide) and available()


def splits(reduction: int) -> int:
    """Slices of the reduction: halved until a slice is at most SLICE long, keeping slices a multiple of 16, and at
    most MAX_SPLITS of them."""
    count = 1
    while reduction // count > SLICE and reduction % (32 * count) == 0 and count < MAX_SPLITS:
        count *= 2
    return count


def fp8_splits(rows: int, columns: int, reduction: int) -> int:
    """Slices of an FP8 product's reduction: doubled while the product has fewer than FP8_PROGRAMS programs, a slice
    stays at least FP8_MIN_PART deep (a multiple of 16), and the float32 partial products (written, then read by
    the kernel that adds them) stay within 1 MB or an eighth of the weight's bytes."""
    count = 1
    while (-(-columns // FP8_BLOCK_N) * count < FP8_PROGRAMS and count < MAX_SPLITS
           and reduction % (32 * count) == 0 and reduction // (2 * count) >= FP8_MIN_PART
           and 4 * 2 * count * rows * columns <= max(1e6, columns * reduction / 8)):
        count *= 2
    return count


def plan(rows: int, columns: int, splits: int, part: int, processors: int, itemsize: int = 2) -> dict:
    """Block sizes for `rows` rows, a weight of `columns`, `splits` slices of the reduction of `part` each, on a GPU
    of `processors` SMs: up to ROW_BLOCK rows a program (the rows alone never change the other blocks), the whole
    slice in one step where it fits, and the widest column block that still gives every SM a program (the weight then
    streams through all of them). Blocks of at least 16, as tensor-core products need. Swept by
    scripts/tune_skinny_gemm.py on an H100: within 0.7 us of the best
    configuration for the products it takes, and 0.8-2.0 us faster than the batched GEMM (docs/journal).
    FP8 weights (`itemsize` 1) take FP8_BLOCK_N and FP8_BLOCK_K, pipelined where the slice takes several steps."""
    block_m = min(max(16, 1 << (rows - 1).bit_length()), ROW_BLOCK)
    if itemsize == 1:
        block_k = min(FP8_BLOCK_K, max(16, 1 << (part - 1).bit_length()))
        steps = -(-part // block_k)
        return {"BLOCK_M": block_m, "BLOCK_N": FP8_BLOCK_N, "BLOCK_K": block_k, "STEPS": steps,
                "STAGES": FP8_STAGES if steps > 1 else 0, "num_warps": 4}
    block_k = min(2 * SLICE, max(16, 1 << (part - 1).bit_length()))
    block_n = 16
    while (block_n < 128 and 2 * block_n * block_k <= MAX_TILE
           and -(-columns // (2 * block_n)) * splits >= processors):
        block_n *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "STEPS": -(-part // block_k), "STAGES": 0,
            "num_warps": 4 if block_n * block_k <= 16 * 512 else 8}


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(x: torch.Tensor, weight: torch.Tensor, splits: int, config: dict, out: torch.Tensor,
           scale: torch.Tensor | None = None) -> None:
    """The kernel over x [rows, reduction] and weight [columns, reduction] (bf16, fp16, or FP8 values with their
    float32 `scale` [columns]) into out [splits, rows, columns], with `config` as plan() gives it, launched under
    PDL."""
    import triton

    rows, reduction = x.shape
    columns = weight.shape[0]
    grid = (triton.cdiv(columns, config["BLOCK_N"]), splits, triton.cdiv(rows, config["BLOCK_M"]))
    _kernel()[grid](x, weight, scale, out, rows, columns, reduction // splits, x.stride(0), weight.stride(0),
                    weight.stride(1), **config, launch_pdl=True)


@torch.library.custom_op("specdec::split_products", mutates_args=())
def split_products(x: torch.Tensor, weight: torch.Tensor, splits: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, reduction] and weight [columns, reduction] (rows of x contiguous): the products of `splits` equal
    slices of the reduction, float32 [splits, rows, columns], not yet summed. An FP8 weight's slices' products are
    each times its rows' `scale` (specdec.models.fp8)."""
    rows, reduction = x.shape
    columns = weight.shape[0]
    out = torch.empty(splits, rows, columns, device=x.device, dtype=torch.float32)
    config = plan(rows, columns, splits, reduction // splits, _processors(x.device), weight.element_size())
    launch(x, weight, splits, config, out, scale)
    return out


@split_products.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, splits: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(splits, x.shape[0], weight.shape[0], dtype=torch.float32)
