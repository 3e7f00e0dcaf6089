"""A user's `specdec generate` as a command: set-up is timed apart from decoding, compiled programs persist
in the user's cache directory (a second run reports a cache hit), and only the text reaches stdout."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

PROMPT = "def add(a, b):"


def generate(ckpt, cache, *flags):
    env = dict(os.environ, SPECDEC_CACHE=str(cache))
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", PROMPT, "--target", str(ckpt), "--max-new-tokens", "12", *flags],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr.strip().splitlines()[-1]


STATS = re.compile(r"loaded [\d.]+ s · compiled [\d.]+ s(?: \((?P<cache>[^)]*)\))? · prefill \d+ ms · "
                   r"12 tokens(?: at [\d,]+ tok/s|, all within the prefill's time)")


@pytest.mark.parametrize("engine", ["jax", "torch"])
def test_a_second_run_reuses_the_compiled_programs(ckpt, tmp_path, engine):
    first_out, first_stats = generate(ckpt, tmp_path / "cache", "--engine", engine)
    again_out, again_stats = generate(ckpt, tmp_path / "cache", "--engine", engine)
    assert first_out == again_out and first_out.startswith(PROMPT)
    first, again = STATS.search(first_stats), STATS.search(again_stats)
    assert first and again, (first_stats, again_stats)
    if engine == "jax":  # XLA's persistent cache, in the user's cache directory; the weights' transfer may overlap it
        assert re.fullmatch(r"cache miss(; [\d.]+ s of it beside loading)?", first["cache"]), first_stats
        assert re.fullmatch(r"cache hit(; [\d.]+ s of it beside loading)?", again["cache"]), again_stats
        assert any((tmp_path / "cache" / "xla").iterdir())
    else:  # the CPU engine runs eagerly: nothing to compile, nothing to claim
        assert first["cache"] is None and again["cache"] is None


def test_only_the_text_reaches_stdout(ckpt, tmp_path):
    """stdout is the prompt and the generated text, exactly what the Python API returns for the seeded request."""
    import specdec
    from specdec.sampling import SamplingParams

    out, _ = generate(ckpt, tmp_path / "cache", "--engine", "jax", "--temperature", "0.8", "--seed", "1")
    target = specdec.load(ckpt, engine="jax", k_max=4)
    texts, _ = specdec.generate(PROMPT, target, k=4, max_new_tokens=12, sampling=SamplingParams(0.8, seed=1))
    assert out == PROMPT + texts[0] + "\n"


@pytest.mark.parametrize("chosen", [None, "true"])
def test_xla_allocates_on_demand_unless_the_user_chose(ckpt, monkeypatch, chosen):
    """XLA's default reserves 75% of a GPU's memory at start-up, 1-2 s of every command on an H200."""
    import specdec

    if chosen is None:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    else:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", chosen)
    specdec.load(ckpt, engine="jax", k_max=2)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == (chosen or "false")
