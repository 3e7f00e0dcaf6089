"""Training settings: YAML < flags, the resolved form round-trips, bad keys and values are one-line errors."""

import pytest

from specdec.errors import SpecdecError
from specdec.training.config import TrainConfig


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data: /d\nout: /o\nbatch-size: 16\nlr: 3.0e-4\naux_layer_ids: [2, 5, 9]\noffline: true\n")
    cfg = TrainConfig.load(path, lr=1e-3, steps=None, seq_len=512)  # None: a flag not given
    assert (cfg.batch_size, cfg.lr, cfg.seq_len, cfg.steps) == (16, 1e-3, 512, TrainConfig.steps)
    assert cfg.aux_layer_ids == [2, 5, 9] and cfg.offline is True
    cfg.check()
    (tmp_path / "again.yaml").write_text(cfg.to_yaml())
    assert TrainConfig.load(tmp_path / "again.yaml") == cfg
    assert TrainConfig.load(None, data="/d", out="/o", aux_layer_ids="1,2,3").aux_layer_ids == [1, 2, 3]


def test_identity_ignores_how_a_run_is_watched():
    a = TrainConfig(data="/d", out="/o")
    b = TrainConfig(data="/d", out="/elsewhere", save_every=7, log_every=1, wandb_project="p", devices=2)
    assert a.identity() == b.identity() and a.differences(b) == []
    c = TrainConfig(data="/d", out="/o", lr=5e-4, ttt_steps=3)
    assert [d.split(":")[0] for d in c.differences(a)] == ["lr", "ttt_steps"]


@pytest.mark.parametrize("text,needle", [
    ("learning_rate: 1\n", "unknown key 'learning_rate'"),
    ("steps: 1.5\n", "steps must be int"),
    ("lr: fast\n", "lr must be float"),
    ("offline: 1\n", "offline must be bool"),
    ("aux_layer_ids: 3\n", "aux_layer_ids must be list[int]"),
    ("steps: null\n", "steps cannot be null"),
    ("- a\n- b\n", "expected a mapping"),
    ("steps: [1\n", "not YAML"),
])
def test_bad_yaml(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecdecError, match="bad.yaml") as e:
        TrainConfig.load(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change,needle", [
    (dict(data=None), "--data"), (dict(out=None), "--out"), (dict(steps=0), "--steps"),
    (dict(seq_len=2), "--seq-len"), (dict(lr=0.0), "--lr"), (dict(warmup=50, steps=50), "--warmup"),
    (dict(ttt_steps=0), "--ttt-steps"), (dict(step_weight_decay=1.5), "step_weight_decay"),
    (dict(wandb_mode="maybe"), "--wandb-mode"), (dict(compute_dtype="float16"), "--compute-dtype"),
    (dict(aux_layer_ids=[1, 2]), "3 target layers"), (dict(coordinator_address="h:1"), "--num-processes"),
])
def test_bad_values(change, needle):
    cfg = TrainConfig(**{"data": "/d", "out": "/o", **change})
    with pytest.raises(SpecdecError, match=needle.replace("[", r"\[")):
        cfg.check()
