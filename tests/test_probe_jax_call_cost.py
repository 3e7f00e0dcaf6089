"""scripts/probe_jax_call_cost.py on the CPU: a call timed by its arrays, a chain's call and its traced launch, the
fused cycle's parts nested as they run (the jitted call inside `_dispatch`, both inside a `step`), and the plot."""

import json

from tests.scripts import load_script


def test_the_cycles_parts_are_timed_nested_and_plotted(random_checkpoints, tmp_path, monkeypatch):
    script = load_script("probe_jax_call_cost")
    monkeypatch.setattr(script, "CALLS", 15)
    assert script.call_by_arrays(3, 2, donate=True) > 0
    launch = script.xla_launch(4)  # on the CPU: XLA fuses the chain and launches no graph
    assert launch["xla_call_ms"] > 0 and launch["xla_traced_launch_ms"] == 0
    cycle = script.cycle_call(random_checkpoints["gemma3"] / "config.json", context=256, k_max=2)
    assert cycle["arrays_in"] > 10  # the weights, the state and the stop arrays
    assert 0 < cycle["call_ms"] < cycle["dispatch_ms"] < cycle["step_ms"]
    record = {"device": "cpu", "jax": "x", "commit": "c", "tfrt_gpu_client": False, "cycle": cycle,
              "by_arrays": [{"weights": 3, "state": 2, "donated": True, "ms": 0.1}], "launch_by_kernels": []}
    (tmp_path / "r.json").write_text(json.dumps(record))
    monkeypatch.setattr("sys.argv", ["probe", "--records", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")])
    script.main()
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
