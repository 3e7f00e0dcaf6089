import json
import os
import shutil

import pytest

# CPU threads: CI has 2 cores; keep torch from oversubscribing when xdist runs workers.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def random_checkpoints(tmp_path_factory):
    """variant -> directory of a small random-weight HF checkpoint (written once per session)."""
    from specdec.models.random_init import all_variants, write_random_checkpoint

    root = tmp_path_factory.mktemp("random_checkpoints")
    return {v: write_random_checkpoint(v, root / v) for v in all_variants()}


@pytest.fixture
def ckpt(random_checkpoints, tmp_path):
    """A random checkpoint with the real model's tokenizer (so the CLI can encode text)."""
    import torch
    from safetensors.torch import load_file, save_file

    from specdec.models.gguf_import import default_checkpoint

    out = shutil.copytree(random_checkpoints["gemma3"], tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = 262144  # the tokenizer's
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(out / "model.safetensors")
    tensors["model.embed_tokens.weight"] = 0.1 * torch.randn(262144, 64)
    save_file(tensors, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_checkpoint() / name, out / name)
    return out
