"""EAGLE-3 heads in the speculators format (the `speculators` package's Eagle3SpeculatorConfig and Eagle3DraftModel,
which vLLM reads on its own): what `specdec export` writes has that format's config fields, tensor names, shapes and
dtypes (checked against what speculators 0.9.0 writes, and by speculators' own loader where it is installed), and a
head written in that format elsewhere drafts here, or is refused in one line where it asks for what specdec's head
does not compute."""

import dataclasses
import json
from importlib.util import find_spec

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from specdec.cli import app
from specdec.drafters.eagle3 import Eagle3Config, draft_to_target, load_head, random_head
from specdec.errors import SpecdecError
from specdec.models.checkpoint import checkpoint_fingerprint
from specdec.models.config import GemmaConfig
from specdec.training.checkpoint import save_checkpoint
from specdec.training.config import TrainConfig

runner = CliRunner()
AUX = (1, 2, 3)


def run(*args):
    result = runner.invoke(app, [*map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def head_for(ckpt, draft_vocab_size):
    """A random head for `ckpt` drafting every 7th target id (the first draft_vocab_size of them)."""
    cfg = Eagle3Config.for_target(GemmaConfig.from_file(ckpt / "config.json"), draft_vocab_size, AUX,
                                  fingerprint=checkpoint_fingerprint(ckpt))
    ids = np.arange(cfg.draft_vocab_size)
    stride = 7 if cfg.draft_vocab_size < cfg.vocab_size else 1
    return random_head(cfg, seed=3, d2t=ids * stride - ids)


def exported(head, tmp_path):
    """The head through a training checkpoint and `specdec export`, as a user gets it."""
    step = save_checkpoint(tmp_path / "run", 1, head.params, {}, head.d2t, head.t2d, head.cfg, TrainConfig(), 0, keep=1)
    code, _, err = run("export", step, tmp_path / "exported")
    assert code == 0, err
    return tmp_path / "exported"


def speculators_tensors(cfg: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor speculators 0.9.0's Eagle3DraftModel saves for a Llama layer (read off
    a head it wrote), but its copy of the target's embedding, which its loader does without."""
    H, I, V, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tensors = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (Vd, H),
               "layers.0.input_layernorm.weight": (H,), "layers.0.hidden_norm.weight": (H,),
               "layers.0.post_attention_layernorm.weight": (H,),
               "layers.0.self_attn.q_proj.weight": (q, 2 * H), "layers.0.self_attn.k_proj.weight": (kv, 2 * H),
               "layers.0.self_attn.v_proj.weight": (kv, 2 * H), "layers.0.self_attn.o_proj.weight": (H, q),
               "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
               "layers.0.mlp.down_proj.weight": (H, I)}
    found = {name: (shape, "float32") for name, shape in tensors.items()}
    if Vd < V:  # a full vocabulary has no mapping (speculators' DraftVocabMixin)
        found |= {"d2t": ((Vd,), "int64"), "t2d": ((V,), "bool")}
    return found


def test_export_writes_the_speculators_format(ckpt, tmp_path):
    head = head_for(ckpt, 512)
    cfg = head.cfg
    out = exported(head, tmp_path)
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3DraftModel"]
    spec = raw["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert [m["proposal_type"] for m in spec["proposal_methods"]] == ["greedy"]
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1  # vLLM's default K
    assert set(spec["verifier"]) == {"name_or_path", "architectures"}  # vLLM reads the first, speculators needs both
    layer = raw["transformer_layer_config"]
    assert {k: layer[k] for k in ("model_type", "num_hidden_layers", "hidden_act", "attention_bias", "mlp_bias")} == {
        "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    assert (layer["vocab_size"], layer["hidden_size"], layer["intermediate_size"]) == (
        cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert raw["draft_vocab_size"] == 512 and raw["target_hidden_size"] == cfg.hidden_size
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    # vLLM reads a missing norm_before_residual as true, which is not this head: it must be written
    assert {flag: raw[flag] for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                                         "embed_requires_grad")} == dict.fromkeys(
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad"), False)

    stored = load_file(out / "model.safetensors")
    assert {name: (t.shape, t.dtype.name) for name, t in stored.items()} == speculators_tensors(cfg)
    t2d, d2t = stored["t2d"], stored["d2t"]
    assert t2d.sum() == 512 and (np.flatnonzero(t2d) == draft_to_target(d2t)).all()  # what speculators checks
    np.testing.assert_array_equal(stored["layers.0.self_attn.q_proj.weight"], head.params["midlayer.self_attn.q_proj.weight"])

    full = exported(head_for(ckpt, 10**9), tmp_path / "full")  # a draft vocabulary of the whole target's
    assert "d2t" not in load_file(full / "model.safetensors")
    assert load_head(full).cfg.draft_vocab_size == GemmaConfig.from_file(ckpt / "config.json").vocab_size


@pytest.mark.skipif(find_spec("speculators") is None, reason="speculators is not installed")
def test_speculators_loads_the_export(ckpt, tmp_path):
    """speculators' own config class and model read the export: every tensor of ours loaded, none missing but
    the embedding (the target's, which it loads from the verifier: the export names none, so the test does)."""
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    head = head_for(ckpt, 512)
    out = exported(head, tmp_path)
    config = SpeculatorModelConfig.from_pretrained(out)
    assert isinstance(config, Eagle3SpeculatorConfig) and config.draft_vocab_size == 512
    assert config.eagle_aux_hidden_state_layer_ids == list(AUX) and not config.norm_before_residual
    config.speculators_config.verifier.name_or_path = str(ckpt)  # its loader reads the target's config and embedding
    state = Eagle3DraftModel.from_pretrained(out, config=config).state_dict()
    ours = load_file(out / "model.safetensors")
    assert {name for name in state if not name.startswith(("embed_tokens.", "verifier_"))} == set(ours)
    for name, value in ours.items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)


def write_as_speculators(head, directory, **config_changes):
    """The head as speculators 0.9.0 writes one (its config.json and tensors, copied from a head it wrote): a
    diff against LlamaConfig for the layer, rope_parameters alone, the target's embedding stored, no specdec keys."""
    cfg = head.cfg
    directory.mkdir()
    config = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": cfg.draft_vocab_size, "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "embed_requires_grad": False, "fc_norm": False,
        "norm_before_fc": False, "norm_before_residual": False, "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 4,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["Gemma3ForCausalLM"], "name_or_path": None}},
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
            "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size, "initializer_range": 0.02,
            "intermediate_size": cfg.intermediate_size, "max_position_embeddings": 2048, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": cfg.num_heads, "num_hidden_layers": 1,
            "num_key_value_heads": cfg.num_kv_heads, "pad_token_id": None, "pretraining_tp": 1,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "transformers_version": "5.25.0", "use_cache": True,
            "vocab_size": cfg.vocab_size},
        "transformers_version": "5.25.0",
    }
    for key, value in config_changes.items():  # "a.b" sets b inside a
        *parents, last = key.split(".")
        inner = config
        for parent in parents:
            inner = inner[parent]
        inner[last] = value
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name.replace("midlayer.", "layers.0."): value for name, value in head.params.items()}
    tensors["embed_tokens.weight"] = np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32)
    tensors |= {"d2t": head.d2t, "t2d": head.t2d}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_a_head_in_the_speculators_format_drafts_here(ckpt, tmp_path):
    """Read back as the same head (config and every tensor), and `generate` with it writes the plain decode's
    text; one that names no target layers takes the target's defaults, as vLLM and speculators do."""
    head = head_for(ckpt, 512)
    theirs = write_as_speculators(head, tmp_path / "theirs")
    loaded = load_head(theirs)
    assert loaded.cfg == dataclasses.replace(head.cfg, target_num_layers=0, target_fingerprint=None,
                                             max_position_embeddings=2048)  # what speculators does not record
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    np.testing.assert_array_equal(loaded.d2t, head.d2t)
    texts = {}
    for drafter in ("none", f"eagle3={theirs}"):
        code, out, err = run("generate", "def add(a, b):", "--target", ckpt, "--max-new-tokens", "12",
                             "--drafter", drafter, "-k", "3")
        assert code == 0, err
        texts[drafter] = out
    assert texts["none"] == texts[f"eagle3={theirs}"]

    from specdec.drafters.eagle3 import default_aux_layer_ids, load_for_target

    unnamed = write_as_speculators(head, tmp_path / "unnamed", eagle_aux_hidden_state_layer_ids=None)
    target_cfg = GemmaConfig.from_file(ckpt / "config.json")
    assert load_for_target(unnamed, target_cfg, None).cfg.aux_layer_ids == default_aux_layer_ids(target_cfg.num_layers)


@pytest.mark.parametrize("change, needle", [
    ({"speculators_model_type": "dflash"}, "a speculators 'dflash' model"),
    ({"transformer_layer_config.model_type": "qwen3"}, "transformer_layer_config.model_type 'qwen3'"),
    ({"transformer_layer_config.num_hidden_layers": 2}, "transformer_layer_config.num_hidden_layers 2"),
    ({"transformer_layer_config.rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "the RoPE type 'llama3'"),
    ({"target_hidden_size": 4096}, "target_hidden_size 4096"),
    ({"norm_before_residual": True}, "norm_before_residual True"),
    ({"fc_norm": True}, "fc_norm True"),
    ({"embed_requires_grad": True}, "embed_requires_grad True"),
])
def test_what_specdec_cannot_run_is_refused_in_one_line(ckpt, tmp_path, change, needle):
    theirs = write_as_speculators(head_for(ckpt, 512), tmp_path / "theirs", **change)
    with pytest.raises(SpecdecError) as refused:
        load_head(theirs)
    assert needle in str(refused.value) and "\n" not in str(refused.value)
