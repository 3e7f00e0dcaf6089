"""The CLI: real generation on the embedded model, and bad input as one line on stderr with exit 1."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specdec.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_line_error(code, stderr, *needles):
    assert code == 1
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:")
    for needle in needles:
        assert needle in lines[0]


def refused(*args):
    """Run a command that must end with one line on stderr and exit 1, raising nothing past the CLI (an exception
    that escapes would be a traceback in a shell), with nothing on stdout; -> the line."""
    result = runner.invoke(app, [str(a) for a in args])
    assert isinstance(result.exception, SystemExit), result.exception
    one_line_error(result.exit_code, result.stderr)
    assert result.stdout == ""
    return result.stderr.strip()


def snapshot(root):
    """Every file under `root` (relative path -> bytes) and every directory (-> None): to show a command left
    them as they were."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_generate_on_the_embedded_model():
    code, out, err = run("generate", "def add(a, b):", "--max-new-tokens", "24", "-k", "4")
    assert code == 0, err
    assert out.startswith("def add(a, b):") and "return" in out
    assert "tok/s" in err and "tau" in err


def test_generate_on_a_checkpoint_directory(ckpt):
    code, out, err = run("generate", "Hello", "--target", str(ckpt), "--max-new-tokens", "8", "--drafter", "none")
    assert code == 0, err
    assert "k=0" in err and "8 tokens" in err


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_generate_with_fp8_weights_says_so(ckpt, engine):
    code, _, err = run("generate", "Hello", "--target", str(ckpt), "--engine", engine, "--fp8", "--max-new-tokens", "8")
    assert code == 0, err
    assert f"{engine} fp8 · drafter ngram" in err and "8 tokens" in err


def test_truncated_safetensors(ckpt):
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, _, err = run("generate", "Hello", "--target", str(ckpt))
    one_line_error(code, err, "model.safetensors")


def test_shape_mismatch(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, ckpt / "model.safetensors")
    code, _, err = run("generate", "Hello", "--target", str(ckpt))
    one_line_error(code, err, "model.layers.0.self_attn.q_proj.weight", "model.safetensors")


def test_weights_of_more_layers_than_the_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    cfg.pop("layer_types", None)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    last = cfg["num_hidden_layers"]
    code, _, err = run("generate", "Hello", "--target", str(ckpt))
    one_line_error(code, err, "unexpected tensor", f"model.layers.{last}.")


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    code, _, err = run("generate", "Hello", "--target", str(ckpt))
    one_line_error(code, err, "tokenizer", str(ckpt))


def test_unsupported_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, _, err = run("inspect", "--target", str(ckpt))
    one_line_error(code, err, "unsupported model_type 'llama'", "config.json")


def test_prompt_longer_than_the_context(ckpt):
    code, _, err = run("generate", "word " * 300, "--target", ckpt, "--max-seq-len", "128", "--max-new-tokens", "8")
    one_line_error(code, err, "+ 8 new tokens does not fit the context of 128")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-p", "0"], "top_p"),
        (["-k", "-2"], "-k"),
        (["--engine", "tpu"], "unknown engine 'tpu'"),
        (["--drafter", "eagle9"], "unknown drafter 'eagle9'"),
    ],
)
def test_bad_flags(ckpt, flags, needle):
    code, _, err = run("generate", "Hello", "--target", str(ckpt), *flags)
    one_line_error(code, err, needle)


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_a_tokenizer_larger_than_the_model(random_checkpoints, ckpt, tmp_path, engine):
    """The real tokenizer (262,144 ids) on a model of 512: load refuses it, and so does generate, which checks
    it after its program starts compiling (the CLI parses the tokenizer in a child meanwhile)."""
    import shutil

    import specdec
    from specdec.errors import SpecdecError

    small = shutil.copytree(random_checkpoints["gemma3"], tmp_path / "small")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, small / name)
    with pytest.raises(SpecdecError, match="tokenizer has 262144 tokens, the model 512"):
        specdec.load(small, engine=engine)
    code, _, err = run("generate", "Hello", "--target", str(small), "--engine", engine, "--max-new-tokens", "4")
    one_line_error(code, err, "tokenizer has 262144 tokens, the model 512")


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]])
def test_fused_cycle_from_the_cli(ckpt, sampling):
    """On CPU the fused cycle runs eagerly: the host loop's text, greedy and (one seed) sampled alike."""
    outs = []
    for flag in ("--fused", "--no-fused"):
        code, out, err = run("generate", "Hello Hello Hello", "--target", str(ckpt), "--max-new-tokens", "12", flag,
                             *sampling)
        assert code == 0, err
        outs.append(out)
    assert outs[0] == outs[1]


def test_jax_engine_from_the_cli(ckpt):
    code, out, err = run("generate", "Hello", "--target", str(ckpt), "--engine", "jax", "--max-new-tokens", "6")
    assert code == 0, err
    assert err.strip().startswith("jax") and "6 tokens" in err


def test_compare_plain_reports_a_speedup(ckpt):
    code, _, err = run("generate", "Hello Hello Hello", "--target", str(ckpt), "--max-new-tokens", "10", "--compare-plain")
    assert code == 0, err
    assert "x plain decoding (" in err


def test_validate_runs_every_gate_per_prompt(ckpt, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n\n{"prompt": "Once upon a time", "id": 2}\n')
    evidence = tmp_path / "evidence.json"
    code, out, err = run("validate", "--target", str(ckpt), "--prompts", str(prompts), "--tokens", "12",
                         "--k-max", "2", "--draws", "2000", "--evidence", str(evidence))
    assert code == 0, err
    record = json.loads(evidence.read_text())
    assert record["passed"] and record["prompts"] == ["def add(a, b):", "Once upon a time"]
    for prompt in (0, 1):
        names = {g["name"] for g in record["gates"] if g["prompt"] == prompt}
        assert names == {"k0_bit_identical/torch/eager", "greedy_k1/torch/eager", "greedy_k2/torch/eager",
                         "self_draft_k1/torch/eager", "self_draft_k2/torch/eager"}
    assert "gates per prompt" in out and "Once upon a time" in out
    assert "2/2 prompts pass every gate" in err


@pytest.mark.parametrize("engine, unit", [("torch", "torch/eager"), ("jax", "jax")])
def test_validate_gates_fp8_weights(ckpt, tmp_path, engine, unit):
    """The gates on FP8 linears: K=0 bit-identical to plain decode, greedy speculative output the plain decode's;
    the evidence says the weights were FP8."""
    evidence = tmp_path / "evidence.json"
    code, _, err = run("validate", "--target", str(ckpt), "--engine", engine, "--fp8", "--prompt", "def add(a, b):",
                       "--tokens", "12", "--k-max", "2", "--draws", "2000", "--evidence", str(evidence))
    assert code == 0, err
    record = json.loads(evidence.read_text())
    assert record["passed"] and record["fp8"]
    assert {f"k0_bit_identical/{unit}", f"greedy_k1/{unit}", f"greedy_k2/{unit}"} <= {g["name"] for g in record["gates"]}


def test_validate_reads_plain_text_prompts(tmp_path):
    from specdec.data.sources import read_prompts
    from specdec.models.gguf_import import default_checkpoint
    from specdec.models.tokenizer import Tokenizer

    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    tokenizer = Tokenizer.from_dir(default_checkpoint())
    assert read_prompts(tmp_path / "p.txt", tokenizer) == ["first prompt", "second prompt"]


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "ok"}\n{"name": "no prompt field"}\n', "p.jsonl:2: no prompt field (fields: name;"),
    ('{"prompt": ""}\n', "p.jsonl:1: empty prompt"),
    ('{"prompt": "ok"}\nnot json\n', "p.jsonl:2: not a JSON object"),
    ("\n\n", "p.jsonl: no prompts"),
])
def test_validate_bad_prompts_file(ckpt, tmp_path, content, needle):
    (tmp_path / "p.jsonl").write_text(content)
    code, _, err = run("validate", "--target", str(ckpt), "--prompts", str(tmp_path / "p.jsonl"))
    one_line_error(code, err, needle)
