import os

import pytest

# CPU threads: CI has 2 cores; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_configure(config):
    """Under xdist (the README's `-n 2`) each worker process takes one core: before its test modules import torch."""
    if hasattr(config, "workerinput"):
        os.environ["OMP_NUM_THREADS"] = "1"


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
    from tests.checkpoints import with_real_tokenizer

    return with_real_tokenizer(random_checkpoints["gemma3"], tmp_path / "ckpt")
