"""scripts/time_torch_prefill.py on the CPU: each prompt length's first prefill and the median of the rest, and the
plot of records before and after."""

import torch

from specdec.models.torch_gemma import GemmaModel
from specdec.verifiers.torch_engine import TorchEngine
from tests.scripts import load_script


def test_prefills_are_timed_by_length_and_plotted(random_checkpoints, tmp_path):
    script = load_script("time_torch_prefill")
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=256)
    engine = TorchEngine(model, batch=2, max_seq_len=256, k_max=4)
    with torch.inference_mode():
        rows = script.time_prefills(engine, [5, 40], repeats=2)
    assert [r["prompt_tokens"] for r in rows] == [5, 40]
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in rows)
    assert int(engine.lengths[1]) == 39  # the last row's: a server's rows past the first
    records = [{"weights": "random", "device": "cpu", "commit": commit, "batch": 2, "prefills": rows}
               for commit in ("before", "after")]
    script.plot(records, tmp_path / "prefill.png")
    assert (tmp_path / "prefill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
