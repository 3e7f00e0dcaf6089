"""The settings of an EAGLE-3 training run: one dataclass, loadable from YAML, overridden by flags, and saved
resolved (defaults filled in, the target's path and aux layers made explicit) with every checkpoint.

Precedence: the dataclass defaults < `--config FILE.yaml` < command-line flags. YAML keys are the field
names (`batch_size` or `batch-size`); an unknown key or a value of the wrong type is a one-line error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError

WANDB_MODES = ("online", "offline", "disabled")
DTYPES = ("float32", "bfloat16")

# Fields that change how a run is watched or where it runs, not what it computes: a checkpoint of a run
# that differs only in these resumes. (`devices` too: more devices split the same global batch.)
OPERATIONAL = frozenset({
    "out", "save_every", "keep", "log_every", "wandb_project", "wandb_mode", "wandb_run_name", "devices",
    "coordinator_address", "num_processes", "process_id", "target", "eval_every",
})


@dataclass
class TrainConfig:
    data: str | None = None  # a distilled dataset directory (datasets save_to_disk + manifest.json)
    out: str | None = None  # checkpoints/, head/ (the exported head) and the run's log
    target: str | None = None  # the target checkpoint directory; None: the embedded Gemma 3 270M
    steps: int = 2000  # optimizer steps
    batch_size: int = 8  # sequences per step, over all devices and hosts
    seq_len: int = 2048  # sequences are truncated / padded to this many tokens
    lr: float = 1e-4  # peak learning rate
    warmup: int = 100  # linear warmup steps, then cosine decay to min_lr_ratio * lr at `steps`
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01  # AdamW's, on matrices (not on norm weights)
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0  # global gradient-norm clipping (0: off)
    ttt_steps: int = 7  # training-time-test steps unrolled
    parallel_drafting: bool = False  # a P-EAGLE head: steps after the first read mask rows (specdec train peagle)
    step_weight_decay: float = 0.8  # step j's loss is weighted step_weight_decay ** j
    draft_vocab_size: int = 32000  # capped at the target's vocabulary
    aux_layer_ids: list[int] | None = None  # vLLM's convention; None: the data's, else 2, L/2, L-3
    offline: bool = False  # read the target's states from the dataset instead of running the target
    # The head's matmuls (its params and optimizer state stay float32) and the frozen target's weights;
    # None: bfloat16 on accelerators, float32 on CPU (resolved so in the saved config).
    compute_dtype: str | None = None
    target_dtype: str | None = None
    seed: int = 0  # head initialisation, the held-out rows and the data order (a permutation per epoch)
    eval_rows: int = 0  # rows of the data held out from training, on which the head is evaluated
    eval_every: int | None = None  # steps between evaluations of the held-out rows; None: at every checkpoint
    save_every: int = 500
    keep: int = 3  # checkpoints kept (the newest)
    log_every: int = 10  # steps between host syncs for the progress bar and wandb
    wandb_project: str | None = None  # set: log to Weights & Biases
    wandb_mode: str | None = None  # online | offline | disabled (None: wandb's own default / WANDB_MODE)
    wandb_run_name: str | None = None
    devices: int | None = None  # local devices to use for data parallelism; None: all
    coordinator_address: str | None = None  # multi-host: jax.distributed.initialize(...)
    num_processes: int | None = None
    process_id: int | None = None

    def check(self) -> None:
        if not self.data:
            raise SpecdecError("no training data: pass --data DIR (or `data:` in the config file)")
        if not self.out:
            raise SpecdecError("no output directory: pass --out DIR (or `out:` in the config file)")
        positive = ("steps", "batch_size", "ttt_steps", "draft_vocab_size", "save_every", "keep", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise SpecdecError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.eval_rows < 0:
            raise SpecdecError(f"--eval-rows must be >= 0, got {self.eval_rows}")
        if self.eval_every is not None and self.eval_every < 1:
            raise SpecdecError(f"--eval-every must be >= 1, got {self.eval_every}")
        if self.seq_len < 3:
            raise SpecdecError(f"--seq-len must be >= 3, got {self.seq_len}")
        if not self.lr > 0:
            raise SpecdecError(f"--lr must be > 0, got {self.lr}")
        for name in ("warmup", "weight_decay", "clip", "min_lr_ratio"):
            if getattr(self, name) < 0:
                raise SpecdecError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.warmup and self.warmup >= self.steps:
            raise SpecdecError(f"--warmup ({self.warmup}) must be below --steps ({self.steps})")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise SpecdecError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if not 0 < self.step_weight_decay <= 1:
            raise SpecdecError(f"step_weight_decay must lie in (0, 1], got {self.step_weight_decay}")
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise SpecdecError(f"--wandb-mode {self.wandb_mode!r}: choose from {', '.join(WANDB_MODES)}")
        for name in ("compute_dtype", "target_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise SpecdecError(f"{flag(name)} {value!r}: choose from {', '.join(DTYPES)}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise SpecdecError(f"aux layers: an EAGLE-3 head fuses 3 target layers, got {list(self.aux_layer_ids)}")
        if self.devices is not None and self.devices < 1:
            raise SpecdecError(f"--devices must be >= 1, got {self.devices}")
        multi = (self.coordinator_address, self.num_processes, self.process_id)
        if any(v is not None for v in multi) and any(v is None for v in multi):
            raise SpecdecError("multi-host training needs all of --coordinator-address, --num-processes and --process-id")

    # -- YAML -----------------------------------------------------------------------------------------

    @classmethod
    def load(cls, yaml_path: str | Path | None = None, **overrides) -> "TrainConfig":
        """Defaults < the YAML file < overrides (None values are ignored: flags not given)."""
        values = _checked(read_yaml(yaml_path), str(yaml_path)) if yaml_path is not None else {}
        values.update(_checked({k: v for k, v in overrides.items() if v is not None}, "flags"))
        return cls(**values)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "TrainConfig":
        return cls(**_checked(raw, source))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def identity(self) -> dict[str, Any]:
        """What the run computes: two configs equal here train the same parameters."""
        return {k: v for k, v in self.to_dict().items() if k not in OPERATIONAL}

    def differences(self, other: "TrainConfig") -> list[str]:
        mine, theirs = self.identity(), other.identity()
        return [f"{k}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in mine if mine.get(k) != theirs.get(k)]


def _checked(raw: dict, source: str) -> dict:
    known = {f.name: f for f in fields(TrainConfig)}
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise SpecdecError(f"{source}: unknown key {key!r} (known: {', '.join(known)})")
        values[name] = _coerce(name, value, known[name].type, source)
    return values


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def read_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecdecError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{path}: cannot read ({e})") from None
    except yaml.YAMLError as e:
        raise SpecdecError(f"{path}: not YAML ({' '.join(str(e).split())})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SpecdecError(f"{path}: expected a mapping of settings, got {type(raw).__name__}")
    return raw


def _coerce(name: str, value, annotation: str, source: str):
    """A YAML / flag value checked against the field's annotation (a string: `from __future__ import
    annotations`)."""
    if value is None:
        if "None" in annotation:
            return None
        raise SpecdecError(f"{source}: {name} cannot be null")
    base = annotation.replace(" | None", "")
    bad = SpecdecError(f"{source}: {name} must be {base}, got {value!r}")
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise bad
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return int(value)
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if base == "str":
        if isinstance(value, Path):
            return str(value)
        if not isinstance(value, str):
            raise bad
        return value
    if base == "list[int]":
        if isinstance(value, str):
            try:
                value = [int(v) for v in value.split(",")]
            except ValueError:
                raise bad from None
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise bad
        return [int(v) for v in value]
    raise AssertionError(f"unhandled annotation {annotation}")  # a new field of another type
