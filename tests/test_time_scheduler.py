"""scripts/time_scheduler.py on the CPU: requests one after another through a server's scheduler, timed per engine,
rows and cycles per call, with no HTTP."""

import json

from tests.checkpoints import with_real_tokenizer
from tests.scripts import load_script


def test_each_engine_rows_and_cycle_count_is_timed_over_whole_requests(random_checkpoints, tmp_path, monkeypatch):
    script = load_script("time_scheduler")
    ckpt = with_real_tokenizer(random_checkpoints["gemma3"], tmp_path / "tiny")
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    monkeypatch.setattr("sys.argv", ["time_scheduler", "--target", str(ckpt), "--engines", "jax,torch",
                                     "--rows", "2", "--cycles-per-call", "1,3", "--narrow-cycles", "on,off",
                                     "--requests", "2",
                                     "--max-tokens", "6", "--out", str(out), "--plot", str(png)])
    assert script.main() == 0
    record = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert record["device"] == "cpu" and record["commit"] and record["model"] == "tiny"
    # torch runs one cycle a call alone, over the rows in use (1 of 2: its CPU forward keeps a row's bits) or all
    assert [(r["engine"], r["rows"], r["cycles_per_call"], r["cycle_widths"]) for r in record["rows"]] == [
        ("jax", 2, 1, [2]), ("jax", 2, 3, [2]), ("torch", 2, 1, [1, 2]), ("torch", 2, 1, [2])]
    for row in record["rows"]:
        assert row["tokens"] == 2 * 6 and row["tok_s"] > 0
        # a cycle emits 1..k+1 tokens of its request; the timed warm-up request is not counted
        assert row["tokens"] / 5 <= row["cycles"] <= row["tokens"] and row["tau"] >= 1
        assert 0 < row["step_ms_per_cycle"] <= row["ms_per_cycle"]


def test_the_step_is_timed_and_then_left_as_it_was(random_checkpoints, tmp_path):
    import specdec
    from specdec.serve.scheduler import Scheduler, SpeculativeConfig

    script = load_script("time_scheduler")
    ckpt = with_real_tokenizer(random_checkpoints["gemma3"], tmp_path / "tiny")
    target = specdec.load(ckpt, engine="jax", k_max=4, batch=1, max_seq_len=64)
    scheduler = Scheduler(target.engine, SpeculativeConfig("ngram", 4), 2)
    scheduler.start()
    try:
        row = script.time_requests(scheduler, [[5, 6, 7, 5, 6, 7]], max_tokens=8)
    finally:
        scheduler.stop()
    assert row["requests"] == 1 and row["tokens"] == 8 and row["cycles"] >= 2
    assert "step" not in vars(scheduler.cycle)  # the wrapper is gone, the class's step is back
