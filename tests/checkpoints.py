"""Random checkpoints made usable from text (the real model's tokenizer and vocabulary on random weights, or a byte
tokenizer that fits their own vocabulary), and tiny drafters for them."""

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


def write_byte_tokenizer(directory, config=None):
    """A byte-fallback tokenizer whose vocabulary is <bos>, <eos>, <unk>, 'a' and the 256 byte tokens."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "a": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return _save_tokenizer(backend, directory, config)


def write_ascii_tokenizer(directory, vocab_size: int, config=None):
    """A tokenizer of one token per printable ASCII character (and newline), then tokens <unusedN> up to
    `vocab_size` that text never encodes to: every id a random model of that vocabulary emits decodes to the same
    text whole or streamed (no partial UTF-8 sequences)."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({c: len(vocab) + i for i, c in enumerate("\n" + "".join(map(chr, range(32, 127))))})
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), vocab_size)})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return _save_tokenizer(backend, directory, config)


def _save_tokenizer(backend, directory, config):
    """tokenizer.json and a tokenizer_config.json naming <bos> and <eos> (and `config`'s keys) in `directory`."""
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>"])
    directory.mkdir(exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": {"content": "<eos>"}, **(config or {})}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def tiny_eagle3_head(ckpt, out, fingerprint=None, draft_vocab_size=2048, stride=100, mask_token_id=None):
    """A random EAGLE-3 head for checkpoint `ckpt` (its fingerprint, else the one given) whose draft vocabulary is
    every `stride`-th target id, `draft_vocab_size` of them; with `mask_token_id`, a P-EAGLE head."""
    import numpy as np

    from specdec.drafters.eagle3 import Eagle3Config, random_head, save_head
    from specdec.models.checkpoint import checkpoint_fingerprint
    from specdec.models.config import GemmaConfig

    target_cfg = GemmaConfig.from_file(ckpt / "config.json")
    cfg = Eagle3Config.for_target(target_cfg, draft_vocab_size=draft_vocab_size,
                                  fingerprint=fingerprint or checkpoint_fingerprint(ckpt), mask_token_id=mask_token_id)
    ids = np.arange(draft_vocab_size)
    head = random_head(cfg, seed=0, d2t=ids * stride - ids)  # d2t: target id - draft id
    return save_head(out, cfg, head.params, head.d2t, head.t2d)
