"""Training data: a distilled dataset (specdec.data.distill's layout: a `datasets` save_to_disk directory with
`manifest.json` beside its files) read as padded batches.

Columns: `input_ids` (prompt + the target's response), `loss_mask` (1 over the response) and, for offline
training, `hidden` [len, 3, H] (the target's states after the engine layers `Eagle3Config.taps`) and
`last_hidden` [len, H] (after the last layer). The columns are read straight from the memory-mapped Arrow
files: a row is a slice of one flat buffer, so a batch of features costs a copy, not a conversion.

Held out: `eval_rows` rows, drawn with the seed, are never trained on (`eval_index`); the training rows are
the others (`train_index`, n of them). The draft vocabulary is counted over the training rows only.

Order: step s takes the global sample positions s*B .. s*B+B-1; position p is training row perm_e[p mod n] of
epoch e = p // n, perm_e a permutation drawn from (seed, e). A batch is a pure function of (seed, step), so a
run resumed at step s reads exactly what the uninterrupted run would have. Rows are truncated to their first
`seq_len` tokens and padded after their end (pad token, loss mask 0).
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError

MANIFEST = "manifest.json"
HOLDOUT_STREAM = 1 << 40  # the held-out rows' random stream, apart from the epochs' (seed, epoch)


class _Ragged:
    """One list column of an Arrow table as (row starts into a flat numpy buffer, the buffer), per chunk."""

    def __init__(self, column, inner_shape: tuple[int, ...] = ()):
        import pyarrow as pa

        self.inner_shape = inner_shape
        self.chunks = []
        first = 0
        self.firsts = []
        for chunk in column.chunks:
            arr = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
            starts = arr.offsets.to_numpy().astype(np.int64)
            inner = arr.values
            while pa.types.is_list(inner.type) or pa.types.is_large_list(inner.type):
                starts = inner.offsets.to_numpy().astype(np.int64)[starts]
                inner = inner.values
            if pa.types.is_fixed_size_list(inner.type):
                raise SpecdecError(f"unsupported column type {column.type}")
            values = inner.to_numpy(zero_copy_only=False)
            self.chunks.append((starts, values))
            self.firsts.append(first)
            first += len(arr)
        self.firsts = np.asarray(self.firsts + [first], np.int64)
        self.width = int(np.prod(inner_shape)) if inner_shape else 1

    def row(self, i: int, limit: int | None = None) -> np.ndarray:
        c = int(np.searchsorted(self.firsts, i, side="right") - 1)
        starts, values = self.chunks[c]
        local = i - self.firsts[c]
        lo, hi = starts[local], starts[local + 1]
        if limit is not None:
            hi = min(hi, lo + limit * self.width)
        return values[lo:hi].reshape(-1, *self.inner_shape)

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(s) // self.width for s, _ in self.chunks]) if self.chunks else np.zeros(0, np.int64)

    def all_values(self):
        """Every row's values, chunk by chunk (for counting tokens)."""
        for starts, values in self.chunks:
            yield values[starts[0]:starts[-1]], starts - starts[0]


@dataclass
class Manifest:
    raw: dict
    fingerprint: str | None
    aux_layer_ids: tuple[int, ...] | None
    hidden_size: int | None


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    if not path.is_file():
        raise SpecdecError(f"{directory}: no {MANIFEST} (write the data with `specdec distill`: the manifest names "
                           "the target it was distilled from)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecdecError(f"{path}: unreadable ({e})") from None
    target = raw.get("target") if isinstance(raw, dict) else None
    if not isinstance(target, dict):
        raise SpecdecError(f"{path}: no 'target' entry")
    fingerprint = target.get("fingerprint") or target.get("hash")
    settings = raw.get("settings") or {}
    aux = settings.get("aux_layer_ids")
    return Manifest(raw, fingerprint, tuple(aux) if aux else None, target.get("hidden_size"))


class TrainData:
    """A distilled dataset opened for training."""

    def __init__(self, path: str | Path, offline: bool = False, eval_rows: int = 0, seed: int = 0):
        path = Path(path)
        if not path.is_dir():
            raise SpecdecError(f"{path}: no such data directory")
        self.path, self.offline = path, offline
        self.manifest = read_manifest(path)
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds; all mean "not a dataset"
            raise SpecdecError(f"{path}: not a datasets directory ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise SpecdecError(f"{path}: a DatasetDict of splits {list(ds)}; pass one split's directory")
        self.num_rows = len(ds)
        if self.num_rows == 0:
            raise SpecdecError(f"{path}: the dataset has no rows")
        for column in ("input_ids", "loss_mask") + (("hidden", "last_hidden") if offline else ()):
            if column not in ds.column_names:
                why = " (offline training needs the target's states: distill with --dump-features)" if offline else ""
                raise SpecdecError(f"{path}: no column {column!r}{why}")
        table = ds.data
        self.ids = _Ragged(table.column("input_ids"))
        self.mask = _Ragged(table.column("loss_mask"))
        if not np.array_equal(self.ids.lengths(), self.mask.lengths()):
            raise SpecdecError(f"{path}: input_ids and loss_mask differ in length")
        self.hidden = self.last = None
        self.hidden_size = self.num_taps = None
        if offline:
            hidden_shape = ds.features["hidden"].shape
            last_shape = ds.features["last_hidden"].shape
            if len(hidden_shape) != 3 or len(last_shape) != 2 or hidden_shape[1] != 3 or hidden_shape[2] != last_shape[1]:
                raise SpecdecError(f"{path}: hidden {hidden_shape} / last_hidden {last_shape} are not [len, 3, H] / [len, H]")
            self.num_taps, self.hidden_size = hidden_shape[1], hidden_shape[2]
            self.hidden = _Ragged(table.column("hidden"), (3, self.hidden_size))
            self.last = _Ragged(table.column("last_hidden"), (self.hidden_size,))
            if not np.array_equal(self.hidden.lengths(), self.ids.lengths()):
                raise SpecdecError(f"{path}: hidden and input_ids differ in length")
            self.feature_dtype = self.hidden.chunks[0][1].dtype if self.hidden.chunks else np.float16
        if not 0 <= eval_rows < self.num_rows:
            raise SpecdecError(f"--eval-rows {eval_rows}: the dataset has {self.num_rows} rows, at least one must be left "
                               "to train on")
        held_out = np.random.default_rng([seed, HOLDOUT_STREAM]).permutation(self.num_rows)[:eval_rows]
        self.eval_index = np.sort(held_out)
        self.train_index = np.setdiff1d(np.arange(self.num_rows), held_out)
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def check_target(self, fingerprint: str, vocab_size: int, hidden_size: int) -> None:
        if self.manifest.fingerprint != fingerprint:
            raise SpecdecError(f"{self.path}: distilled from target {self.manifest.fingerprint}, this target is "
                               f"{fingerprint} (pass the --target the data was made with)")
        if self.offline and self.hidden_size != hidden_size:
            raise SpecdecError(f"{self.path}: features of width {self.hidden_size}, the target's hidden size is {hidden_size}")
        for values, _ in self.ids.all_values():
            if len(values) and (values.min() < 0 or values.max() >= vocab_size):
                raise SpecdecError(f"{self.path}: token ids outside the target's vocabulary of {vocab_size}")

    def response_token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each target id occurs where loss_mask is 1 in a training row: what the head learns to predict."""
        ids = np.concatenate([v for v, _ in self.ids.all_values()])
        mask = np.concatenate([v for v, _ in self.mask.all_values()]).astype(bool)
        if len(self.eval_index):
            row_of_token = np.repeat(np.arange(self.num_rows), self.ids.lengths())
            mask &= ~np.isin(row_of_token, self.eval_index)
        return np.bincount(ids[mask].astype(np.int64), minlength=vocab_size)[:vocab_size]

    # -- order ------------------------------------------------------------------------------------------

    def permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 4:
                self._perm_cache.clear()
            self._perm_cache[key] = np.random.default_rng([seed, epoch]).permutation(len(self.train_index))
        return self._perm_cache[key]

    def rows_of_step(self, seed: int, step: int, global_batch: int) -> np.ndarray:
        n = len(self.train_index)
        positions = step * global_batch + np.arange(global_batch, dtype=np.int64)
        return np.asarray([self.train_index[self.permutation(seed, int(p // n))[p % n]] for p in positions])

    def eval_batches(self, global_batch: int) -> list[np.ndarray]:
        """The held-out rows in batches of `global_batch`, the last one filled up with -1 (empty rows)."""
        return self.padded_batches(self.eval_index, global_batch)

    @staticmethod
    def padded_batches(index: np.ndarray, global_batch: int) -> list[np.ndarray]:
        """Rows `index` in batches of `global_batch`, the last one filled up with -1 (empty rows)."""
        filled = np.full(-(-len(index) // global_batch) * global_batch, -1, np.int64)
        filled[: len(index)] = index
        return list(filled.reshape(-1, global_batch))

    # -- batches ----------------------------------------------------------------------------------------

    def batch(self, rows, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
        """tokens [b, seq_len] int32; mask [b, seq_len] bool (loss_mask, real tokens only); valid [b, seq_len]
        bool (real tokens); offline also taps [b, seq_len, 3, H] and last [b, seq_len, H] in the stored dtype.
        A row id of -1 gives an empty row (padding only, nothing counted)."""
        b = len(rows)
        tokens = np.full((b, seq_len), pad_id, np.int32)
        mask = np.zeros((b, seq_len), bool)
        valid = np.zeros((b, seq_len), bool)
        out = {"tokens": tokens, "mask": mask, "valid": valid}
        if self.offline:
            out["taps"] = taps = np.zeros((b, seq_len, 3, self.hidden_size), self.feature_dtype)
            out["last"] = last = np.zeros((b, seq_len, self.hidden_size), self.feature_dtype)
        for i, r in enumerate(rows):
            if r < 0:
                continue
            ids = self.ids.row(int(r), seq_len)
            n = len(ids)
            tokens[i, :n] = ids
            mask[i, :n] = self.mask.row(int(r), seq_len) != 0
            valid[i, :n] = True
            if self.offline:
                taps[i, :n] = self.hidden.row(int(r), seq_len)
                last[i, :n] = self.last.row(int(r), seq_len)
        return out


class Prefetcher:
    """Host batches of steps start..stop-1 built on a background thread, `depth` ahead of the training loop,
    so reading features overlaps the device's work. `make(step)` must be a pure function of the step."""

    def __init__(self, make, start: int, stop: int, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, start, stop), daemon=True)
        self._thread.start()

    def _run(self, make, start, stop):
        for step in range(start, stop):
            if self._stop.is_set():
                return
            try:
                item = (step, make(step), None)
            except BaseException as e:  # noqa: BLE001 - re-raised on the consumer's thread
                item = (step, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def get(self, step: int):
        got, batch, error = self._queue.get()
        if error is not None:
            raise error
        assert got == step, (got, step)
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
