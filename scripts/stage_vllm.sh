#!/usr/bin/env bash
# Stage vLLM 0.24.0 for the GPU machine, which reaches no registry and takes at most 64 MiB a call (the working tree
# included, about 4 MB): the fewest wheels that run `vllm.LLM(...)` offline (plain, n-gram and EAGLE-3 speculation)
# and `vllm serve` on top of what its image holds (torch 2.11.0, triton 3.6.0, transformers 5.17.0, numpy, numba,
# aiohttp, ... : /work/.library/device/KINDS.md), tarred and cut into pieces of at most 58,000,000 bytes.
# Run from the project's root:
#   scripts/stage_vllm.sh [PYTHON]          (PYTHON: one whose pip can download; default python3)
#   VLLM_WHEEL=/path/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl scripts/stage_vllm.sh   (reuse a download)
# It writes .whl-vllm/ (ignored by git): src/ (vLLM's wheel as published), wheels/ (what is installed there),
# part.0, part.1, ..., vllm_check.py (plain / n-gram K=4 / EAGLE-3 K=4 on a checkpoint: tok/s and acceptance
# length; --smoke: import and 16 tokens) and prints the device calls. Make them back to back (a machine is given
# back 30 s after a call; ~/v does not outlive it), each carrying ONE piece:
#   carry [".whl-vllm/part.0"]  command: mkdir -p ~/v && cp .whl-vllm/part.* ~/v/
#   ... the same for each piece but the last ...
#   carry [".whl-vllm/part.N", ".whl-vllm/vllm_check.py"]  command: the last, printed below: it joins, checks,
#   untars and installs into /tmp/vsite (python3 -m pip install --no-index --no-deps --target), then runs your job
#   with PYTHONPATH=/tmp/vsite, e.g. python3 .whl-vllm/vllm_check.py MODEL_DIR [EAGLE3_HEAD_DIR].
#
# What is left out, and why it can be:
#  - in vLLM's own wheel: vllm_flash_attn/_vllm_fa2_C (FlashAttention 2; on Hopper vLLM takes FA3, fa_utils.py),
#    _moe_C_stable_libtorch (MoE kernels; its import is guarded, platforms/cuda.py), vllm-rs (the opt-in Rust
#    front end, VLLM_USE_RUST_FRONTEND), third_party/deep_gemm and third_party/fmha_sm100 (FP8 GEMMs, SM100
#    attention; imported lazily with a fallback). On a GPU older than Hopper the FLASH_ATTN backend is gone too:
#    vLLM then picks TRITON_ATTN.
#  - flashinfer-python/-cubin (hundreds of MB): attention falls back to FlashAttention 3 (first on Hopper anyway),
#    and the sampler needs VLLM_USE_FLASHINFER_SAMPLER=0 (else it imports flashinfer and fails; set below).
#  - nvidia-cutlass-dsl, quack-kernels, tilelang, humming-kernels, tokenspeed-mla, nvidia-cudnn-frontend,
#    fastsafetensors, deep-gemm paths: quantized / MoE / MLA / SM100 kernels only, imported where used.
#  - mistral_common, lm-format-enforcer, outlines_core, lark, diskcache, compressed-tensors, depyf, anthropic, mcp,
#    opentelemetry, blake3, setproctitle, ijson, python-json-logger: Mistral models, other structured-output
#    backends, quantized checkpoints, debugging, tool servers, tracing, multimodal hashing; imported lazily.
set -euo pipefail
py=${1:-python3}
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.whl-vllm/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl-vllm/' >> .git/info/exclude; }
out=.whl-vllm
piece=58000000
mkdir -p "$out/src" "$out/wheels"
rm -f "$out"/part.* "$out"/wheels/*.whl

download() {  # cp312 manylinux x86_64 wheels, no dependencies (each one is named)
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$@"
}

# vLLM itself, as published (279 MB), then slimmed (see above)
wheel=${VLLM_WHEEL:-$out/src/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl}
[ -f "$wheel" ] || { download "$out/src" vllm==0.24.0; wheel=$out/src/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl; }
"$py" - "$wheel" "$out/wheels/$(basename "$wheel")" <<'EOF'
import sys, zipfile
src, dst = sys.argv[1:3]
drop_files = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs"}
drop_dirs = ("vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/")
dropped = lambda name: name in drop_files or name.startswith(drop_dirs)
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    record = None
    for info in zin.infolist():
        if info.filename.endswith(".dist-info/RECORD"):
            record = info
        elif not dropped(info.filename):
            zout.writestr(info, zin.read(info))
    lines = zin.read(record).decode().splitlines()
    zout.writestr(record, "".join(line + "\n" for line in lines if line and not dropped(line.rsplit(",", 2)[0])))
EOF

# What vLLM imports that the image lacks (it has no pydantic, fastapi or starlette at all), pinned within vLLM's
# requirements; typing-extensions to be sure of pydantic's minimum. `from vllm import LLM` needs the first group
# (xgrammar and llguidance too: dataclass annotations in v1/structured_output name their classes at import;
# apache-tvm-ffi at xgrammar's minimum, above vLLM's pin, which only FA4 code reads); `vllm serve` adds the second.
download "$out/wheels" \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  fastapi==0.136.3 starlette==1.10.0 openai==2.54.0 distro==1.9.0 sniffio==1.3.1 jiter==0.19.0 \
  openai-harmony==0.0.8 pyzmq==27.3.0 msgspec==0.23.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.3 \
  partial-json-parser==0.2.1.1.post7 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6
download "$out/wheels" \
  uvicorn==0.55.0 watchfiles==1.3.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
  prometheus-fastapi-instrumentator==8.1.0

cat > "$out/vllm_check.py" <<'PYEOF'
"""vLLM 0.24 on a local Gemma 3 checkpoint: plain, n-gram K=4 and EAGLE-3 K=4, greedy, one prompt at a time, each
method in a process of its own; prints tok/s and the acceptance length (tokens per verify step, from llm.get_metrics()).
    python3 vllm_check.py MODEL_DIR [EAGLE3_HEAD_DIR] [--max-tokens N]
    python3 vllm_check.py MODEL_DIR --smoke      (import vllm, build an LLM without CUDA graphs, 16 tokens)"""
import json, os, subprocess, sys, time

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no flashinfer in the staged install
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
PROMPTS = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n",
    "The river ran past the mill, and the mill wheel turned, and the river ran on past the",
    "Write a short story about a robot who learns to paint.",
    "List the first ten prime numbers and explain why each is prime.",
]


def methods(head):
    out = {"plain": (None, {}),
           "ngram K=4": ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, {})}
    if head:  # vLLM 0.24's own Gemma 3 has no EAGLE-3 taps (no SupportsEagle3): its Transformers backend has
        out["eagle3 K=4"] = ({"method": "eagle3", "model": head, "num_speculative_tokens": 4}, {"model_impl": "transformers"})
    return out


def run_one(model, head, name, max_tokens):
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.reader import Counter

    spec, extra = methods(head)[name]
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=4096, seed=0, speculative_config=spec,
              disable_log_stats=False, **extra)
    load_s = time.perf_counter() - t0
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)  # warm-up

    def counters():
        sums = {}
        for m in llm.get_metrics():
            if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode"):
                sums[m.name] = sums.get(m.name, 0) + m.value
        return sums

    before, tokens, seconds = counters(), 0, 0.0
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for prompt in PROMPTS:
        start = time.perf_counter()
        out = llm.generate([prompt], greedy, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += len(out[0].outputs[0].token_ids)
    after = counters()
    delta = {k.removeprefix("vllm:spec_decode_"): after[k] - before.get(k, 0) for k in after}
    drafts, accepted = delta.get("num_drafts", 0), delta.get("num_accepted_tokens", 0)
    print("RESULT " + json.dumps({
        "method": name, "tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
        "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,  # tokens per verify step
        "draft_acceptance_rate": round(accepted / delta["num_draft_tokens"], 3) if delta.get("num_draft_tokens") else None,
        "load_s": round(load_s, 1), **delta}), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    max_tokens = 256
    if "--max-tokens" in args:
        i = args.index("--max-tokens")
        max_tokens = int(args[i + 1])
        del args[i:i + 2]
    if "--one" in args:  # a child: one method
        i = args.index("--one")
        name = args[i + 1]
        del args[i:i + 2]
        run_one(args[0], args[1] if len(args) > 1 else None, name, max_tokens)
        sys.exit(0)
    if "--smoke" in args:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
        llm = LLM(model=args[0], dtype="bfloat16", max_model_len=2048, enforce_eager=True)
        print("SMOKE", repr(llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=16),
                                         use_tqdm=False)[0].outputs[0].text), flush=True)
        sys.exit(0)
    model, head = args[0], (args[1] if len(args) > 1 else None)
    results = []
    for name in methods(head):
        child = subprocess.run([sys.executable, __file__, *args, "--one", name, "--max-tokens", str(max_tokens)],
                               stdout=subprocess.PIPE, text=True)
        lines = [l for l in child.stdout.splitlines() if l.startswith("RESULT ")]
        results.append(json.loads(lines[-1][7:]) if lines else {"method": name, "error": f"exit {child.returncode}"})
        print(json.dumps(results[-1]), flush=True)
    plain = next((r["tok_s"] for r in results if r["method"] == "plain" and "tok_s" in r), None)
    for r in results:
        if "tok_s" in r:
            print(f"{r['method']:12s} {r['tok_s']:8.1f} tok/s  x{r['tok_s'] / plain if plain else float('nan'):.2f}  "
                  f"acceptance length {r['acceptance_length']}")
        else:
            print(f"{r['method']:12s} {r['error']}")
PYEOF

tar -cf "$out/all.tar" -C "$out" wheels
sha=$(sha256sum "$out/all.tar" | cut -d' ' -f1)
split -b "$piece" -d -a 1 "$out/all.tar" "$out/part."
rm "$out/all.tar"
ls -l "$out/wheels" | awk 'NR > 1 {printf "%12d  %s\n", $5, $9}'
parts=("$out"/part.*)
n=${#parts[@]}
total=$(cat "${parts[@]}" | wc -c)
echo "$n pieces, $total bytes (tar sha256 $sha)"
for ((i = 0; i < n - 1; i++)); do
  echo "call $((i + 1)): carry [\"$out/part.$i\"]  command: mkdir -p ~/v && cp $out/part.* ~/v/"
done
echo "call $n: carry [\"$out/part.$((n - 1))\", \"$out/vllm_check.py\"]  command:"
echo "  mkdir -p ~/v && cp $out/part.* ~/v/ && cat ~/v/part.? > ~/v/all.tar && echo \"$sha  \$HOME/v/all.tar\" | sha256sum -c - && tar -xf ~/v/all.tar -C ~/v && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite ~/v/wheels/*.whl && export PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 && <your job, e.g. python3 $out/vllm_check.py MODEL_DIR [EAGLE3_HEAD_DIR]>"
