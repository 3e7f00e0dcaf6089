"""Issue 81, case by case: outputs that never delete what the command did not write, no exit 0 with output the
command knows to be wrong, and bad values refused with one line, before the model loads wherever they can be."""

import json
import os
import socket
import subprocess
import sys

import pytest

from specdec.output_dir import OutputDir
from tests.models.test_gguf_import import write_tiny_gemma3_gguf
from tests.test_cli import refused, run, snapshot

HEAD_FILES = {"config.json", "model.safetensors"}
IMPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "specdec-import.json"}


# -- import-gguf and export: what they write, and nothing else -----------------------------------------------


@pytest.fixture(scope="module")
def training_checkpoint(random_checkpoints, tmp_path_factory):
    """A training checkpoint of a random EAGLE-3 head for the random gemma3 target (no training run)."""
    from specdec.drafters.eagle3 import Eagle3Config, random_head
    from specdec.models.config import GemmaConfig
    from specdec.training.checkpoint import save_checkpoint
    from specdec.training.config import TrainConfig

    target = GemmaConfig.from_file(random_checkpoints["gemma3"] / "config.json")
    head_cfg = Eagle3Config.for_target(target, 64, (1, 2, 3))
    head = random_head(head_cfg)
    return save_checkpoint(tmp_path_factory.mktemp("training") / "run", 1, head.params, {}, head.d2t, head.t2d,
                           head_cfg, TrainConfig(), 0, keep=1)


@pytest.fixture(params=["import-gguf", "export"])
def command(request, tmp_path_factory, training_checkpoint):
    """(command name, its input, the files it writes)."""
    if request.param == "export":
        return "export", training_checkpoint, HEAD_FILES
    gguf = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gemma3_gguf(gguf)
    return "import-gguf", gguf, IMPORT_FILES


@pytest.fixture
def foreign(tmp_path):
    """A directory of the user's: a file and a subdirectory."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("do not lose me")
    (mine / "sub" / "data.bin").write_bytes(bytes(range(256)))
    return mine


def test_a_foreign_directory_is_refused_and_left_byte_for_byte(command, foreign, tmp_path):
    name, source, _ = command
    before = snapshot(tmp_path)
    line = refused(name, source, foreign)
    assert "holds files" in line and "notes.txt, sub/" in line and "--overwrite" in line
    assert snapshot(tmp_path) == before  # the directory, and no temporary left beside it


def test_a_file_where_the_directory_goes_is_refused(command, tmp_path):
    name, source, _ = command
    (tmp_path / "out").write_text("a file of the user's")
    before = snapshot(tmp_path)
    assert "exists and is not a directory" in refused(name, source, tmp_path / "out")
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_only_the_commands_files(command, foreign, tmp_path):
    name, source, writes = command
    (foreign / "config.json").write_text("{}")  # a name the command writes: replaced
    mine = {k: v for k, v in snapshot(foreign).items() if k != "config.json"}
    code, _, err = run(name, source, foreign, "--overwrite")
    assert code == 0, err
    after = snapshot(foreign)
    assert {k: after[k] for k in mine} == mine
    assert set(after) - set(mine) == writes and after["config.json"] != b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_second_run_replaces_the_first(command, tmp_path):
    name, source, writes = command
    for _ in range(2):
        code, _, err = run(name, source, tmp_path / "out")
        assert code == 0, err
        assert {p.name for p in (tmp_path / "out").iterdir()} == writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_runs_temporary_is_removed_by_the_next_run(command, tmp_path):
    """A kill -9 while writing leaves the staging directory; the next run removes it, and keeps a live one's."""
    name, source, _ = command
    tag = {"import-gguf": "importing", "export": "exporting"}[name]
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale, live = (tmp_path / f".out.{tag}-{pid}" for pid in (ended.pid, os.getppid()))
    for staging in (stale, live):
        (staging / "out").mkdir(parents=True)
        (staging / "out" / "model.safetensors").write_bytes(b"\0" * 4096)
    code, _, err = run(name, source, tmp_path / "out")
    assert code == 0, err
    assert not stale.exists() and live.exists()


def test_the_working_directory_as_the_output(command, tmp_path, monkeypatch):
    """`import-gguf FILE .` failed after dequantising, on the empty name of '.'. A non-empty one is refused first."""
    name, source, writes = command
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert "holds files" in refused(name, source, ".")
    (tmp_path / "notes.txt").unlink()
    code, _, err = run(name, source, ".")
    assert code == 0, err
    assert {p.name for p in tmp_path.iterdir()} == writes


def test_output_dir_declares_what_it_writes(tmp_path):
    """A write of an undeclared file is the command's bug, not a file to leave in the user's directory."""
    output = OutputDir(tmp_path / "out", ("a.json",), "test", "testing")
    with pytest.raises(AssertionError, match="b.json"):
        with output.writing() as staging:
            (staging / "b.json").write_text("{}")
    assert list(tmp_path.iterdir()) == []


# -- what the engines cannot run, refused in one line before the weights load --------------------------------


@pytest.mark.parametrize("args, dtype", [
    (["generate", "def add(a, b):", "--engine", "jax"], "int8"),
    (["generate", "def add(a, b):", "--engine", "jax"], "float8"),
    (["generate", "def add(a, b):"], "float8"),
    (["generate", "def add(a, b):"], "int64"),
    (["validate"], "float8"),
])
def test_dtypes_the_engines_do_not_compute_in_are_refused_by_name(ckpt, args, dtype):
    assert f"unknown dtype '{dtype}' (choose from float32, bfloat16, float16)" in refused(
        *args, "--target", ckpt, "--dtype", dtype)


@pytest.mark.parametrize("command", ["generate", "inspect"])
@pytest.mark.parametrize("edit, needle", [
    (lambda cfg: [1, 2, 3], "not a JSON object of settings (a list)"),
    (lambda cfg: {**cfg, "num_hidden_layers": "twelve"}, "num_hidden_layers must be an integer, got 'twelve'"),
    (lambda cfg: {**cfg, "rope_parameters": [1]}, "malformed config"),
])
def test_a_malformed_config_is_named(ckpt, command, edit, needle):
    config = ckpt / "config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    args = ["generate", "Hello"] if command == "generate" else ["inspect"]
    line = refused(*args, "--target", ckpt)
    assert str(config) in line and needle in line


def test_a_context_beyond_the_models_positions(ckpt):
    assert "beyond the model's 4096" in refused("generate", "Hello", "--target", ckpt, "--max-seq-len", "100000")


def test_cuda_without_cuda(ckpt):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert "device 'cuda': torch sees no CUDA devices" in refused("generate", "Hello", "--target", ckpt,
                                                                   "--device", "cuda")


def test_serve_max_model_len_below_a_decode_forward(tmp_path):
    assert "--max-model-len must be more than 8" in refused("serve", "--target", tmp_path / "absent",
                                                            "--max-model-len", "0")


@pytest.mark.parametrize("args", [
    ["serve", "--max-num-seqs", "1000000000"],
    ["serve", "--max-num-seqs", "1000000000", "--engine", "jax"],
    ["distill", "--prompts", "{prompts}", "--out", "{out}", "--batch", "1000000000"],
    ["distill", "--prompts", "{prompts}", "--out", "{out}", "--batch", "1000000000", "--engine", "jax"],
], ids=["serve-torch", "serve-jax", "distill-torch", "distill-jax"])
def test_a_batch_beyond_memory_is_refused_before_the_allocator_fails(ckpt, args, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    args = [a.format(prompts=prompts, out=tmp_path / "d") for a in args]
    line = refused(*args, "--target", ckpt)
    assert "a KV cache of 1000000000 rows" in line and "GiB free: ask for fewer rows" in line
    assert not (tmp_path / "d").exists()


def test_serve_on_a_busy_port_says_so_before_loading(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = refused("serve", "--target", tmp_path / "absent", "--port", port)
    assert f"cannot listen on 127.0.0.1:{port}" in line


# -- the command line's values, refused before anything loads ------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["generate", "Hello", "--max-seq-len", "0"], "--max-seq-len 0 is too small for --max-new-tokens 128"),
    (["generate", "Hello", "--max-seq-len", "-5"], "--max-seq-len -5 is too small"),
    (["generate", "Hello", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["validate", "--draws", "0"], "--draws must be >= 1, got 0"),
    (["validate", "--draws", "100000000"], "--draws must be at most 1,000,000"),
    (["validate", "--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["validate", "--sampled-rows", "-1"], "--sampled-rows must be >= 1, got -1"),
    (["validate", "--evidence", "/nonexistent/dir/ev.json"], "--evidence /nonexistent/dir/ev.json: no directory"),
])
def test_bad_values_are_refused_before_loading(args, needle, tmp_path):
    """A target that is no checkpoint: these fail before it is read."""
    assert needle in refused(*args, "--target", tmp_path / "absent")


def test_validate_writes_evidence_where_it_can(ckpt, tmp_path):
    """--evidence in a directory that exists and is a directory, checked before any gate runs."""
    (tmp_path / "ev.json").mkdir()
    assert "--evidence" in refused("validate", "--target", ckpt, "--evidence", tmp_path / "ev.json")


def test_a_context_too_small_for_the_new_tokens_says_how_many_were_asked(tmp_path):
    line = refused("generate", "def add(a, b):", "--target", tmp_path / "absent", "--max-new-tokens", "8",
                   "--max-seq-len", "12")
    assert "--max-seq-len 12 is too small for --max-new-tokens 8" in line and "need 16" in line


def test_a_prompt_too_long_for_the_context_names_the_tokens_asked_for(ckpt):
    """Found once the prompt is encoded, after loading: still the user's 8 new tokens (not the warm-up's 2), and
    stdout holds no echo of the prompt."""
    line = refused("generate", "word " * 20, "--target", ckpt, "--max-new-tokens", "8", "--max-seq-len", "32")
    assert "tokens + 8 new tokens does not fit the context of 32 tokens" in line


def test_an_empty_stop_string_is_refused(tmp_path):
    assert "--stop ''" in refused("generate", "Hello", "--target", tmp_path / "absent", "--stop", "")


def test_a_prompt_that_is_not_utf8_is_named(tmp_path):
    """The shell's bytes b'\\xff\\xfe' reach Python as lone surrogates."""
    line = refused("generate", "\udcff\udcfeab", "--target", tmp_path / "absent")
    assert "the prompt is not UTF-8 text (character 1 is the byte 0xff)" in line


# -- one reader of prompt files ------------------------------------------------------------------------------


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                 "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_validate_and_bench_read_every_layout_distill_reads(ckpt, tmp_path):
    from specdec.bench.decode import BenchSettings, load_prompts
    from specdec.data.sources import read_prompts
    from specdec.models.tokenizer import Tokenizer

    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    rows = [{"prompt": "def add(a, b):"}, {"text": "Once upon a time"},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            {"conversations": [{"from": "human", "value": "Hi"}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    chat = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    expected = ["def add(a, b):", "Once upon a time", chat, chat]
    assert read_prompts(path, Tokenizer.from_dir(ckpt)) == expected
    assert load_prompts(BenchSettings(target=ckpt, prompts_file=path)) == expected
    # validate reads the same way: a row of no layout is named by its line, before any model loads
    path.write_text('{"prompt": "ok"}\n{"question": "?"}\n')
    assert "p.jsonl:2: no prompt field (fields: question" in refused("validate", "--target", ckpt, "--prompts", path)
