"""Self-distillation end to end on a tiny random Gemma 3 (CPU): the responses are the target's plain greedy
decode, the masks and manifest are right, the dumped features are the target's hidden states, and the
CLI refuses bad input with one line."""

import json
import shutil

import datasets
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import specdec.api
from specdec.cli import app
from specdec.data.distill import DistillSettings, default_batch, distill, store_features
from specdec.data.sources import collect_prompts, jsonl_rows
from specdec.errors import SpecdecError
from specdec.generate import StopCondition, run_cycles
from specdec.models.checkpoint import checkpoint_fingerprint
from specdec.sampling import SamplingParams

CODE = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(30))
ROWS = [{"text": CODE}, {"prompt": "The weather today"}, {"text": ""}, {"prompt": "import numpy as np\n"}]
AUX = (1, 3, 4)  # engine taps 0, 2, 3; the last layer is 5


def write_rows(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_distill_writes_the_targets_greedy_responses(ckpt, tmp_path):
    target = specdec.api.load(ckpt, batch=2, k_max=4, max_seq_len=256)
    settings = DistillSettings(prompt_tokens=24, max_new_tokens=8, k=4, dump_features=True, aux_layer_ids=AUX)
    rows = jsonl_rows(write_rows(tmp_path / "rows.jsonl"))
    manifest = distill(target, rows, tmp_path / "out", settings, source={"kind": "jsonl"})
    ds = datasets.load_from_disk(str(tmp_path / "out"))

    # The reference: the prompts read again, decoded plainly (no drafter) on the same engine.
    prompts, _ = collect_prompts(jsonl_rows(tmp_path / "rows.jsonl"), target.tokenizer, prompt_tokens=24)
    prompts.sort(key=lambda p: len(p.ids))  # answered shortest first: a batch's rows share prompt lengths
    plain = specdec.api.make_cycle(target, "none", 0, SamplingParams())
    ids = [p.ids for p in prompts] + [prompts[0].ids]  # three prompts, a batch of two
    stop = StopCondition(8, target.tokenizer.eos_ids)
    expected = run_cycles(plain, ids[:2], 0, stop).tokens + run_cycles(plain, ids[2:], 0, stop).tokens[:1]

    assert ds.num_rows == 3 and ds["source"] == [f"{tmp_path}/rows.jsonl:{n}" for n in (2, 4, 1)]
    for row, prompt, response in zip(ds, prompts, expected):
        assert row["input_ids"] == prompt.ids + response
        assert row["loss_mask"] == [0] * len(prompt.ids) + [1] * len(response)
        assert len(response) == 8 or response[-1] in target.tokenizer.eos_ids
    assert ds.features["input_ids"] == datasets.List(datasets.Value("int32"))
    assert ds.features["loss_mask"] == datasets.List(datasets.Value("int8"))

    counts = manifest["counts"]
    assert counts["rows"] == 3 and counts["skipped"] == 1
    assert counts["prompt_tokens"] == sum(len(p.ids) for p in prompts)
    assert counts["response_tokens"] == sum(map(len, expected))
    assert counts["tokens"] == sum(len(r) for r in ds["input_ids"])
    assert manifest["skipped"] == [{"source": f"{tmp_path}/rows.jsonl:3", "reason": "empty prompt"}]
    assert manifest["target"]["fingerprint"] == checkpoint_fingerprint(ckpt)
    assert manifest["settings"]["batch"] == 2 and manifest["settings"]["engine"] == "torch"
    assert manifest["settings"]["hidden_layers"] == [0, 2, 3, 5]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest

    # Features: the states after engine layers 0, 2, 3 and 5, as a one-row forward from an empty cache gives them.
    assert ds.features["hidden"] == datasets.Array3D((None, 3, 64), "float16")
    assert ds.features["last_hidden"] == datasets.Array2D((None, 64), "float16")
    model = target.engine.model
    for row in ds.with_format("numpy"):
        tokens = torch.tensor(row["input_ids"])[None]
        with torch.inference_mode():
            _, ref = model(tokens, torch.arange(tokens.shape[1])[None], model.allocate_cache(1, 4, 256),
                           hidden_layers=(0, 2, 3, 5))
        ref = ref[0].numpy()
        assert row["hidden"].shape == (tokens.shape[1], 3, 64)
        np.testing.assert_allclose(row["hidden"], ref[:, :3], rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(row["last_hidden"], ref[:, 3], rtol=2e-3, atol=2e-3)


def test_a_batch_prefills_once_per_prompt_length(ckpt, tmp_path, monkeypatch):
    """Prompts of alternating lengths: in length order a batch of four prefills in two forwards, not four."""
    target = specdec.api.load(ckpt, batch=4, k_max=2, max_seq_len=128)
    prefills = []
    prefill_rows = target.engine._prefill_rows
    monkeypatch.setattr(target.engine, "_prefill_rows", lambda first, ps: prefills.append(len(ps)) or prefill_rows(first, ps))
    rows = [(f"row {i}", {"prompt": "import os\n" if i % 2 else "The weather today in the hills"}) for i in range(4)]
    distill(target, rows, tmp_path / "out", DistillSettings(max_new_tokens=2, k=2))
    assert prefills == [2, 2]


def test_default_batch_scales_to_the_device(ckpt):
    """4 on a CPU; on an accelerator the largest power of two (at most 256) whose bf16 KV cache fits half of
    what the bf16 weights leave free: here computed from the torch model and its allocated cache."""
    from specdec.models.config import GemmaConfig
    from specdec.models.gemma_torch import GemmaModel, KVCache

    cfg = GemmaConfig.from_file(ckpt / "config.json")
    settings = DistillSettings(max_seq_len=256, k=4)
    weights = 2 * sum(p.numel() for p in GemmaModel.from_checkpoint(ckpt).parameters())
    cache = KVCache.allocate(cfg, 1, 256, 4, torch.bfloat16, "meta")
    per_row = sum(t.numel() * t.element_size() for t in cache.keys + cache.values if t is not None)
    assert default_batch(cfg, settings, None) == 4
    assert default_batch(cfg, settings, weights + 2 * 8 * per_row) == 8
    assert default_batch(cfg, settings, weights + 2 * 8 * per_row - 1) == 4
    assert default_batch(cfg, settings, weights + 2 * 10_000 * per_row) == 256
    assert default_batch(cfg, settings, weights // 2) == 1


def test_sampled_distillation_is_seeded_and_out_dirs_are_guarded(ckpt, tmp_path):
    target = specdec.api.load(ckpt, batch=3, k_max=2, max_seq_len=64)
    rows = write_rows(tmp_path / "rows.jsonl")
    runs = tmp_path / "runs"

    def run(seed, name, **kwargs):
        settings = DistillSettings(prompt_tokens=16, max_new_tokens=6, k=2, temperature=1.0, seed=seed)
        distill(target, jsonl_rows(rows), runs / name, settings, **kwargs)
        return datasets.load_from_disk(str(runs / name))["input_ids"]

    first = run(7, "a")
    assert run(7, "b") == first
    other = run(8, "c")
    assert other != first
    with pytest.raises(SpecdecError, match="already exists"):
        run(7, "a")
    assert run(8, "a", overwrite=True) == other
    assert sorted(p.name for p in runs.iterdir()) == ["a", "b", "c"]  # no staging directory left behind


def test_jax_engine_features(ckpt, tmp_path):
    from specdec.models.gemma_torch import GemmaModel

    target = specdec.api.load(ckpt, engine="jax", batch=2, k_max=2, max_seq_len=64)
    settings = DistillSettings(prompt_tokens=16, max_new_tokens=4, k=2, dump_features=True)
    manifest = distill(target, jsonl_rows(write_rows(tmp_path / "rows.jsonl")), tmp_path / "out", settings)
    ds = datasets.load_from_disk(str(tmp_path / "out")).with_format("numpy")
    taps = manifest["settings"]["hidden_layers"]
    assert manifest["settings"]["aux_layer_ids"] == [2, 3, 3] and taps == [1, 2, 2, 5]  # the defaults for 6 layers
    model = GemmaModel.from_checkpoint(ckpt, max_seq_len=64)  # the reference: the other engine's model
    for row in ds:
        tokens = torch.tensor(row["input_ids"])[None]
        with torch.inference_mode():
            _, ref = model(tokens, torch.arange(tokens.shape[1])[None], model.allocate_cache(1, 2), hidden_layers=tuple(taps))
        ref = ref[0].numpy()
        assert row["loss_mask"].sum() == 4
        np.testing.assert_allclose(row["hidden"], ref[:, :3], rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(row["last_hidden"], ref[:, 3], rtol=2e-3, atol=2e-3)


def test_float16_features_saturate_and_are_counted():
    states = np.array([[1.5, -7e4], [1e5, 3.0]], np.float32)  # Gemma's BOS position reaches ~1e5
    stored, saturated = store_features(states, "float16")
    assert stored.dtype == np.float16 and saturated == 2
    assert stored.tolist() == [[1.5, -65504.0], [65504.0, 3.0]]
    assert store_features(states, "float32")[0] is states


runner = CliRunner()


def cli(*args):
    result = runner.invoke(app, ["distill", *map(str, args)])
    return result.exit_code, result.stderr


def test_cli_distills_a_jsonl_file(ckpt, tmp_path):
    rows = write_rows(tmp_path / "rows.jsonl")
    corpus = {"kind": "corpus", "sources": [], "excluded": {}, "rows": 4}  # as `specdec corpus` leaves beside it
    (tmp_path / "rows.manifest.json").write_text(json.dumps(corpus))
    code, err = cli("--target", ckpt, "--prompts", rows, "--out", tmp_path / "out", "--max-new-tokens", 4,
                    "--batch", 2, "--max-seq-len", 128, "--num-prompts", 2)
    assert code == 0, err
    assert "wrote 2 rows" in err
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert ds.num_rows == 2 and all(sum(m) == 4 for m in ds["loss_mask"])
    assert manifest["source"] == {"kind": "jsonl", "path": str(rows), "corpus": corpus}
    assert manifest["settings"]["max_new_tokens"] == 4 and manifest["settings"]["prompt_tokens"] == 128
    # 128 tokens of CODE leave no room in a context of 128; the empty text is no prompt.
    assert ["context" in s["reason"] for s in manifest["skipped"]] == [True, False]


@pytest.fixture(scope="module")
def weightless(random_checkpoints, tmp_path_factory):
    """A checkpoint's config and tokenizer without weights: bad input must be refused before they load."""
    from specdec.models.gguf_import import default_checkpoint

    directory = tmp_path_factory.mktemp("weightless")
    shutil.copy(random_checkpoints["gemma3"] / "config.json", directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_checkpoint() / name, directory)
    return directory


@pytest.mark.parametrize("args, needle", [
    ([], "give one prompt source"),
    (["--corpus", "builtin", "--prompts", "rows.jsonl"], "got --corpus and --prompts"),
    (["--corpus", "wikipedia"], "the only corpus is 'builtin'"),
    (["--prompts", "missing.jsonl"], "cannot read prompts"),
    (["--prompts", "odd.jsonl"], "odd.jsonl:1: no prompt field"),
    (["--prompts", "chats.jsonl"], "no usable prompts: 1 rows skipped (first: "),
    (["--prompts", "rows.jsonl", "--aux-layers", "2,x"], "--aux-layers '2,x'"),
    (["--prompts", "rows.jsonl", "--aux-layers", "2,3,9"], "aux layers 2,3,9 must lie in 1..5"),
    (["--corpus", "builtin", "--batch", "0"], "batch must be >= 1"),
    (["--prompts", "rows.jsonl", "--engine", "tensorflow"], "unknown engine 'tensorflow'"),
    (["--prompts", "rows.jsonl", "--max-new-tokens", "4000"], "leaves no room for a prompt"),
    (["--prompts", "rows.jsonl", "--num-prompts", "0"], "num-prompts must be >= 1"),
    (["--prompts", "rows.jsonl", "--feature-dtype", "bfloat16"], "feature dtype must be float16 or float32"),
    (["--prompts", "rows.jsonl", "--out", "rows.jsonl"], "already exists"),
])
def test_cli_bad_input_is_one_line(weightless, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    write_rows(tmp_path / "rows.jsonl")
    write_rows(tmp_path / "odd.jsonl", [{"question": "?"}])
    write_rows(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    out = [] if "--out" in args else ["--out", "new"]
    code, err = cli("--target", weightless, *out, *args)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("error:") and needle in lines[0]
    assert not (tmp_path / "new").exists()
