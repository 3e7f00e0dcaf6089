"""scripts/time_jax_generation.py on the CPU: it times whole generations of the fused plain cycle, over the calls
they need, and the device's own pace, on an engine whose cache splits whole."""

import json

import jax

from specdec.models.config import FULL, GemmaConfig
from specdec.models.decode_plan import plan
from specdec.models.jax_gemma import random_params
from specdec.verifiers.jax_engine import JaxEngine, JaxFusedCycle
from tests.scripts import load_script


def test_generations_are_timed_whole(random_checkpoints):
    script = load_script("time_jax_generation")
    cfg = GemmaConfig.from_dict(json.loads((random_checkpoints["gemma3"] / "config.json").read_text()))
    engine = JaxEngine(cfg, random_params(cfg, jax.random.key(0)), max_seq_len=99, k_max=4)
    slots = engine.cache["slot_pos"][FULL].shape[1]
    assert slots >= 99 and slots % plan(slots, cfg.head_dim, 1)["chunk"] == 0
    cycle = JaxFusedCycle(engine, None, 0, prefetch=False)
    rows = script.time_generations(cycle, [5, 6, 7, 8, 9], tokens=20, runs=2)
    assert [r["emitted"] for r in rows] == [20, 20]
    for r in rows:
        assert r["calls"] >= 20 / cycle.cycles_per_call and r["decode_ms"] > 0 and r["prefill_ms"] > 0
    assert cycle._dispatch.__func__ is JaxFusedCycle._dispatch  # the timing wrappers are taken off again
    assert script.device_pace(cycle, [5, 6, 7], calls=2) > 0


def test_engines_of_each_prefill_chunk_are_timed_by_prompt_length(random_checkpoints, tmp_path, monkeypatch):
    """--prefill-chunks 0,64 --prompt-tokens 5,70: four rows, each engine's prefill_chunk recorded (the second
    prompt in two of its chunks), and the plot of prefill by prompt length."""
    script = load_script("time_jax_generation")
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    config = str(random_checkpoints["gemma3"] / "config.json")
    monkeypatch.setattr("sys.argv", ["time_jax_generation", "--config", config,
                                     "--contexts", "128", "--prefill-chunks", "0,64", "--prompt-tokens", "5,70",
                                     "--tokens", "8", "--runs", "1", "--cycles-per-call", "2", "--out", str(out),
                                     "--plot", str(png)])
    assert script.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prefill_chunk"], r["prompt_tokens"], r["cycles_per_call"]) for r in rows] == [
        (None, 5, 2), (None, 70, 2), (64, 5, 2), (64, 70, 2)]
    assert all(g["emitted"] == 8 and g["prefill_ms"] > 0 for r in rows for g in r["generations"])
    assert png.read_bytes().startswith(b"\x89PNG")
