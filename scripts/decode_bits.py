"""Hashes of what a compiled torch engine decodes (CUDA): the logits of 64 plain verify forwards (the engine's verify
graph) and the first 200 tokens of fused plain and n-gram K=8 cycles, for a model with random weights at a config's
shapes. Run it twice under settings that must not change a bit (TORCHINDUCTOR_ENABLE_PDL=0 and =1, say) and
compare the hashes.

    TORCHINDUCTOR_ENABLE_PDL=0 python scripts/decode_bits.py --config .../config.json --layers 6
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch

from specdec.drafters.ngram import NgramDrafter
from specdec.generate import StopCondition
from specdec.models.config import GemmaConfig
from specdec.models.torch_gemma import GemmaModel
from specdec.verifiers.torch_engine import FusedCycle, TorchEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a config.json: random weights at its shapes")
    parser.add_argument("--layers", type=int, help="keep the first N layers, the last of them full attention")
    args = parser.parse_args()
    raw = json.loads(args.config.read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
        raw["layer_types"] = raw["layer_types"][: args.layers - 1] + ["full_attention"]
    model = GemmaModel.random(GemmaConfig.from_dict(raw), torch.bfloat16, "cuda", 1024, seed=0)
    engine = TorchEngine(model, max_seq_len=1024, k_max=8)
    prompt = [2] + torch.randint(3, 5000, (40,), generator=torch.Generator().manual_seed(0)).tolist() * 3
    pending = engine.prefill([prompt])
    logits_hash = hashlib.sha256()
    one = torch.ones(1, dtype=torch.long, device="cuda")
    for _ in range(64):
        logits = engine.verify(pending[:, None]).logits
        logits_hash.update(logits.float().cpu().numpy().tobytes())
        pending = logits[:, -1].argmax(-1)
        engine.commit(one)
    record = {"TORCHINDUCTOR_ENABLE_PDL": os.environ.get("TORCHINDUCTOR_ENABLE_PDL"),
              "verify_logits": logits_hash.hexdigest()[:16]}
    for name, draft in (("plain", None), ("ngram", NgramDrafter().device_draft_fn("torch", 8))):
        cycle = FusedCycle(engine, draft, 0 if draft is None else 8)
        cycle.start([prompt], StopCondition(10**6))
        emitted: list[int] = []
        while len(emitted) < 200:
            emitted += cycle.step().emitted(0)
        record[name] = hashlib.sha256(str(emitted[:200]).encode()).hexdigest()[:16]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
