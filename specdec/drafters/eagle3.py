"""EAGLE-3 draft heads (Li et al., 2025): the head's config, its draft vocabulary, its checkpoints, and the drafter
that runs it. The math is written once per framework: `eagle3_jax` (training, and drafting in the JAX engine) and
`eagle3_torch` (drafting in the PyTorch engine).

A head directory is written in the speculators format (the `speculators` package's Eagle3SpeculatorConfig and
Eagle3DraftModel weights, which vLLM reads on its own); the older EAGLE layout (`LlamaForCausalLMEagle3`, as
SGLang's loader reads it) is read too. The head:
  fc                   Linear(3 Ht -> H): fuses the target's hidden states at three layers (the inputs of
                       `aux_layer_ids`, vLLM's `eagle_aux_hidden_state_layer_ids`: default 2, L/2, L-3)
  layers.0             one Llama decoder layer (`midlayer` in the older layout, and in `params` here) whose attention
                       reads [input_layernorm(embedding) || hidden_norm(hidden)] (2H); the residual is the hidden
                       input (speculators' norm_before_residual false)
  norm, lm_head        over a reduced draft vocabulary; d2t[i] = target id of draft id i, minus i; t2d marks
                       the target ids in it (neither is stored for a full vocabulary)
The token embedding is the target's (not stored). H must equal the target's hidden size.

A P-EAGLE head (speculators' `peagle`, which vLLM runs as eagle3 with `parallel_drafting`) is the same head trained
to propose all k drafts in one forward: after the rows it catches up on come k-1 mask rows, each the embedding of
`mask_token_id` paired with the feature fc(mask_hidden) (mask_hidden [1, 3 Ht]: a learned stand-in for the target's
three hidden states), and the row at the last real position + j proposes draft j + 1.

Alignment, the same in training and drafting: the head's input at position t pairs the target's feature
of position t with the token at t+1, and predicts the token at t+2. Drafting further feeds the head its own
output (before the final norm) in place of the feature, one position on per draft.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError
from specdec.protocol import DEFAULT_DRAFTS

DEFAULT_DRAFT_VOCAB = 32000
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format save_head writes
# transformers' LlamaConfig defaults: what a speculators transformer_layer_config (a diff against them) leaves out.
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-6, "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0}


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose *inputs* the head fuses (low, mid, high), in vLLM's convention
    (`eagle_aux_hidden_state_layer_ids`): 2, L/2, L-3. Layer i's input is the output of layer i-1, which
    is what the engines' `hidden_layers` (states after a layer) return: see `engine_taps`."""
    return (2, num_layers // 2, num_layers - 3)


def engine_taps(aux_layer_ids) -> tuple[int, ...]:
    """The engines' hidden_layers (states after a layer) that give the inputs of the aux layers."""
    return tuple(i - 1 for i in aux_layer_ids)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 131072
    target_fingerprint: str | None = None  # specdec.models.checkpoint.checkpoint_fingerprint of the target
    mask_token_id: int | None = None  # set: a P-EAGLE head, drafting in parallel (module docstring)

    @classmethod
    def for_target(cls, target_cfg, draft_vocab_size: int = DEFAULT_DRAFT_VOCAB, aux_layer_ids=None,
                   fingerprint: str | None = None, **overrides) -> "Eagle3Config":
        """A head sized like the target's layers (hidden size, heads, head dim, MLP width)."""
        aux = tuple(aux_layer_ids or default_aux_layer_ids(target_cfg.num_layers))
        cfg = cls(hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
                  num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
                  head_dim=target_cfg.head_dim, vocab_size=target_cfg.vocab_size,
                  draft_vocab_size=min(draft_vocab_size, target_cfg.vocab_size), aux_layer_ids=aux,
                  target_num_layers=target_cfg.num_layers, rms_norm_eps=target_cfg.rms_norm_eps,
                  target_fingerprint=fingerprint)
        cfg = dataclasses.replace(cfg, **overrides)
        cfg.check()
        return cfg

    def check(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise SpecdecError(f"an EAGLE-3 head fuses 3 target layers, got {list(self.aux_layer_ids)}")
        for i in self.aux_layer_ids:
            if not 1 <= i < self.target_num_layers:
                raise SpecdecError(f"aux layer {i} outside 1..{self.target_num_layers - 1} of the target")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise SpecdecError(f"draft vocabulary of {self.draft_vocab_size} outside 1..{self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise SpecdecError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise SpecdecError(f"mask_token_id {self.mask_token_id} outside the target vocabulary of {self.vocab_size}")

    @property
    def parallel(self) -> bool:
        """Whether the head drafts all its tokens in one forward (P-EAGLE)."""
        return self.mask_token_id is not None

    @property
    def taps(self) -> tuple[int, ...]:
        return engine_taps(self.aux_layer_ids)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the head, under the older EAGLE layout's names (`midlayer.`), with its shape."""
        H, I, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        return {
            "fc.weight": (H, 3 * H),
            "midlayer.input_layernorm.weight": (H,),
            "midlayer.hidden_norm.weight": (H,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * H),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
            "midlayer.self_attn.o_proj.weight": (H, q),
            "midlayer.post_attention_layernorm.weight": (H,),
            "midlayer.mlp.gate_proj.weight": (I, H),
            "midlayer.mlp.up_proj.weight": (I, H),
            "midlayer.mlp.down_proj.weight": (H, I),
            "norm.weight": (H,),
            "lm_head.weight": (self.draft_vocab_size, H),
            **({"mask_hidden": (1, 3 * H)} if self.parallel else {}),
        }

    def to_json(self) -> dict:
        """config.json in the speculators format (Eagle3SpeculatorConfig: vLLM takes a directory with
        `speculators_model_type` as such), plus specdec's own keys. No verifier is named: the head records its
        target by fingerprint."""
        layer = {
            "model_type": "llama", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            # transformers 5 reads rope_parameters, earlier releases rope_theta
            "rope_theta": self.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        greedy = {"proposal_type": "greedy", "speculative_tokens": DEFAULT_DRAFTS, "verifier_accept_k": 1,
                  "accept_tolerance": 0.0}
        algorithm = "peagle" if self.parallel else "eagle3"
        return {
            "architectures": ["PEagleDraftModel" if self.parallel else "Eagle3DraftModel"],
            "speculators_model_type": algorithm,
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {"algorithm": algorithm, "proposal_methods": [greedy], "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": None, "architectures": []}},
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            # vLLM takes a missing norm_before_residual as true: say it
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "dtype": "float32",
            "specdec": {"target_num_layers": self.target_num_layers, "target_fingerprint": self.target_fingerprint},
            **({"mask_token_id": self.mask_token_id} if self.parallel else {}),
        }

    @classmethod
    def from_json(cls, raw: dict, source: str = "config.json") -> "Eagle3Config":
        """A head's config.json: the speculators format, or the older EAGLE layout (`LlamaForCausalLMEagle3`)."""
        if "speculators_model_type" in raw:
            return cls.from_speculators(raw, source)
        if "LlamaForCausalLMEagle3" not in raw.get("architectures", []):
            raise SpecdecError(f"{source}: not an EAGLE-3 head (architectures {raw.get('architectures')})")
        try:
            own = raw.get("specdec", {})
            aux = raw.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_config", {}).get(
                "eagle_aux_hidden_state_layer_ids")
            heads = raw["num_attention_heads"]
            cfg = cls(
                hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_heads=heads,
                num_kv_heads=raw.get("num_key_value_heads", heads),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
                draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
                aux_layer_ids=tuple(aux) if aux else (),
                target_num_layers=own.get("target_num_layers") or raw.get("target_layer_count") or 0,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
                max_position_embeddings=raw.get("max_position_embeddings", 131072),
                target_fingerprint=own.get("target_fingerprint"),
            )
        except KeyError as e:
            raise SpecdecError(f"{source}: missing key {e.args[0]!r}") from None
        if raw.get("target_hidden_size", cfg.hidden_size) != cfg.hidden_size:
            raise SpecdecError(f"{source}: target_hidden_size differs from hidden_size (specdec shares the target's embedding)")
        return cfg

    @classmethod
    def from_speculators(cls, raw: dict, source: str) -> "Eagle3Config":
        """A speculators Eagle3SpeculatorConfig, refused in one line where it asks for what this head does not
        compute (another decoder layer, extra norms, its own trained embedding...)."""
        if raw["speculators_model_type"] not in ("eagle3", "peagle"):
            raise SpecdecError(f"{source}: a speculators {raw['speculators_model_type']!r} model; specdec runs eagle3 "
                               "and peagle heads")
        if raw["speculators_model_type"] == "peagle" and not isinstance(raw.get("mask_token_id"), int):
            raise SpecdecError(f"{source}: a peagle head needs an integer mask_token_id")
        layer = LLAMA_DEFAULTS | {"model_type": "qwen3"} | (raw.get("transformer_layer_config") or {})  # qwen3: speculators' default
        rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": layer["rope_theta"]}
        heads = layer["num_attention_heads"]
        hidden = layer["hidden_size"]
        what_we_run = {
            "transformer_layer_config.model_type": (layer["model_type"], "llama"),
            "transformer_layer_config.num_hidden_layers": (layer["num_hidden_layers"], 1),
            "transformer_layer_config.hidden_act": (layer["hidden_act"], "silu"),
            "transformer_layer_config.attention_bias": (layer["attention_bias"], False),
            "transformer_layer_config.mlp_bias": (layer["mlp_bias"], False),
            "transformer_layer_config.rope_scaling": (layer.get("rope_scaling"), None),
            "the RoPE type": (rope.get("rope_type", "default"), "default"),
            "target_hidden_size": (raw.get("target_hidden_size") or hidden, hidden),
            **{flag: (raw.get(flag, False), False)
               for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad")},
        }
        for what, (theirs, ours) in what_we_run.items():
            if theirs != ours:
                raise SpecdecError(f"{source}: {what} {theirs!r} (specdec's EAGLE-3 head runs {ours!r} only)")
        own = raw.get("specdec", {})
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden, intermediate_size=layer["intermediate_size"], num_heads=heads,
            num_kv_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or hidden // heads,
            vocab_size=layer["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size", DEFAULT_DRAFT_VOCAB),
            aux_layer_ids=tuple(aux) if aux else (), target_num_layers=own.get("target_num_layers") or 0,
            rms_norm_eps=layer["rms_norm_eps"], rope_theta=rope.get("rope_theta", layer["rope_theta"]),
            max_position_embeddings=layer["max_position_embeddings"], target_fingerprint=own.get("target_fingerprint"),
            mask_token_id=raw.get("mask_token_id") if raw["speculators_model_type"] == "peagle" else None,
        )

    def check_target(self, target_cfg, fingerprint: str | None, source: str) -> None:
        """Refuse a head trained for another target, naming what differs."""
        theirs = {"hidden size": target_cfg.hidden_size, "vocabulary": target_cfg.vocab_size}
        ours = {"hidden size": self.hidden_size, "vocabulary": self.vocab_size}
        if self.target_num_layers:
            theirs["layers"], ours["layers"] = target_cfg.num_layers, self.target_num_layers
        for what in theirs:
            if theirs[what] != ours[what]:
                raise SpecdecError(f"{source}: head trained for a target with {what} {ours[what]}, this target has {theirs[what]}")
        if max(self.aux_layer_ids) >= target_cfg.num_layers:
            raise SpecdecError(f"{source}: aux layers {list(self.aux_layer_ids)} outside the target's {target_cfg.num_layers} layers")
        if self.target_fingerprint and fingerprint and self.target_fingerprint != fingerprint:
            raise SpecdecError(f"{source}: head trained for target checkpoint {self.target_fingerprint}, this target is {fingerprint}")


# -- the draft vocabulary -------------------------------------------------------------------------------


def build_draft_vocab(token_counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The `draft_vocab_size` most frequent target tokens (ties and unseen fill: lowest id first), sorted by
    id -> (d2t [Vd] int64: target id minus draft id, t2d [V] bool). token_counts [V] counts the tokens the
    head learns to predict (the target's own outputs)."""
    counts = np.asarray(token_counts, np.int64)
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id
    chosen = np.sort(order[:draft_vocab_size])
    t2d = np.zeros(len(counts), bool)
    t2d[chosen] = True
    return (chosen - np.arange(len(chosen))).astype(np.int64), t2d


def draft_to_target(d2t: np.ndarray) -> np.ndarray:
    """Draft id -> target id [Vd]."""
    return np.arange(len(d2t), dtype=np.int64) + d2t


# -- checkpoints ------------------------------------------------------------------------------------------


def save_head(path: str | Path, cfg: Eagle3Config, params: dict, d2t: np.ndarray, t2d: np.ndarray) -> Path:
    """Write a head directory (config.json + model.safetensors in the speculators format; the same files are
    specdec's own), atomically: a temporary directory renamed into place."""
    import os
    import shutil
    import tempfile

    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    tensors = {name.replace("midlayer.", "layers.0."): np.ascontiguousarray(np.asarray(params[name], np.float32))
               for name in cfg.shapes()}
    if cfg.draft_vocab_size < cfg.vocab_size:  # speculators keeps no mapping for a full vocabulary
        tensors["d2t"] = np.asarray(d2t, np.int64)
        tensors["t2d"] = np.asarray(t2d, bool)
    save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    (tmp / CONFIG_NAME).write_text(json.dumps(cfg.to_json(), indent=2))
    if path.exists():
        old = path.with_name(path.name + ".old")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return path


@dataclass
class Eagle3Head:
    cfg: Eagle3Config
    params: dict  # numpy float32 arrays under cfg.shapes()'s names
    d2t: np.ndarray
    t2d: np.ndarray
    path: Path | None = field(default=None, compare=False)


def load_head(path: str | Path) -> Eagle3Head:
    """Read a head directory: specdec's own, one in the speculators format written elsewhere, or one in the older
    EAGLE layout (`midlayer.` in place of `layers.0.`, a `model.` prefix on the layer names). Every tensor's name
    and shape is checked; a stored embedding is not read (the target's is used); without d2t the draft
    vocabulary is the target's."""
    from specdec.models.checkpoint import numpy_views

    directory = Path(path)
    if not (directory / CONFIG_NAME).is_file():
        raise SpecdecError(f"{directory}: not an EAGLE-3 head directory (no {CONFIG_NAME})")
    try:
        raw = json.loads((directory / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{directory / CONFIG_NAME}: not JSON ({e})") from None
    cfg = Eagle3Config.from_json(raw, str(directory / CONFIG_NAME))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"{directory}: no safetensors file")
    stored: dict[str, np.ndarray] = {}
    for file in files:
        for name, tensor in numpy_views(file).items():
            stored[name.removeprefix("model.").replace("layers.0.", "midlayer.")] = tensor
    params = {}
    for name, shape in cfg.shapes().items():
        if name not in stored:
            raise SpecdecError(f"{directory}: missing tensor {name!r}")
        if tuple(stored[name].shape) != shape:
            raise SpecdecError(f"{directory}: tensor {name!r} has shape {tuple(stored[name].shape)}, config expects {shape}")
        params[name] = stored[name].astype(np.float32)
    if "d2t" in stored:
        d2t = stored["d2t"].astype(np.int64)
        if d2t.shape != (cfg.draft_vocab_size,):
            raise SpecdecError(f"{directory}: d2t has shape {d2t.shape}, expected ({cfg.draft_vocab_size},)")
    elif cfg.draft_vocab_size == cfg.vocab_size:
        d2t = np.zeros(cfg.vocab_size, np.int64)
    else:
        raise SpecdecError(f"{directory}: a draft vocabulary of {cfg.draft_vocab_size} needs a d2t tensor")
    ids = draft_to_target(d2t)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise SpecdecError(f"{directory}: d2t maps draft ids outside the target vocabulary of {cfg.vocab_size}")
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[ids] = True
    return Eagle3Head(cfg, params, d2t, t2d, directory)


def random_head(cfg: Eagle3Config, seed: int = 0, d2t: np.ndarray | None = None) -> Eagle3Head:
    """A head of random weights (tests; the start of training): normal(0, 0.02) linears, unit norms."""
    rng = np.random.default_rng(seed)
    params = {name: (np.ones(shape, np.float32) if name.endswith("norm.weight")
                     else (0.02 * rng.standard_normal(shape)).astype(np.float32))
              for name, shape in cfg.shapes().items()}
    if d2t is None:  # the first draft_vocab_size target ids
        d2t = np.zeros(cfg.draft_vocab_size, np.int64)
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[draft_to_target(d2t)] = True
    return Eagle3Head(cfg, params, d2t, t2d)


# -- the drafter ----------------------------------------------------------------------------------------


def load_for_target(path: str | Path, target_cfg, fingerprint: str | None) -> Eagle3Head:
    """A head checked against the target it is to draft for. One that names no target layers reads the defaults
    for this target, as vLLM and speculators take it."""
    head = load_head(path)
    if not head.cfg.aux_layer_ids:
        head.cfg = dataclasses.replace(head.cfg, aux_layer_ids=default_aux_layer_ids(target_cfg.num_layers))
    head.cfg.check_target(target_cfg, fingerprint, str(path))
    return head
