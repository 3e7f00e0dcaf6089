"""The fused norm + GEMM kernels of a decode forward (specdec.models.fused_kernels).

On CUDA the kernels run natively, in bf16 and fp16. Without CUDA, where Triton is installed, they run under Triton's
interpreter in a subprocess (TRITON_INTERPRET must be set before the kernels are defined), in fp16 and fp32: the
interpreter's bf16 products are wrong (a bf16 tl.dot came back ~1e10 off in Triton 3.6), its fp16 ones right.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from specdec.models import fused_kernels  # noqa: E402
from specdec.models.config import GemmaConfig  # noqa: E402
from specdec.models.torch_gemma import gelu_gate, rms_norm  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = ("bfloat16", "float16") if ON_CUDA else ("float16", "float32")
needs_kernels = pytest.mark.skipif(not (ON_CUDA or INTERPRETED), reason="needs CUDA or Triton's interpreter")


def norm_config(gemma4: bool) -> GemmaConfig:
    """A config of either family; rms_norm reads its family and epsilon."""
    return GemmaConfig(model_type="gemma4_text" if gemma4 else "gemma3_text", vocab_size=8, hidden_size=8,
                       intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                       layer_types=("full_attention",), sliding_window=8, rope={})


def reference(base, delta, delta_weight, norm_weight, weight, cfg, gated):
    """The layer's own operations (torch_gemma): stream = base + norm(delta); linear(norm(stream))."""
    stream = base if delta is None else base + rms_norm(delta, delta_weight, cfg)
    out = torch.nn.functional.linear(rms_norm(stream, norm_weight, cfg).float(), weight.float()).to(base.dtype)
    return (gelu_gate(*out.chunk(2, dim=-1)) if gated else out), stream


def operands(rows, hidden, columns, gated, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEVICE, getattr(torch, dtype))  # noqa: E731
    return dict(base=rand(rows, hidden), delta=rand(rows, hidden, scale=3.0), delta_weight=rand(hidden, scale=0.1),
                norm_weight=rand(hidden, scale=0.1), weight=rand(2 * columns if gated else columns, hidden,
                                                                 scale=hidden ** -0.5))


def fused(ops, cfg, gated, with_delta=True):
    return fused_kernels.norm_linear(ops["base"], ops["delta"] if with_delta else None,
                                     ops["delta_weight"] if with_delta else None, ops["norm_weight"], ops["weight"],
                                     cfg.rms_norm_eps, cfg.norm_weight_offset, cfg.is_gemma4, gated)


# (rows, hidden, columns): the 270M's hidden size; fewer rows than a block; 64-wide reduction blocks over two row blocks
SHAPES = [(16, 640, 256), (5, 256, 96), (20, 192, 64)]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma4", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_kernel_computes_the_layer_operations(dtype, gemma4, gated, with_delta):
    cfg = norm_config(gemma4)
    for rows, hidden, columns in SHAPES:
        ops = operands(rows, hidden, columns, gated, dtype)
        out, stream = fused(ops, cfg, gated, with_delta)
        want_out, want_stream = reference(ops["base"], ops["delta"] if with_delta else None, ops["delta_weight"],
                                          ops["norm_weight"], ops["weight"], cfg, gated)
        assert out.shape == want_out.shape and stream.shape == want_stream.shape
        # Rounding apart (rsqrt, the order of the products' sums), the same values: within 2 units of the dtype.
        tol = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-5}[dtype]
        torch.testing.assert_close(stream, want_stream, rtol=tol, atol=tol)
        scale = want_out.float().abs().max().item()
        torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol * scale)


@needs_kernels
@pytest.mark.parametrize("gated", [False, True])
def test_a_rows_outputs_depend_on_that_row_alone(gated):
    """Bitwise: the first rows of a 16-row call, of a 3-row call, and of a 16-row call whose other rows hold other
    numbers, and a row block of a 40-row call (the decode forward's invariance, fused_kernels' docstring)."""
    cfg = norm_config(False)
    dtype = DTYPES[0]
    ops = operands(16, 640, 256, gated, dtype)
    full = fused(ops, cfg, gated)
    first = fused({**ops, "base": ops["base"][:3], "delta": ops["delta"][:3]}, cfg, gated)
    noise = operands(16, 640, 256, gated, dtype, seed=1)
    mixed = {**ops, "base": torch.cat([ops["base"][:3], noise["base"][3:]]),
             "delta": torch.cat([ops["delta"][:3], noise["delta"][3:]])}
    other = fused(mixed, cfg, gated)
    wide = operands(40, 640, 256, gated, dtype, seed=2)
    wide = fused({**ops, "base": torch.cat([wide["base"][:24], ops["base"]]),
                  "delta": torch.cat([wide["delta"][:24], ops["delta"]])}, cfg, gated)
    for part in range(2):  # the output, then the stream
        assert torch.equal(full[part][:3], first[part])
        assert torch.equal(full[part][:3], other[part][:3])
        assert torch.equal(full[part], wide[part][24:])
    assert not torch.equal(full[0][3:], other[0][3:])  # the other rows did change


@pytest.mark.skipif(ON_CUDA or INTERPRETED, reason="runs the tests above under the interpreter")
def test_under_triton_interpreter():
    """This file's kernel tests in a subprocess that interprets the kernels on the CPU."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                             "not interpreter and not compiled and not traces_whole"],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-1000:]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gemma3", "gemma4_dense", "gemma4_e", "gemma4_moe"])
def test_compiled_decode_forward_fused_matches_unfused(random_checkpoints, variant, monkeypatch):
    """The compiled decode forward with its fused kernels against the same forward without them: the same
    logits but for rounding, and nine in ten greedy picks the same at least (bf16 rounding may flip a near-tie);
    and the fused path did run."""
    if not ON_CUDA:
        pytest.skip("needs CUDA")
    from specdec.models.torch_gemma import GemmaModel

    calls = []
    kernel = fused_kernels.norm_linear
    monkeypatch.setattr(fused_kernels, "norm_linear", lambda *a: calls.append(1) or kernel(*a))
    model = GemmaModel.from_checkpoint(random_checkpoints[variant], dtype=torch.bfloat16, device="cuda",
                                       max_seq_len=64)
    tokens = torch.randint(3, model.cfg.vocab_size, (1, 16), device="cuda")
    positions = torch.arange(16, device="cuda")[None]
    logits = {}
    for fused_on in (True, False):
        torch._dynamo.reset()
        model.fused_kernels = fused_on
        cache = model.allocate_cache(1, k_max=15)
        with torch.inference_mode():
            logits[fused_on], _ = torch.compile(model.forward, fullgraph=True)(tokens, positions, cache,
                                                                              commit_first=True)
    assert calls, "the fused kernels did not run"
    a, b = logits[True], logits[False]
    torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * b.abs().max().item())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.skipif(INTERPRETED, reason="dynamo takes an interpreted kernel for a Python function")
@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e"])
def test_decode_forward_with_fused_kernels_traces_whole(random_checkpoints, variant, monkeypatch):
    """Dynamo traces the decode forward with the fused kernels in one graph (the custom op registered before any
    trace reaches it), two of them a layer. Traced only: without CUDA the kernels cannot run."""
    from specdec.models.torch_gemma import GemmaModel

    model = GemmaModel.from_checkpoint(random_checkpoints[variant], dtype=torch.float16, max_seq_len=64)
    monkeypatch.setattr(GemmaModel, "fuses", lambda self, x: True)
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return lambda *args: None  # nothing runs: the forward's caller then fails to unpack None

    torch._dynamo.reset()
    with torch.inference_mode(), pytest.raises(TypeError):
        torch.compile(model.forward, fullgraph=True, backend=capture)(
            torch.randint(3, 500, (1, 16)), torch.arange(16)[None], model.allocate_cache(1, k_max=15),
            commit_first=True)
    assert len(graphs) == 1
    fused_calls = [node for node in graphs[0].graph.nodes if node.target is torch.ops.specdec.norm_linear.default]
    assert len(fused_calls) == 2 * model.cfg.num_layers


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's run of the forward; on CUDA the compiled test below")
@pytest.mark.parametrize("variant", ["gemma3", "gemma4_e", "gemma4_moe"])
def test_decode_forward_with_fused_kernels_matches_without(random_checkpoints, variant, monkeypatch):
    """The layers' wiring of the fused kernels (which weights, norms and splits they take), in float32 on the CPU:
    a decode forward with them gives the logits, taps and cache of the forward without them."""
    from specdec.models.torch_gemma import GemmaModel

    model = GemmaModel.from_checkpoint(random_checkpoints[variant], dtype=torch.float32, max_seq_len=64)
    tokens = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16)[None]
    runs = {}
    for fused_on in (True, False):
        monkeypatch.setattr(GemmaModel, "fuses", lambda self, x: fused_on)
        cache = model.allocate_cache(1, k_max=15)
        logits, taps = model(tokens, positions, cache, hidden_layers=(0, 2), commit_first=True)
        runs[fused_on] = (logits, taps, *[k for k in cache.keys if k is not None])
    for fused_out, plain_out in zip(runs[True], runs[False]):
        torch.testing.assert_close(fused_out, plain_out, rtol=1e-4, atol=1e-4)
