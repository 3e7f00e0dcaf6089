"""`specdec roofline` on the CPU at toy shapes: each (engine, device count) measured in a process of its own
(torch over two devices under torchrun and gloo, JAX over a mesh of two host devices), the JSON, the plots, and
a results file drawn again with --replot."""

import json
import subprocess
import sys
from types import SimpleNamespace

from specdec.bench import roofline as roofline_module
from specdec.models.config import GemmaConfig


def roofline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec", "roofline", *args], capture_output=True, text=True,
                          timeout=900)


def test_toy_31b_on_one_and_two_devices_both_engines(tmp_path):
    out, plot = tmp_path / "roofline.json", tmp_path / "roofline.png"
    done = roofline("--tiny", "--models", "31b", "--engines", "torch,jax", "--tensor-parallel", "1,2", "--steps", "4",
                    "--tokens", "8", "--verify-widths", "1,2", "--out", str(out), "--plot", str(plot))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["engine"], r["tensor_parallel"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("torch", 1), ("torch", 2), ("jax", 1), ("jax", 2)}
    for row in rows.values():
        assert row["model"] == "31b" and row["step_s"] > 0 and len(row["tokens"]) == 8
        assert row["width"] == 8  # an engine of generate's default drafts, as `specdec generate` runs it
        assert set(row["verify_ms"]) == {"1", "2"} and all(ms > 0 for ms in row["verify_ms"].values())
        assert row["bytes_per_step"]["total"] == row["bytes_per_step"]["weights"] + row["bytes_per_step"]["kv_cache"]
    for engine in ("torch", "jax"):  # float32 on the CPU: two devices decode what one does
        assert rows[(engine, 2)]["tokens"] == rows[(engine, 1)]["tokens"]
    assert plot.exists() and (tmp_path / "roofline-verify.png").exists()

    again = roofline("--replot", str(out))
    lines = again.stdout.splitlines()
    assert again.returncode == 0
    assert sorted(line.split()[1:3] for line in lines if line.startswith("31b ") and "verify" not in line) == [
        ["jax", "1"], ["jax", "2"], ["torch", "1"], ["torch", "2"]]
    assert sum("verify, per-width forwards: T=1" in line for line in lines) == 4


def test_bad_flag_is_refused():
    done = roofline("--tensor-parallel")
    assert done.returncode == 2 and "expected one argument" in done.stderr
    done = roofline("--tiny", "--models", "e4b", "--layers", "3")
    assert done.returncode == 2 and "--layers does not cut e4b" in done.stderr
    done = roofline("--tiny", "--steps", "128", "--context", "200")
    assert done.returncode == 2 and "--context 200 is too short" in done.stderr
    done = roofline("--tiny", "--k-max", "0")
    assert done.returncode == 2 and "--k-max must be at least 1, got 0" in done.stderr


def test_context_and_k_max_size_the_caches_and_the_bytes_a_step_reads(tmp_path):
    out = tmp_path / "roofline.json"
    done = roofline("--tiny", "--models", "31b", "--engines", "jax", "--steps", "2", "--tokens", "4", "--context",
                    "200", "--k-max", "8", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    cfg = GemmaConfig.from_dict(roofline_module.model_config("31b", SimpleNamespace(tiny=True, layers=None)))
    itemsize = record["rows"][0]["itemsize"]
    assert record["context"] == 200 and record["k_max"] == 8 and record["rows"][0]["width"] == 16
    assert record["rows"][0]["bytes_per_step"] == roofline_module.step_bytes(cfg, itemsize, 200, 8)
    assert roofline_module.step_bytes(cfg, itemsize, 200, 8)["kv_cache"] < roofline_module.step_bytes(
        cfg, itemsize, roofline_module.CONTEXT, 8)["kv_cache"]


def test_fp8_steps_read_a_byte_a_linear_weight_and_a_scale_a_row():
    """The 270M's layout (tied head): with FP8 linears, each linear's bytes halve but for 4 a row of scales, the head
    reads its FP8 copy and the token table one row; norms and the KV cache keep the model's dtype."""
    from specdec.models.checkpoint import expected_shapes

    cfg = GemmaConfig.from_dict(roofline_module.model_config("270m", SimpleNamespace(tiny=True, layers=None)))
    bf16, fp8 = (roofline_module.step_bytes(cfg, 2, 256, 4, fp8=f) for f in (False, True))
    linears = {n: s for n, s in expected_shapes(cfg).items() if n.endswith("_proj.weight")}
    vocab, hidden = expected_shapes(cfg)["embed_tokens.weight"]
    saved = sum(s[0] * s[1] - 4 * s[0] for s in linears.values()) + vocab * hidden - 4 * vocab - 2 * hidden
    assert bf16["weights"] - fp8["weights"] == saved
    assert bf16["kv_cache"] == fp8["kv_cache"]


def test_fp8_rows_in_parts_compute_one_devices_bits_on_two(tmp_path):
    """--fp8 with tensor parallelism: both engines' FP8 rows in parts, one and two devices, the same logits."""
    out = tmp_path / "roofline.json"
    done = roofline("--tiny", "--fp8", "--models", "31b", "--engines", "torch,jax", "--tensor-parallel", "1,2",
                    "--tp-parts", "2", "--layers", "3", "--steps", "2", "--tokens", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["engine"], r["tensor_parallel"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("torch-fp8", 1), ("torch-fp8", 2), ("jax-fp8", 1), ("jax-fp8", 2)}
    for engine in ("torch-fp8", "jax-fp8"):
        assert rows[(engine, 1)]["logits_digest"] == rows[(engine, 2)]["logits_digest"]


def test_a_failed_measurement_fails_the_run():
    """Three devices do not divide the toy 31B's 2 KV heads: its measurement fails, and so does the run."""
    done = roofline("--tiny", "--models", "31b", "--engines", "torch", "--tensor-parallel", "3", "--steps", "2")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "specdec roofline: 1 measurement(s) failed: torch 31b on 3 device(s)"


def test_rows_in_parts_compare_bits_across_device_counts(tmp_path):
    """--tp-parts runs the rows of both engines in parts and --layers cuts the model; each row keeps a digest of its
    logits, and the table says whether two devices computed one device's bits."""
    out = tmp_path / "roofline.json"
    done = roofline("--tiny", "--models", "31b", "--engines", "torch,jax", "--tensor-parallel", "1,2", "--tp-parts",
                    "2", "--layers", "3", "--steps", "2", "--tokens", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["engine"], r["tensor_parallel"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("torch", 1), ("torch", 2), ("jax", 1), ("jax", 2)}
    for engine in ("torch", "jax"):
        one, two = rows[(engine, 1)], rows[(engine, 2)]
        assert one["tp_parts"] == two["tp_parts"] == 2 and one["layers"] == two["layers"] == 3
        assert one["logits_digest"] == two["logits_digest"]
    assert "3 layers" in done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("31b ") and line.split()[2] == "2"]
    assert sorted(line[1] for line in lines) == ["jax", "torch"]
    for line in lines:
        assert line[3] == "2" and line[-3:-1] == ["yes", "yes"]  # parts; tokens and bits as one device's


def test_jax_rows_in_parts_start_with_the_parts_xla_flag():
    """XLA reads its flags when JAX starts: a JAX row in parts gets the one its GPUs need in its environment."""
    from specdec.models.config import PARTS_GPU_XLA_FLAGS

    child_command = roofline_module.child_command
    args = SimpleNamespace(steps=2, tokens=4, tiny=True, torch_compile=True, verify_widths=None, config_270m=None,
                           tp_parts=2, layers=None, context=roofline_module.CONTEXT, k_max=4, fp8=False)
    _, env = child_command("jax", "31b", 2, args)
    assert env["XLA_FLAGS"].split()[-3:] == ["--xla_force_host_platform_device_count=2", *PARTS_GPU_XLA_FLAGS]
    without_parts = SimpleNamespace(**{**vars(args), "tp_parts": None})
    for others in (child_command("torch", "31b", 1, args), child_command("jax", "31b", 1, without_parts)):
        assert not set(PARTS_GPU_XLA_FLAGS) & set(others[1].get("XLA_FLAGS", "").split())


class CallsOfFourSteps:
    """A cycle that runs 4 steps a call: a call's first step waits for the device (its ms in `call_ms`, in turn), and
    the other three read results already there."""

    cycles_per_call = 4
    decode_cycles_in_start = 0

    def __init__(self, clock: SimpleNamespace, call_ms: list[float]):
        self.clock, self.call_ms, self.steps = clock, call_ms, 0

    def start(self, prompts, stop):
        pass

    def step(self):
        if self.steps % self.cycles_per_call == 0:
            self.clock.now += self.call_ms[self.steps // self.cycles_per_call % len(self.call_ms)] / 1e3
        self.steps += 1

    def drain(self):
        pass


def test_the_median_step_is_a_calls_not_a_host_read(monkeypatch):
    """Calls of 4, 4, 4 and 40 ms over 4 steps each: 1 ms a step at the median, 3.25 on average. The median of single
    steps would be 0 (a host read)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(roofline_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    mean, median = roofline_module.seconds_per_step(CallsOfFourSteps(clock, [4.0, 4.0, 4.0, 40.0]), [1], 16, 4)
    assert abs(mean - 3.25e-3) < 1e-12
    assert abs(median - 1e-3) < 1e-12
    mean, median = roofline_module.seconds_per_step(CallsOfFourSteps(clock, [4.0]), [1], 2, 4)  # no whole call
    assert median == mean and abs(mean - 2e-3) < 1e-12
