"""Training checkpoints: everything a run needs to continue exactly, and export to a head directory.

OUT/checkpoints/step_00000500/
  state.safetensors   params/<name>        the head's float32 parameters (the EAGLE names, eagle3.Eagle3Config.shapes)
                      opt_state/<path>     every leaf of the optax state, named by jax.tree_util.keystr of its
                                           path in the pytree (e.g. "[1][0].mu['fc.weight']", "[1][0].count";
                                           scalars as shape [1]: safetensors has no 0-d tensors)
                      d2t, t2d             the draft vocabulary (eagle3.build_draft_vocab)
                      metadata: format, step, data_position (samples consumed), seed, target_fingerprint,
                                data_rows (the dataset's, so that a changed dataset is not resumed)
  config.yaml         the resolved TrainConfig
  head_config.json    the head's config.json (eagle3.Eagle3Config.to_json)

A checkpoint is written to a temporary directory beside the others and renamed into place (os.replace), so
a kill leaves either the whole checkpoint or none; the newest `keep` are kept. The train step has no
randomness of its own and the data order is a function of (seed, step) (specdec.training.data), so
(params, optimizer state, step) plus the config is the whole state of a run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.drafters.eagle3 import Eagle3Config
from specdec.errors import SpecdecError
from specdec.training.config import TrainConfig

FORMAT = "specdec-eagle3-train/1"
STATE = "state.safetensors"
CONFIG = "config.yaml"
HEAD_CONFIG = "head_config.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def host_array(x) -> np.ndarray:
    """A (replicated) device array on the host; on several hosts, this host's copy."""
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def flatten_state(params: dict, opt_state) -> dict[str, np.ndarray]:
    import jax

    tensors = {f"params/{name}": host_array(v) for name, v in params.items()}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        tensors[f"opt_state/{jax.tree_util.keystr(path)}"] = host_array(leaf)
    return tensors


def save_checkpoint(out: str | Path, step: int, params: dict, opt_state, d2t, t2d, head_cfg: Eagle3Config,
                    cfg: TrainConfig, data_position: int, keep: int, data_rows: int = 0) -> Path:
    from safetensors.numpy import save_file

    root = checkpoints_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        tensors = {k: np.ascontiguousarray(v) for k, v in flatten_state(params, opt_state).items()}
        tensors["d2t"] = np.asarray(d2t, np.int64)
        tensors["t2d"] = np.asarray(t2d, bool)
        metadata = {"format": FORMAT, "step": str(step), "data_position": str(data_position), "seed": str(cfg.seed),
                    "target_fingerprint": head_cfg.target_fingerprint or "", "data_rows": str(data_rows)}
        save_file(tensors, str(tmp / STATE), metadata=metadata)
        (tmp / CONFIG).write_text(cfg.to_yaml())
        (tmp / HEAD_CONFIG).write_text(json.dumps(head_cfg.to_json(), indent=2))
        if final.exists():  # the same step saved again (a resumed run's last step): replace it whole
            old = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in list_checkpoints(out)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(out: str | Path) -> list[Path]:
    """Complete checkpoints under OUT/checkpoints, oldest first (temporary directories are skipped)."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / STATE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: str | Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint directory, or a training output directory (its newest checkpoint)."""
    path = Path(path)
    if (path / STATE).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    if not path.exists():
        raise SpecdecError(f"{path}: no such checkpoint")
    raise SpecdecError(f"{path}: not a training checkpoint (no {STATE}, no checkpoints/step_*)")


@dataclass
class Checkpoint:
    path: Path
    step: int
    data_position: int
    config: TrainConfig
    head_cfg: Eagle3Config
    params: dict[str, np.ndarray]
    opt_leaves: dict[str, np.ndarray]
    d2t: np.ndarray
    t2d: np.ndarray
    target_fingerprint: str | None
    data_rows: int  # rows of the dataset the run read (0: not recorded)


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check a checkpoint (or a training output directory's newest); any fault is one SpecdecError."""
    from safetensors import SafetensorError, safe_open

    path = resolve_checkpoint_path(path)
    state = path / STATE
    try:
        with safe_open(str(state), framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise SpecdecError(f"{state}: unreadable checkpoint ({' '.join(str(e).split())})") from None
    if metadata.get("format") != FORMAT:
        raise SpecdecError(f"{state}: not a specdec EAGLE-3 training checkpoint (format {metadata.get('format')!r})")
    try:
        step, position = int(metadata["step"]), int(metadata["data_position"])
    except (KeyError, ValueError):
        raise SpecdecError(f"{state}: bad step / data_position metadata") from None
    try:
        config = TrainConfig.load(path / CONFIG)
    except SpecdecError as e:
        raise SpecdecError(f"{path}: bad training config ({e})") from None
    try:
        head_raw = json.loads((path / HEAD_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"{path / HEAD_CONFIG}: unreadable ({e})") from None
    head_cfg = Eagle3Config.from_json(head_raw, str(path / HEAD_CONFIG))
    params = {k.removeprefix("params/"): v for k, v in tensors.items() if k.startswith("params/")}
    expected = head_cfg.shapes()
    if set(params) != set(expected):
        missing, extra = sorted(set(expected) - set(params)), sorted(set(params) - set(expected))
        raise SpecdecError(f"{state}: head tensors differ from the head config (missing {missing}, unexpected {extra})")
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape or params[name].dtype != np.float32:
            raise SpecdecError(f"{state}: {name} is {params[name].dtype}{list(params[name].shape)}, expected float32{list(shape)}")
    for name in ("d2t", "t2d"):
        if name not in tensors:
            raise SpecdecError(f"{state}: no {name} tensor")
    d2t, t2d = tensors["d2t"].astype(np.int64), tensors["t2d"].astype(bool)
    if d2t.shape != (head_cfg.draft_vocab_size,) or t2d.shape != (head_cfg.vocab_size,):
        raise SpecdecError(f"{state}: d2t/t2d shapes {d2t.shape}/{t2d.shape} do not match the head config")
    opt = {k.removeprefix("opt_state/"): v for k, v in tensors.items() if k.startswith("opt_state/")}
    return Checkpoint(path, step, position, config, head_cfg, params, opt, d2t, t2d,
                      metadata.get("target_fingerprint") or None, int(metadata.get("data_rows") or 0))


def restore_opt_state(ckpt: Checkpoint, template):
    """The optimizer state in the structure of `template` (tx.init of the same params), every leaf read from
    the checkpoint by its path; a missing, extra or reshaped leaf is a SpecdecError."""
    import jax

    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [jax.tree_util.keystr(p) for p, _ in leaves_with_path]
    if set(names) != set(ckpt.opt_leaves):
        missing, extra = sorted(set(names) - set(ckpt.opt_leaves)), sorted(set(ckpt.opt_leaves) - set(names))
        raise SpecdecError(f"{ckpt.path}: optimizer state differs from this optimizer's (missing {missing[:3]}, "
                           f"unexpected {extra[:3]})")
    leaves = []
    for name, (_, like) in zip(names, leaves_with_path):
        stored = ckpt.opt_leaves[name]
        like = host_array(like)
        if like.ndim == 0 and stored.shape == (1,):  # safetensors has no 0-d tensors: scalars are stored as [1]
            stored = stored.reshape(())
        if stored.shape != like.shape or stored.dtype != like.dtype:
            raise SpecdecError(f"{ckpt.path}: optimizer leaf {name} is {stored.dtype}{list(stored.shape)}, "
                               f"expected {like.dtype}{list(like.shape)}")
        leaves.append(stored)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def export_head(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """A training checkpoint (or a training output directory's newest) as a head directory in the speculators
    format, which vLLM reads (eagle3.save_head): config.json + model.safetensors. An earlier export in `out` is
    replaced; a directory holding other files is refused unless `overwrite`, which keeps them (specdec.output_dir)."""
    from specdec.drafters.eagle3 import CONFIG_NAME, WEIGHTS_NAME, save_head
    from specdec.output_dir import OutputDir

    output = OutputDir(out, (WEIGHTS_NAME, CONFIG_NAME), "export", "exporting", overwrite)
    ckpt = read_checkpoint(checkpoint)
    with output.writing() as staging:
        save_head(staging, ckpt.head_cfg, ckpt.params, ckpt.d2t, ckpt.t2d)
    return output.path
