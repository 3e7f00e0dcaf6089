"""Does asking L2 for the next GEMM's weight while latency-bound kernels leave DRAM idle shorten that GEMM?
A measured miss (docs/benchmarks.md, "The cycle's bookkeeping compiled, ..."); kept so that it can be rerun.

Stand-ins for a decode forward at 16 rows, bf16, in CUDA graphs (not the engine's forward):
- A: 18 layers of the 270M's four GEMMs (1-5 MB each) with norms and a small attention between them, then its LM
  head: as they are, with every layer on layer 0's weights (held in L2: the bound), and with the next layer's
  weights prefetched at each layer's start, on a side stream or in order;
- B: four of the 31B's sliding-layer windows: the q/k/v GEMM, attention over a 16 MB cache, then the 88 MB
  o_proj, with the first 8-48 MB of o_proj prefetched after the q/k/v GEMM.
Two prefetch kernels: `prefetch.global.L2::evict_last` per 128-byte line, and Hopper's bulk
`cp.async.bulk.prefetch.L2` per 16 KB.

    python scripts/bench_l2_prefetch.py   # writes $OUT/l2_prefetch.json (or ./l2_prefetch.json)
"""

import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.verifiers.torch_engine import capture_graph

dev = "cuda"
torch.manual_seed(0)


@triton.jit
def prefetch_lines(ptr, n_bytes, LINES: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * LINES * 128 + tl.arange(0, LINES).to(tl.int64) * 128
    p = ptr + tl.minimum(offs, n_bytes - 1)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_bulk(ptr, n_bytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * CHUNK * THREADS + tl.arange(0, THREADS).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(n_bytes - offs, 0), CHUNK).to(tl.int32)
    p = ptr + tl.minimum(offs, n_bytes - 16)
    tl.inline_asm_elementwise("{ .reg .pred q; setp.gt.s32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                              "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, nbytes: int, kind: str):
    flat = w.view(-1).view(torch.uint8)
    nbytes = min(nbytes, flat.numel())
    if kind == "lines":
        LINES = 1024
        prefetch_lines[(triton.cdiv(nbytes, LINES * 128),)](flat, nbytes, LINES=LINES, num_warps=4)
    else:
        CHUNK, THREADS = 16384, 32
        prefetch_bulk[(triton.cdiv(nbytes, CHUNK * THREADS),)](flat, nbytes, CHUNK=CHUNK, THREADS=THREADS, num_warps=1)


def timed(fn, reps=50):
    g, _ = capture_graph(fn, warmups=2)
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(3):
        a.record()
        for _ in range(reps):
            g.replay()
        b.record(); torch.cuda.synchronize()
        best.append(a.elapsed_time(b) / reps * 1000)
    return min(best)  # us per replay


side = torch.cuda.Stream()
forked = [False]


def fork(fn):
    forked[0] = True
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()


def join():
    if forked[0]:
        torch.cuda.current_stream().wait_stream(side)
    forked[0] = False


results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
bf = torch.bfloat16

# --- A: the 270M's layers (18 x 4 GEMMs of 1-5 MB) then its LM head
H, I, QKV, O = 640, 2048, 1536, 1024
layers = [dict(qkv=torch.randn(QKV, H, device=dev, dtype=bf) * 0.04, o=torch.randn(H, O, device=dev, dtype=bf) * 0.03,
               gu=torch.randn(2 * I, H, device=dev, dtype=bf) * 0.04, d=torch.randn(H, I, device=dev, dtype=bf) * 0.02)
          for _ in range(18)]
head = torch.randn(262144, H, device=dev, dtype=bf) * 0.04
x0 = torch.randn(16, H, device=dev, dtype=bf)


def layer_270m(x, w):
    h = F.rms_norm(x.float(), (H,)).to(bf)
    qkv = F.linear(h, w["qkv"])
    q = qkv[:, :O].reshape(64, 256)
    s = torch.softmax((q @ q.T).float(), -1).to(bf)
    a = (s @ q).reshape(16, O)
    x = x + F.rms_norm(F.linear(a, w["o"]).float(), (H,)).to(bf)
    g, u = F.linear(F.rms_norm(x.float(), (H,)).to(bf), w["gu"]).chunk(2, -1)
    return x + F.rms_norm(F.linear(F.gelu(g, approximate="tanh") * u, w["d"]).float(), (H,)).to(bf)


def run_270m(kind=None, warm=False, inline=False):
    def fn():
        x = x0
        for i in range(18):
            w = layers[0] if warm else layers[i]
            if kind and i + 1 < 18:
                nxt = layers[i + 1]
                go = lambda: [prefetch(nxt[n], 1 << 40, kind) for n in ("qkv", "o", "gu", "d")]
                go() if inline else fork(go)
            x = layer_270m(x, w)
        join()
        return F.linear(x, head).argmax(-1)
    return fn


A = {"base": timed(run_270m()), "warm_l2_same_weights": timed(run_270m(warm=True))}
for kind in ("lines", "bulk"):
    try:
        A[f"prefetch_{kind}"] = timed(run_270m(kind))
        A[f"prefetch_{kind}_in_stream"] = timed(run_270m(kind, inline=True))
    except Exception as e:  # report, go on
        A[f"prefetch_{kind}"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
results["270m_18_layers_us"] = A
print("270M-like forward (us):", A, flush=True)

# prefetch kernel alone: 10 MB
w10 = torch.randn(5 << 20, device=dev, dtype=bf)
for kind in ("lines", "bulk"):
    try:
        results[f"prefetch_10MB_alone_{kind}_us"] = timed(lambda: prefetch(w10, 10 << 20, kind))
    except Exception as e:
        results[f"prefetch_10MB_alone_{kind}_us"] = f"failed: {e}"[:300]

# --- B: the 31B's sliding layer window: qkv GEMM, attention-like latency-bound kernels, then o_proj (88 MB)
HB = 5376
big = [dict(qkv=torch.randn(16384, HB, device=dev, dtype=bf) * 0.01, o=torch.randn(HB, 8192, device=dev, dtype=bf) * 0.01)
       for _ in range(4)]
keys = torch.randn(16, 1024, 256, device=dev, dtype=bf)
xb = torch.randn(16, HB, device=dev, dtype=bf)


def window_31b(prefetch_mb=0, kind="bulk", chain=True, inline=False):
    def fn():
        x = xb
        for w in big:
            qkv = F.linear(F.rms_norm(x.float(), (HB,)).to(bf), w["qkv"])
            if prefetch_mb:
                go = lambda w=w: prefetch(w["o"], prefetch_mb << 20, kind)
                go() if inline else fork(go)
            q = qkv[:, :8192].reshape(16, 32, 256).transpose(0, 1).contiguous().transpose(0, 1)
            q = F.rms_norm(q.float(), (256,)).to(bf)
            if chain:
                s = torch.bmm(q, keys.transpose(1, 2))
                p = torch.softmax(s.float(), -1).to(bf)
                a = torch.bmm(p, keys)
            else:
                a = q
            a = a.reshape(16, -1)[:, :8192]
            x = x + F.rms_norm(F.linear(a.contiguous(), w["o"]).float(), (HB,)).to(bf)
        join()
        return x
    return fn


B = {"base": timed(window_31b(), 20), "no_attention_chain": timed(window_31b(chain=False), 20)}
for mb in (8, 16, 24, 32, 40, 48):
    for kind in ("bulk", "lines"):
        try:
            B[f"prefetch_{mb}MB_{kind}"] = timed(window_31b(mb, kind), 20)
            B[f"prefetch_{mb}MB_{kind}_in_stream"] = timed(window_31b(mb, kind, inline=True), 20)
        except Exception as e:
            B[f"prefetch_{mb}MB_{kind}"] = f"failed: {e}"[:200]
results["31b_4_windows_us"] = B
print("31B-like 4 windows (us):", B, flush=True)
out = os.environ.get("OUT", ".")
json.dump(results, open(f"{out}/l2_prefetch.json", "w"), indent=1)
