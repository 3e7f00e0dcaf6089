"""skinny_gemm's split products: how a reduction is sliced and blocked (anywhere), and on Hopper the product, rows
independent of each other, and a chain of them under programmatic dependent launch in a CUDA graph reading each
replay's new inputs (a kernel reading its x before the kernel that writes x finished would read the last replay's)."""

import pytest
import torch

from specdec.models import skinny_gemm
from specdec.models.gemma_torch import linear

hopper = pytest.mark.skipif(not skinny_gemm.available(), reason="needs Triton and Hopper")

SHAPES = {  # columns, reduction, splits: the engine's for the 270M's four layer products and E4B's per-layer input
    # gate and projection; more splits (fewer steps) and fewer (E4B's down: five steps a slice) than it takes
    "270m qkv": (1536, 640, 4), "270m o_proj": (640, 1024, 4), "270m gate/up": (4096, 640, 4),
    "270m down": (640, 2048, 8), "e4b gate": (256, 2560, 16), "e4b proj": (2560, 256, 1), "e4b down": (2560, 10240, 4),
    "270m down, one slice a program": (640, 2048, 32),
}


@pytest.mark.parametrize("name", SHAPES)
def test_slices_and_blocks(name):
    """Slices of at most SLICE (where the reduction divides so, up to MAX_SPLITS), in one step up to twice that;
    column blocks that give every one of 132 SMs a program unless they are the narrowest; a weight tile within
    MAX_TILE; blocks of 32 rows past 16."""
    columns, reduction, _ = SHAPES[name]
    splits = skinny_gemm.splits(reduction)
    part = reduction // splits
    assert reduction % splits == 0 and part % 16 == 0
    assert part <= skinny_gemm.SLICE or splits == skinny_gemm.MAX_SPLITS  # E4B's down: 16 slices of 640
    config = skinny_gemm.plan(16, columns, splits, part, processors=132)
    assert config["STEPS"] * config["BLOCK_K"] >= part and config["BLOCK_M"] == 16
    assert config["STEPS"] == 1 or config["BLOCK_K"] == 2 * skinny_gemm.SLICE
    assert config["BLOCK_N"] == 16 or -(-columns // config["BLOCK_N"]) * splits >= 132
    assert config["BLOCK_N"] * config["BLOCK_K"] <= skinny_gemm.MAX_TILE
    assert skinny_gemm.plan(17, columns, splits, part, processors=132)["BLOCK_M"] == 32


def test_a_servers_wider_forwards_take_blocks_of_rows():
    """Static forwards of up to WIDE_MAX_ROWS rows take the kernel for bf16 weights, in blocks of at most ROW_BLOCK
    rows; FP8 weights (sliced by the rows) and more rows keep their paths."""
    weight = torch.empty(640, 2048, dtype=torch.bfloat16)
    available = skinny_gemm.available()
    assert skinny_gemm.takes(weight, 32) == skinny_gemm.takes(weight, 64) == available
    assert not skinny_gemm.takes(weight, skinny_gemm.WIDE_MAX_ROWS + 1)
    assert not skinny_gemm.takes(weight.to(torch.float8_e4m3fn), 64)
    assert skinny_gemm.takes(weight.to(torch.float8_e4m3fn), 32) == available
    for rows, block in [(8, 16), (17, 32), (48, 64), (64, 64), (128, 64)]:
        assert skinny_gemm.plan(rows, 640, 8, 256, processors=132)["BLOCK_M"] == min(block, skinny_gemm.ROW_BLOCK)
    assert {key: value for key, value in skinny_gemm.plan(64, 640, 8, 256, 132).items() if key != "BLOCK_M"} == {
        key: value for key, value in skinny_gemm.plan(8, 640, 8, 256, 132).items() if key != "BLOCK_M"}


def bf16(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
def test_each_slice_is_its_product(name, rows):
    columns, reduction, splits = SHAPES[name]
    x, weight = bf16(rows, reduction, seed=0), bf16(columns, reduction, seed=1)
    products = torch.ops.specdec.split_products(x, weight, splits)
    assert products.shape == (splits, rows, columns) and products.dtype == torch.float32
    part = reduction // splits
    for s in range(splits):  # bf16 inputs are exact in float64; float32 accumulation is the only rounding
        exact = x[:, s * part:(s + 1) * part].double() @ weight[:, s * part:(s + 1) * part].double().T
        assert float((products[s].double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", ["270m gate/up", "270m down", "e4b proj"])
@pytest.mark.parametrize("rows, to", [(16, 11), (8, 3), (32, 30), (64, 40), (128, 100)])
def test_a_rows_products_do_not_depend_on_the_other_rows_or_their_number(name, rows, to):
    """Row 3 of a 16-row product keeps its bits moved to row `to` of a product of other rows and of 8 to 128 rows
    (blocks of 16 to 64 rows, the row in the first block or a later one)."""
    columns, reduction, splits = SHAPES[name]
    x, weight = bf16(16, reduction, seed=2), bf16(columns, reduction, seed=3)
    reference = torch.ops.specdec.split_products(x, weight, splits)
    moved = bf16(rows, reduction, seed=4)
    moved[to] = x[3]
    assert torch.equal(torch.ops.specdec.split_products(moved, weight, splits)[:, to], reference[:, 3])


@pytest.mark.gpu
@hopper
def test_weight_views_of_a_packed_matrix():
    """Packed's linears are row slices of one matrix, and a part's weight is one of a stack's matrices."""
    packed = bf16(2, 2048, 640, seed=5)
    x = bf16(16, 640, seed=6)
    view = packed[1, 512:1536]
    assert torch.equal(torch.ops.specdec.split_products(x, view, 2),
                       torch.ops.specdec.split_products(x, view.contiguous(), 2))


@pytest.mark.gpu
@hopper
def test_compiled_linear_uses_the_kernel_and_a_graph_replay_reads_new_inputs():
    """A compiled stack of norm -> product -> GELU -> product blocks (inductor's kernels with PDL between the
    products), captured in a CUDA graph: each replay on new inputs gives the compiled function's own bits."""
    from torch._inductor.utils import run_and_get_code

    from specdec.engines.verifier_torch import _configure_compile, capture_graph

    _configure_compile()
    blocks = [(bf16(4096, 640, seed=10 + i) * 0.05, bf16(640, 2048, seed=20 + i) * 0.03) for i in range(4)]

    def stack(h, blocks):
        for up, down in blocks:
            normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(h)
            gate = linear(normed, up)
            h = h + linear(torch.nn.functional.gelu(gate[..., :2048], approximate="tanh") * gate[..., 2048:], down)
        return h

    compiled = torch.compile(stack, fullgraph=True)
    first = bf16(1, 16, 640, seed=30)
    _, code = run_and_get_code(compiled, first, blocks)
    assert "specdec.split_products" in "".join(code) and "extern_kernels.bmm" not in "".join(code)
    static = first.clone()
    graph, out = capture_graph(lambda: compiled(static, blocks))
    for seed in range(31, 36):
        h = bf16(1, 16, 640, seed=seed)
        static.copy_(h)
        graph.replay()
        assert torch.equal(out, compiled(h, blocks))
    exact = stack(h.float(), [(up.float(), down.float()) for up, down in blocks])  # float32, eagerly, cuBLAS
    assert float((out.float() - exact).abs().max()) <= 0.05 * float(exact.abs().max())
