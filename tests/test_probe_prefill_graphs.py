"""scripts/probe_prefill_graphs.py: its plot on the CPU; a case timed on a GPU."""

import pytest

from tests.scripts import load_script


def test_plot_shows_each_case_and_the_cycle_timed_again(tmp_path):
    script = load_script("probe_prefill_graphs")
    records = [{"case": "ungraphed", "cycle_ms": [0.48, 0.49]}, {"case": "graphs-first", "cycle_ms": [0.53]},
               {"case": "cycle-first", "cycle_ms": [0.54], "cycle_ms_after_warm_up": [0.55]}]
    script.plot(records, tmp_path / "p.png", "title")
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.gpu
def test_a_case_captures_prefill_graphs_and_times_the_cycle(random_checkpoints):
    script = load_script("probe_prefill_graphs")
    config = random_checkpoints["gemma3"] / "config.json"
    record = script.time_case(config, 256, "cycle-first", tokens=16, runs=2)
    assert record["prefill_graphs"] > 0 and len(record["cycle_ms"]) == len(record["cycle_ms_after_warm_up"]) == 2
    assert all(ms > 0 for ms in record["cycle_ms"] + record["cycle_ms_after_warm_up"])
