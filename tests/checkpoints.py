"""Random checkpoints made usable from text: the real model's tokenizer and vocabulary on random weights."""

import json
import shutil
from pathlib import Path


def with_real_tokenizer(source: Path, out: Path) -> Path:
    """A copy of the random checkpoint `source` at `out` whose vocabulary is the real Gemma tokenizer's (262,144
    tokens, so the CLI can encode text), with that tokenizer. The embedding is drawn from a fixed seed: the same
    model every run, so a failure reproduces."""
    import torch
    from safetensors.torch import load_file, save_file

    from specdec.models.gguf_import import default_checkpoint

    shutil.copytree(source, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"] = 262144
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(out / "model.safetensors")
    seeded = torch.Generator().manual_seed(0)
    tensors["model.embed_tokens.weight"] = 0.1 * torch.randn(262144, cfg["hidden_size"], generator=seeded)
    save_file(tensors, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_checkpoint() / name, out / name)
    return out
