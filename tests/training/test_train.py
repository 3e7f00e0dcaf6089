"""`specdec train eagle3` end to end on the tiny random target: training learns, a killed run resumes to the
very same parameters, the exported head is the checkpoint's bit for bit, offline equals online, two
devices equal one, wandb logs offline, and bad input is one line with exit status 1."""

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from specdec.cli import app
from specdec.drafters.eagle3 import default_aux_layer_ids, draft_to_target, load_head
from specdec.errors import SpecdecError
from specdec.models import gemma_jax
from specdec.models.checkpoint import checkpoint_fingerprint
from specdec.training import eagle3 as train
from specdec.training.checkpoint import list_checkpoints, read_checkpoint
from specdec.training.data import TrainData
from specdec.training.trainer import train_eagle3
from tests.training.distilled import base_config, read_eval_log, read_train_log, write_dataset

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_line_error(code, stderr, *needles):
    assert code == 1, stderr
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:")
    for needle in needles:
        assert needle in lines[0], lines[0]


def subprocess_env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **extra)
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


HELD_OUT = 10  # rows of the 48 the whole run holds out: two evaluation batches of 8, the second mostly empty


@pytest.fixture(scope="module")
def trained(target, online_data, tmp_path_factory):
    """The whole 30-step run of the shared config, evaluating held-out rows every 10 steps."""
    out = tmp_path_factory.mktemp("trained") / "run"
    result = train_eagle3(base_config(online_data, out, target, eval_rows=HELD_OUT, eval_every=10), progress=False)
    return result


def loss_metrics(head_params, hcfg, target, d2t, t2d, batches):
    """The loss function's metrics of a head over each batch (dicts of numpy arrays)."""
    tcfg, params = gemma_jax.load_params(target, jnp.float32)
    loss_fn = train.make_eval_loss(hcfg, tcfg, train.LossSettings(ttt_steps=3), train.data_mesh(jax.devices()[:1]))
    vocab = {"draft_ids": jnp.asarray(draft_to_target(d2t), jnp.int32), "t2d": jnp.asarray(t2d)}
    head = {k: jnp.asarray(v) for k, v in head_params.items()}
    out = []
    for batch in batches:
        batch = {k: v for k, v in batch.items() if k != "valid"}
        loss, m = loss_fn(head, params, vocab, batch)
        out.append({"loss": float(loss), **{k: np.asarray(v) for k, v in m.items()}})
    return out


def eval_metrics(head_params, hcfg, target, data, d2t, t2d, steps=range(4)):
    """Mean loss and step-0 accuracy of a head over the batches of the run's first steps."""
    batches = [data.batch(data.rows_of_step(0, s, 8), 48) for s in steps]
    metrics = loss_metrics(head_params, hcfg, target, d2t, t2d, batches)
    return np.mean([m["loss"] for m in metrics]), np.mean([m["step_acc"][0] for m in metrics])


# -- (a) training learns --------------------------------------------------------------------------------


def test_training_lowers_the_loss_and_raises_accuracy(trained, target, online_data):
    assert trained.step == 30 and trained.head == Path(trained.out) / "head"
    log = read_train_log(trained.out)
    assert [r["step"] for r in log] == list(range(3, 31, 3))
    assert log[-1]["loss"] < log[0]["loss"] - 0.3
    assert np.mean([r["acc_0"] for r in log[-2:]]) > log[0]["acc_0"] + 0.3
    assert all(r["count_0"] > 0 and r["tok_s"] > 0 for r in log)

    # The untrained head (the run's initialisation) against the exported one, on the same batches.
    ckpt = read_checkpoint(trained.out)
    data = TrainData(online_data)
    untrained = train.init_head_params(ckpt.head_cfg, seed=0)
    loss0, acc0 = eval_metrics(untrained, ckpt.head_cfg, target, data, ckpt.d2t, ckpt.t2d)
    head = load_head(trained.head)
    loss1, acc1 = eval_metrics(head.params, head.cfg, target, data, head.d2t, head.t2d)
    assert loss1 < loss0 - 0.5, (loss0, loss1)
    assert acc1 > acc0 + 0.4, (acc0, acc1)


def test_train_peagle_learns_a_head_that_drafts_in_parallel(target, online_data, tmp_path):
    """`specdec train peagle`: the same run trains a P-EAGLE head (its mask feature learned with the rest), which then
    loses less than its initialisation, with mask rows in place of its own outputs, and drafts as --drafter peagle."""
    from specdec.drafters.registry import DrafterSource

    config = tmp_path / "run.yaml"
    config.write_text(base_config(online_data, tmp_path / "out", target).to_yaml())
    code, _, err = run("train", "peagle", "--config", config)
    assert code == 0, err
    head = load_head(tmp_path / "out" / "head")
    assert head.cfg.parallel and head.cfg.mask_token_id == 0  # the target's pad token
    ckpt = read_checkpoint(tmp_path / "out")
    untrained = train.init_head_params(ckpt.head_cfg, seed=0)
    assert not np.allclose(head.params["mask_hidden"], untrained["mask_hidden"])
    data = TrainData(online_data)
    loss0, _ = eval_metrics(untrained, ckpt.head_cfg, target, data, ckpt.d2t, ckpt.t2d)
    loss1, _ = eval_metrics(head.params, head.cfg, target, data, head.d2t, head.t2d)
    assert loss1 < loss0 - 0.5, (loss0, loss1)
    assert DrafterSource(f"peagle={tmp_path / 'out' / 'head'}", target).taps == head.cfg.taps
    with pytest.raises(SpecdecError, match="peagle="):
        DrafterSource(f"eagle3={tmp_path / 'out' / 'head'}", target).taps


def test_held_out_rows_are_evaluated(trained, target, online_data):
    """eval_log.jsonl holds, at steps 10, 20, 30, the loss metrics of the held-out rows as one batch of all of
    them gives them (computed here directly, with the exported head at step 30), and the run plots both logs."""
    log = read_eval_log(trained.out)
    assert [r["step"] for r in log] == [10, 20, 30]
    assert trained.eval_metrics == {k: v for k, v in log[-1].items() if k != "step"}
    data = TrainData(online_data, eval_rows=HELD_OUT, seed=0)
    head = load_head(trained.head)
    (direct,) = loss_metrics(head.params, head.cfg, target, head.d2t, head.t2d, [data.batch(data.eval_index, 48)])
    for j in range(3):
        assert log[-1][f"eval_count_{j}"] == direct["step_count"][j] > 0
        assert log[-1][f"eval_acc_{j}"] == pytest.approx(float(direct["step_acc"][j]), abs=1e-6)
        assert log[-1][f"eval_loss_{j}"] == pytest.approx(float(direct["step_loss"][j]), rel=1e-5)
        assert log[-1][f"eval_coverage_{j}"] == pytest.approx(direct["step_count"][j] / direct["step_total"][j])
    assert log[-1]["eval_loss"] == pytest.approx(direct["loss"], rel=1e-5)
    assert log[-1]["eval_loss"] < log[0]["eval_loss"]  # it learns the target, not only its 38 training rows
    assert (Path(trained.out) / "training.png").stat().st_size > 10_000


def test_eagle3_eval_scores_a_head_on_any_distilled_data(trained, target, online_data, tmp_path):
    """`specdec train eagle3-eval` over a dataset of exactly the run's held-out rows gives the run's last
    held-out evaluation; bad settings and a head for another target are one line."""
    import datasets

    held_out = tmp_path / "held_out"
    rows = TrainData(online_data, eval_rows=HELD_OUT, seed=0).eval_index
    datasets.load_from_disk(str(online_data)).select(rows).save_to_disk(str(held_out))
    (held_out / "manifest.json").write_text((Path(online_data) / "manifest.json").read_text())
    code, _, err = run("train", "eagle3-eval", "--head", trained.head, "--data", held_out, "--target", target,
                       "--batch-size", 8, "--seq-len", 48, "--ttt-steps", 3, "--out", tmp_path / "eval.json")
    assert code == 0, err
    metrics = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    logged = read_eval_log(trained.out)[-1]
    assert metrics.keys() == logged.keys() - {"step"}
    for key, value in metrics.items():
        assert value == pytest.approx(logged[key], rel=1e-5, abs=1e-6), key
    assert f"{logged['eval_acc_0']:.3f}" in err
    assert f"{logged['eval_acc_0'] * logged['eval_coverage_0']:.3f}" in err  # out-of-vocabulary tokens as misses

    one_line_error(*run("train", "eagle3-eval", "--head", trained.head, "--data", held_out, "--target", target,
                        "--ttt-steps", 0)[::2], "ttt steps must be >= 1")
    other = tmp_path / "other_head"
    other.mkdir()
    config = json.loads((Path(trained.head) / "config.json").read_text())
    config["specdec"]["target_fingerprint"] = "0" * 16
    (other / "config.json").write_text(json.dumps(config))
    for f in Path(trained.head).glob("*.safetensors"):
        (other / f.name).write_bytes(f.read_bytes())
    one_line_error(*run("train", "eagle3-eval", "--head", other, "--data", held_out, "--target", target)[::2],
                   "head trained for target checkpoint 0000000000000000")


# -- (b) kill and resume --------------------------------------------------------------------------------


def test_a_killed_run_resumes_to_the_same_parameters(target, online_data, tmp_path):
    straight = base_config(online_data, tmp_path / "straight", target, eval_rows=HELD_OUT, eval_every=2)
    train_eagle3(straight, stop_after=6, progress=False)

    killed = dataclasses.replace(straight, out=str(tmp_path / "killed"))
    first = train_eagle3(killed, stop_after=4, progress=False)  # killed after step 4: its last checkpoint is 3
    assert first.step == 4 and first.head is None
    assert [p.name for p in list_checkpoints(killed.out)] == ["step_00000003"]
    # A kill in the middle of writing checkpoint 6 leaves a temporary directory, which is never read.
    junk = Path(killed.out) / "checkpoints" / ".tmp-step_00000006-x"
    junk.mkdir()
    (junk / "state.safetensors").write_bytes(b"\0" * 100)

    config = tmp_path / "run.yaml"
    config.write_text(killed.to_yaml())
    proc = subprocess.run([sys.executable, "-m", "specdec", "train", "eagle3", "--config", str(config), "--resume",
                           "--stop-after", "6"], capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from step 3 of 30" in proc.stderr and "step 6/30" in proc.stderr

    a, b = read_checkpoint(Path(straight.out) / "checkpoints" / "step_00000006"), read_checkpoint(killed.out)
    assert b.step == 6 and b.data_position == 6 * 8
    assert a.params.keys() == b.params.keys() and a.opt_leaves.keys() == b.opt_leaves.keys()
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
    for name in a.opt_leaves:
        np.testing.assert_array_equal(a.opt_leaves[name], b.opt_leaves[name], err_msg=name)
    np.testing.assert_array_equal(a.d2t, b.d2t)
    # Steps 4-6 really ran again: the resumed run's log starts where its checkpoint did.
    assert [r["step"] for r in read_train_log(killed.out)] == [3, 6]
    assert [r["step"] for r in read_train_log(straight.out)] == [3, 6]
    np.testing.assert_array_equal([r["loss"] for r in read_train_log(killed.out)],
                                  [r["loss"] for r in read_train_log(straight.out)])
    # The held-out evaluations after the checkpoint (step 4) are dropped and made again, as the same numbers.
    evals = [read_eval_log(run.out) for run in (killed, straight)]
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] == [2, 4, 6]
    assert evals[0] == evals[1]


# -- (c) export -----------------------------------------------------------------------------------------


def test_export_round_trips_bit_exactly(trained, target, tmp_path):
    step_dir = Path(trained.out) / "checkpoints" / "step_00000030"
    code, _, err = run("export", step_dir, tmp_path / "head")
    assert code == 0, err
    code, _, err = run("export", trained.out, tmp_path / "newest")  # a training --out: its newest checkpoint
    assert code == 0, err
    ckpt = read_checkpoint(step_dir)
    for path in (tmp_path / "head", tmp_path / "newest", trained.head):
        head = load_head(path)
        assert set(head.params) == set(ckpt.params)
        for name, value in ckpt.params.items():
            assert head.params[name].dtype == np.float32
            np.testing.assert_array_equal(head.params[name], value, err_msg=name)
        np.testing.assert_array_equal(head.d2t, ckpt.d2t)
        np.testing.assert_array_equal(head.t2d, ckpt.t2d)
        assert head.cfg == ckpt.head_cfg
        assert head.cfg.target_fingerprint == checkpoint_fingerprint(target)
        assert head.cfg.aux_layer_ids == default_aux_layer_ids(6)
        assert head.cfg.draft_vocab_size == 256
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3"
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layer_ids(6))


# -- (d) offline equals online --------------------------------------------------------------------------


def test_offline_training_matches_online(target, online_data, offline_data, tmp_path):
    runs = {}
    for name, data, offline in (("online", online_data, False), ("offline", offline_data, True)):
        cfg = base_config(data, tmp_path / name, target, offline=offline, log_every=1)
        runs[name] = train_eagle3(cfg, stop_after=3, progress=False)
    on, off = read_train_log(runs["online"].out), read_train_log(runs["offline"].out)
    assert len(on) == len(off) == 3
    for a, b in zip(on, off):
        for key in ("loss", "loss_0", "loss_2", "acc_0", "count_0", "grad_norm"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
    a, b = read_checkpoint(runs["online"].out), read_checkpoint(runs["offline"].out)
    np.testing.assert_array_equal(a.d2t, b.d2t)
    for name in a.params:
        np.testing.assert_allclose(b.params[name], a.params[name], rtol=1e-5, atol=1e-6, err_msg=name)


# -- (e) data parallel ----------------------------------------------------------------------------------

DP_SCRIPT = """
import dataclasses, json, sys
import jax
from tests.training.distilled import base_config
from specdec.training.trainer import train_eagle3

target, data, out = sys.argv[1:4]
assert jax.device_count() == 2, jax.devices()
done = {}
for devices in (1, 2):
    cfg = base_config(data, f"{out}/dp{devices}", target, devices=devices, log_every=1)
    done[devices] = train_eagle3(cfg, stop_after=3, progress=False).devices
print(json.dumps(done))
"""


def test_two_devices_train_as_one(target, online_data, tmp_path):
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", DP_SCRIPT, str(target), str(online_data), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"1": 1, "2": 2}
    one, two = read_train_log(tmp_path / "dp1"), read_train_log(tmp_path / "dp2")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        for key in ("loss", "loss_1", "acc_0", "count_0", "grad_norm"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
    a, b = read_checkpoint(tmp_path / "dp1"), read_checkpoint(tmp_path / "dp2")
    for name in a.params:
        np.testing.assert_allclose(b.params[name], a.params[name], rtol=1e-5, atol=1e-6, err_msg=name)


# -- (f) wandb offline ----------------------------------------------------------------------------------


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of a .wandb file (LevelDB-style log of protobuf Records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = run_file.read_bytes()
    block, pos, pending, history = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return history


def test_wandb_logs_offline(target, online_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, whatever the flag does
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = tmp_path / "run.yaml"
    config.write_text(base_config(online_data, tmp_path / "out", target).to_yaml())
    code, _, err = run("train", "eagle3", "--config", config, "--stop-after", "6", "--wandb-project", "specdec-test",
                       "--wandb-mode", "offline")
    assert code == 0, err
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    history = wandb_history(runs[0])
    log = read_train_log(tmp_path / "out")
    assert [h["_step"] for h in history] == [r["step"] for r in log] == [3, 6]
    for h, r in zip(history, log):
        for key in ("loss", "acc_0", "loss_0", "acc_2", "tok_s", "lr", "grad_norm"):
            assert h[f"train/{key}"] == pytest.approx(r[key], rel=1e-6), key


# -- (g) bad input ----------------------------------------------------------------------------------------


def test_bad_input_is_one_line(target, online_data, trained, rows, tmp_path):
    base = ["train", "eagle3", "--target", target, "--data", online_data, "--out", tmp_path / "out"]
    one_line_error(*run("train", "eagle3", "--target", target, "--data", tmp_path / "nope", "--out", tmp_path / "o")[::2],
                   "no such data directory")
    one_line_error(*run("train", "eagle3", "--target", target, "--out", tmp_path / "o")[::2], "--data")
    one_line_error(*run(*base, "--steps", "0")[::2], "--steps")
    one_line_error(*run(*base, "--wandb-mode", "sometimes")[::2], "--wandb-mode")
    one_line_error(*run(*base, "--compute-dtype", "float8")[::2], "--compute-dtype")
    one_line_error(*run(*base, "--aux-layers", "1,x,3")[::2], "aux_layer_ids")
    one_line_error(*run(*base, "--offline")[::2], "'hidden'", "--dump-features")
    one_line_error(*run(*base, "--resume")[::2], "no checkpoint")
    one_line_error(*run(*base, "--eval-rows", "48")[::2], "--eval-rows 48: the dataset has 48 rows")
    one_line_error(*run(*base, "--eval-every", "0")[::2], "--eval-every must be >= 1")

    wrong = write_dataset(tmp_path / "wrong", rows[:4], target, fingerprint="0123456789abcdef")
    one_line_error(*run("train", "eagle3", "--target", target, "--data", wrong, "--out", tmp_path / "o")[::2],
                   "distilled from target 0123456789abcdef")
    (wrong / "manifest.json").unlink()
    one_line_error(*run("train", "eagle3", "--target", target, "--data", wrong, "--out", tmp_path / "o")[::2],
                   "manifest.json")

    config = tmp_path / "bad.yaml"
    config.write_text("steps: 10\nlearning_rate: 0.1\n")
    one_line_error(*run(*base, "--config", config)[::2], "unknown key 'learning_rate'")
    config.write_text("steps: ten\n")
    one_line_error(*run(*base, "--config", config)[::2], "steps must be int")
    config.write_text("steps: [1, 2\n")
    one_line_error(*run(*base, "--config", config)[::2], "not YAML")
    one_line_error(*run(*base, "--config", tmp_path / "missing.yaml")[::2], "no such config file")

    # --out holding another run's checkpoint (here: another learning rate).
    config.write_text(base_config(online_data, trained.out, target, lr=1e-3).to_yaml())
    one_line_error(*run("train", "eagle3", "--config", config)[::2], "another run", "lr")

    # An unreadable checkpoint: for export and for resuming.
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(trained.out, broken)
    state = broken / "checkpoints" / "step_00000030" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:1000])
    one_line_error(*run("export", broken / "checkpoints" / "step_00000030", tmp_path / "h")[::2], "unreadable checkpoint")
    config.write_text(base_config(online_data, broken, target).to_yaml())
    one_line_error(*run("train", "eagle3", "--config", config)[::2], "unreadable checkpoint")
    one_line_error(*run("export", tmp_path / "nothing", tmp_path / "h")[::2], "no such checkpoint")

    # The dataset replaced under a run that is resumed.
    data = write_dataset(tmp_path / "changing", rows[:16], target)
    cfg = base_config(data, tmp_path / "changing_run", target)
    train_eagle3(cfg, stop_after=3, progress=False)
    shutil.rmtree(data)
    write_dataset(data, rows[:20], target)
    config.write_text(cfg.to_yaml())
    one_line_error(*run("train", "eagle3", "--config", config)[::2], "trained on 16 rows")
