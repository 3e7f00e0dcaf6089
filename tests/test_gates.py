"""The model gates on a random E-style Gemma 4 (window 8, so 640 tokens wrap the ring many times),
and `specdec validate` end to end. tests/test_planted_faults.py shows that each gate can fail."""

import json

import pytest

from specdec import gates
from specdec.models.gemma_torch import GemmaModel

PROMPT = [2, 17, 99, 5, 300, 41, 17, 99]
TOKENS = 640


@pytest.fixture(scope="module")
def eager(random_checkpoints):
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma4_e"], max_seq_len=TOKENS + 32)
    (eut,) = gates.torch_engines(model, graphs=False)
    return eut


def test_k0_bit_identical(eager):
    result = gates.gate_k0(eager, PROMPT, TOKENS)
    assert result.passed, result.detail
    assert result.detail["tokens"] == TOKENS


def test_greedy_k1_to_8(eager):
    results = gates.gate_greedy(eager, PROMPT, 200)
    assert [r.detail["k"] for r in results] == list(range(1, 9))
    assert all(r.passed for r in results), [r.detail for r in results if not r.passed]


def test_self_draft(eager):
    results = gates.gate_self_draft(eager, PROMPT, 120, ks=[1, 4, 8])
    assert all(r.passed for r in results), [r.detail for r in results]
    assert [r.detail["tau"] for r in results] == [2.0, 5.0, 9.0]


def test_greedy_gate_fails_on_a_real_divergence(eager):
    """A drafter-independent bug (here: a verifier that corrupts one emitted position) must fail the
    gate, with the divergence and the target's margin reported."""
    def corrupting(k_max):
        engine = eager.build(k_max)
        verify = engine.verify

        def wrong_verify(tokens):
            out = verify(tokens)
            row = len(PROMPT) - 1 + 20 - int(engine.lengths[0])  # the row predicting emitted token 20
            if 0 <= row < tokens.shape[1]:
                out.logits = out.logits.clone()
                out.logits[:, row, 123] = out.logits[:, row].max() + 10.0
            return out

        engine.verify = wrong_verify
        return engine

    honest_plain = lambda _engine, prompt, n: eager.plain_decode(eager.build(8), prompt, n)  # noqa: E731
    broken = gates.EngineUnderTest("torch/broken", corrupting, honest_plain)
    (result,) = gates.gate_greedy(broken, PROMPT, 60, ks=[2])
    assert not result.passed
    assert result.detail["first_divergence"] == 20
    assert result.detail["top2_margin"] > 0


@pytest.mark.slow
def test_validate_cli_writes_evidence(tmp_path):
    from typer.testing import CliRunner

    from specdec.cli import app

    evidence = tmp_path / "evidence.json"
    result = CliRunner().invoke(app, ["validate", "--tokens", "24", "--k-max", "2", "--draws", "2000",
                                      "--evidence", str(evidence)])
    assert result.exit_code == 0, result.stderr
    record = json.loads(evidence.read_text())
    assert record["passed"] is True
    names = [g["name"] for g in record["gates"]]
    assert "k0_bit_identical/torch/eager" in names and "greedy_k2/torch/eager" in names
    assert any(n.startswith("sampling/") for n in names)
