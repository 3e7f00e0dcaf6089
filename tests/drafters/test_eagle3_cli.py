"""An EAGLE-3 head from the CLI: `validate --drafter eagle3=DIR` passes every gate with a tiny head on a
tiny random target, `generate` with it writes the plain decode's text, and a head for another target is
refused with one line."""

import json

from typer.testing import CliRunner

from specdec.cli import app
from tests.checkpoints import tiny_eagle3_head

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_validate_passes_every_gate_with_an_eagle3_head(ckpt, tmp_path):
    head = tiny_eagle3_head(ckpt, tmp_path / "head")
    evidence = tmp_path / "evidence.json"
    code, out, err = run("validate", "--target", str(ckpt), "--engine", "all", "--drafter", f"eagle3={head}",
                         "--tokens", "10", "--k-max", "2", "--draws", "2000", "--sampled-rows", "100",
                         "--no-self-draft", "--evidence", str(evidence))
    assert code == 0, err
    record = json.loads(evidence.read_text())
    names = {g["name"] for g in record["gates"]}
    assert {"greedy_k2/torch/eager", "greedy_k2/jax", "sampled_speculation/torch/eagle3",
            "sampled_speculation/jax/eagle3"} <= names
    assert record["passed"] and record["drafter"] == f"eagle3={head}"


def test_generate_with_an_eagle3_head_writes_the_plain_decode(ckpt, tmp_path):
    head = tiny_eagle3_head(ckpt, tmp_path / "head")
    texts = {}
    for drafter in ("none", f"eagle3={head}"):
        code, out, err = run("generate", "def add(a, b):", "--target", str(ckpt), "--max-new-tokens", "12",
                             "--drafter", drafter, "-k", "3")
        assert code == 0, err
        texts[drafter] = out
    assert texts["none"] == texts[f"eagle3={head}"]


def test_a_head_for_another_target_is_refused(ckpt, tmp_path):
    head = tiny_eagle3_head(ckpt, tmp_path / "head", fingerprint="0123456789abcdef")
    code, _, err = run("generate", "Hi", "--target", str(ckpt), "--drafter", f"eagle3={head}", "--max-new-tokens", "4")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "head trained for target checkpoint 0123456789abcdef" in err
    code, _, err = run("generate", "Hi", "--target", str(ckpt), "--drafter", "eagle3", "--max-new-tokens", "4")
    assert code == 1 and "eagle3=DIR" in err
