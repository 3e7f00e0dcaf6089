"""Training batches: a pure function of (seed, step) that visits every row once per epoch, rows truncated and
padded with their masks, and stored features read back exactly, across Arrow chunks too."""

import datasets
import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.training.data import TrainData


@pytest.fixture
def sharded(tmp_path):
    """A dataset of 10 rows of lengths 3..12 in 3 Arrow files, with float16 features (H = 4)."""
    rng = np.random.default_rng(0)
    lengths = np.arange(3, 13)
    ids = [rng.integers(0, 50, n).astype(np.int32) for n in lengths]
    masks = [(np.arange(n) >= n // 2).astype(np.int8) for n in lengths]
    hidden = [rng.standard_normal((n, 3, 4)).astype(np.float16) for n in lengths]
    last = [rng.standard_normal((n, 4)).astype(np.float16) for n in lengths]
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("int8")),
                                  "hidden": datasets.Array3D((None, 3, 4), "float16"),
                                  "last_hidden": datasets.Array2D((None, 4), "float16")})
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "hidden": hidden, "last_hidden": last},
                                    features=features)
    ds.save_to_disk(str(tmp_path / "d"), num_shards=3)
    (tmp_path / "d" / "manifest.json").write_text('{"target": {"fingerprint": "abc"}}')
    return tmp_path / "d", ids, masks, hidden, last


def test_rows_and_features_read_back_exactly(sharded):
    path, ids, masks, hidden, last = sharded
    data = TrainData(path, offline=True)
    assert data.num_rows == 10 and len(data.ids.chunks) == 3
    batch = data.batch([9, 0, 4], seq_len=8, pad_id=7)
    for i, r in enumerate([9, 0, 4]):
        n = min(len(ids[r]), 8)  # row 9 (12 tokens) is truncated to 8
        np.testing.assert_array_equal(batch["tokens"][i, :n], ids[r][:n])
        assert (batch["tokens"][i, n:] == 7).all()
        np.testing.assert_array_equal(batch["mask"][i, :n], masks[r][:n].astype(bool))
        assert not batch["mask"][i, n:].any()
        assert batch["valid"][i].sum() == n
        np.testing.assert_array_equal(batch["taps"][i, :n], hidden[r][:n])
        np.testing.assert_array_equal(batch["last"][i, :n], last[r][:n])
        assert not batch["taps"][i, n:].any()
    assert batch["taps"].dtype == np.float16 and batch["tokens"].dtype == np.int32
    counts = np.bincount(np.concatenate([i[m == 1] for i, m in zip(ids, masks)]), minlength=50)
    np.testing.assert_array_equal(data.response_token_counts(50), counts)


def test_order_is_a_function_of_seed_and_step(sharded):
    path = sharded[0]
    data, again = TrainData(path), TrainData(path)
    steps = [data.rows_of_step(seed=3, step=s, global_batch=5) for s in range(6)]
    # Each epoch (2 steps of 5 rows) visits every row once, in its own order.
    for epoch in range(3):
        assert sorted(np.concatenate(steps[2 * epoch:2 * epoch + 2])) == list(range(10))
    assert not np.array_equal(np.concatenate(steps[0:2]), np.concatenate(steps[2:4]))
    # Another object (a resumed run), steps asked out of order: the same rows.
    for s in (4, 1, 5):
        np.testing.assert_array_equal(again.rows_of_step(3, s, 5), steps[s])
    assert not np.array_equal(data.rows_of_step(4, 0, 10), data.rows_of_step(3, 0, 10))
    # A batch that straddles two epochs.
    straddle = data.rows_of_step(3, 1, 6)  # positions 6..11: rows 6..9 of epoch 0, then 0..1 of epoch 1
    np.testing.assert_array_equal(straddle[:4], data.permutation(3, 0)[6:])
    np.testing.assert_array_equal(straddle[4:], data.permutation(3, 1)[:2])


def test_held_out_rows_are_never_trained_on(sharded):
    path, ids, masks = sharded[:3]
    data = TrainData(path, eval_rows=3, seed=3)
    held_out = set(data.eval_index.tolist())
    assert len(held_out) == 3 and held_out == set(TrainData(path, eval_rows=3, seed=3).eval_index.tolist())
    assert held_out != set(TrainData(path, eval_rows=3, seed=4).eval_index.tolist())
    # Each epoch of 7 training rows visits each of them once, and never a held-out row.
    seen = np.concatenate([data.rows_of_step(3, s, 7) for s in range(3)])
    for epoch in range(3):
        assert sorted(seen[7 * epoch:7 * epoch + 7]) == sorted(set(range(10)) - held_out)
    # The draft vocabulary counts the training rows' responses only.
    train = sorted(set(range(10)) - held_out)
    counts = np.bincount(np.concatenate([ids[r][masks[r] == 1] for r in train]), minlength=50)
    np.testing.assert_array_equal(data.response_token_counts(50), counts)
    # Held-out batches hold every held-out row once; the last batch is filled with empty rows.
    batches = data.eval_batches(2)
    assert [b.tolist() for b in batches] == [sorted(held_out)[:2], [sorted(held_out)[2], -1]]
    batch = data.batch(batches[1], seq_len=8, pad_id=7)
    assert (batch["tokens"][1] == 7).all() and not batch["mask"][1].any() and not batch["valid"][1].any()
    assert batch["valid"][0].sum() == min(len(ids[sorted(held_out)[2]]), 8)
    # No held-out rows: the order of a run without them.
    np.testing.assert_array_equal(TrainData(path, eval_rows=0, seed=3).rows_of_step(3, 1, 5),
                                  TrainData(path).rows_of_step(3, 1, 5))
    with pytest.raises(SpecdecError, match="--eval-rows 10: the dataset has 10 rows"):
        TrainData(path, eval_rows=10)


def test_bad_data_directories(sharded, tmp_path):
    path = sharded[0]
    with pytest.raises(SpecdecError, match="no such data directory"):
        TrainData(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdecError, match="manifest.json"):
        TrainData(tmp_path / "empty")
    (tmp_path / "empty" / "manifest.json").write_text('{"target": {"fingerprint": "abc"}}')
    with pytest.raises(SpecdecError, match="not a datasets directory"):
        TrainData(tmp_path / "empty")
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(SpecdecError, match="manifest.json: unreadable"):
        TrainData(path)
    (path / "manifest.json").write_text('{"target": {"fingerprint": "abc"}}')
    with pytest.raises(SpecdecError, match="distilled from target abc"):
        TrainData(path).check_target("def", 50, 4)
    with pytest.raises(SpecdecError, match="outside the target's vocabulary"):
        TrainData(path).check_target("abc", 20, 4)
    with pytest.raises(SpecdecError, match="features of width 4"):
        TrainData(path, offline=True).check_target("abc", 50, 8)
