"""Loading checkpoints: layouts, strict checks, and one-line errors that name the file or tensor."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.errors import SpecdecError
from specdec.models.checkpoint import load_checkpoint, save_checkpoint
from specdec.models.config import GemmaConfig, decode_width
from specdec.models.decode_plan import BLOCK_S, plan
from specdec.models.gemma_torch import GemmaModel


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_multimodal_layout_loads_the_text_model(random_checkpoints):
    """`model.language_model.` names and a `gemma4` config with text_config; vision tensors ignored."""
    dense = GemmaModel.from_checkpoint(random_checkpoints["gemma4_dense"], max_seq_len=64)
    multi = GemmaModel.from_checkpoint(random_checkpoints["gemma4_multimodal"], max_seq_len=64)
    tokens = torch.randint(3, 512, (1, 12))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        a, _ = dense(tokens, pos, dense.allocate_cache(1))
        b, _ = multi(tokens, pos, multi.allocate_cache(1))
    assert torch.equal(a, b)


def test_sharded_checkpoint_round_trip(random_checkpoints, tmp_path):
    cfg_raw = json.loads((random_checkpoints["gemma3"] / "config.json").read_text())
    _, tensors = load_checkpoint(random_checkpoints["gemma3"], framework="numpy")
    out = save_checkpoint(tmp_path / "sharded", cfg_raw, tensors, max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    _, again = load_checkpoint(out, framework="numpy")
    assert set(again) == set(tensors)
    assert all((again[n] == tensors[n]).all() for n in tensors)


def test_dtype_chosen_at_load(random_checkpoints):
    _, tensors = load_checkpoint(random_checkpoints["gemma3"], framework="pt", dtype=torch.bfloat16)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_bf16_checkpoint_reads_without_torch_bitwise(random_checkpoints, tmp_path):
    """Released checkpoints are bf16: the numpy reader (the JAX engine's) gives torch's bits, zero-copy."""
    ckpt = copy_ckpt(random_checkpoints["gemma3"], tmp_path / "ckpt")
    stored = load_file(ckpt / "model.safetensors")
    save_file({n: t.to(torch.bfloat16) for n, t in stored.items()}, ckpt / "model.safetensors")
    _, by_numpy = load_checkpoint(ckpt, framework="numpy")
    _, by_torch = load_checkpoint(ckpt, framework="pt")
    assert set(by_numpy) == set(by_torch)
    for name, t in by_torch.items():
        assert by_numpy[name].dtype.name == "bfloat16" and not by_numpy[name].flags.writeable
        assert by_numpy[name].tobytes() == t.view(torch.int16).numpy().tobytes(), name


def test_truncated_safetensors_names_the_file(random_checkpoints, tmp_path):
    ckpt = copy_ckpt(random_checkpoints["gemma3"], tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpecdecError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_shape_mismatch_names_tensor_and_file(random_checkpoints, tmp_path):
    ckpt = copy_ckpt(random_checkpoints["gemma3"], tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(SpecdecError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*\(7, 64\)"):
        load_checkpoint(ckpt)


def test_missing_tensor_is_named(random_checkpoints, tmp_path):
    ckpt = copy_ckpt(random_checkpoints["gemma3"], tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(SpecdecError, match="layers.2.self_attn.k_norm.weight"):
        load_checkpoint(ckpt)


def test_unsupported_model_type_and_missing_field():
    with pytest.raises(SpecdecError, match="unsupported model_type 'llama'"):
        GemmaConfig.from_dict({"model_type": "llama"})
    with pytest.raises(SpecdecError, match="missing field 'head_dim'"):
        GemmaConfig.from_dict({"model_type": "gemma3_text", "num_hidden_layers": 2})


def test_gemma4_config_forms_agree(random_checkpoints):
    """Released checkpoints say global_head_dim / num_global_key_value_heads; transformers writes
    per_layer_config. Both resolve to the same layers."""
    raw = json.loads((random_checkpoints["gemma4_dense"] / "config.json").read_text())
    released = {k: v for k, v in raw.items() if k != "per_layer_config"}
    released.update(global_head_dim=32, num_global_key_value_heads=1)
    assert GemmaConfig.from_dict(released).layers == GemmaConfig.from_dict(raw).layers


@pytest.mark.parametrize("k_max", [0, 6, 7, 8, 15, 16])
def test_the_decode_width_holds_a_full_verify_in_rows_of_eight(k_max):
    """The pending token and k_max drafts, rounded up to a multiple of 8 rows. k_max 4, most tests' setting, hides a
    width rounded from k_max alone (4 and 5 both round to 8); 7 + 1 fills 8 rows exactly, 8 + 1 spills into 16."""
    width = decode_width(k_max)
    assert k_max + 1 <= width < k_max + 1 + 8 and width % 8 == 0


# Sliding windows whose rings straddle the rounding to whole splits of 64 slots. The test models' window of 8 takes
# one split with or without a forward's slots (8 and 8 + 15 both round to 64): a ring of `window` slots alone passed
# there. At k_max 8, 49 + 15 fills one split exactly and 50 + 15 spills into a second; 512 is the 270M's window,
# 1024 the 31B's.
WINDOWS = [8, 49, 50, 512, 1024]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("k_max, lookahead", [(8, 0), (4, 0), (4, 3)])
def test_sliding_ring_holds_a_window_and_a_forward_in_aligned_rows(random_checkpoints, window, k_max, lookahead):
    """Every slot a query's window and a decode forward need, and rows of a multiple of 64 slots: a 527-slot ring
    sent the attention products to a slow unaligned cuBLAS path, and XLA padded a 528-slot one. A ring longer than
    the context is cut to the context's slots."""
    cfg = GemmaConfig.from_dict(json.loads((random_checkpoints["gemma3"] / "config.json").read_text()))
    cfg = dataclasses.replace(cfg, sliding_window=window)
    needed = cfg.sliding_window + decode_width(k_max) - 1 + lookahead
    ring = cfg.cache_slots(max_seq_len=4096, k_max=k_max, lookahead=lookahead)["sliding_attention"]
    assert needed <= ring < needed + BLOCK_S and ring % BLOCK_S == 0 and BLOCK_S % 8 == 0
    short = cfg.cache_slots(max_seq_len=needed - 1, k_max=k_max, lookahead=lookahead)
    assert short["sliding_attention"] == short["full_attention"] < needed + BLOCK_S


@pytest.mark.parametrize("context", [333, 1000, 4096, 4100, 40_000])
def test_caches_split_into_whole_splits_of_the_attention_kernels(random_checkpoints, context):
    """Every context gets caches the decode attention's blocks split whole (the JAX kernels take no other: at 333
    slots the 270M's cycle ran XLA's attention, 14% slower), with every position of the context and less than a
    split more."""
    cfg = GemmaConfig.from_dict(json.loads((random_checkpoints["gemma3"] / "config.json").read_text()))
    for slots in cfg.cache_slots(max_seq_len=context, k_max=4).values():
        chunk = plan(slots, 256, 1)["chunk"]
        assert slots % chunk == 0 and slots % BLOCK_S == 0
    full = cfg.cache_slots(max_seq_len=context, k_max=4)["full_attention"]
    assert context <= full < context + plan(full, 256, 1)["chunk"]


