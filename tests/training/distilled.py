"""Tiny distilled datasets for the training tests (fixtures in conftest.py), built here from the tiny random Gemma 3 target
(vocab 512, hidden 64, 6 layers): random prompts continued greedily by the target itself (what `specdec
distill` writes), with and without the target's states for offline training."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec.drafters.eagle3 import default_aux_layer_ids, engine_taps
from specdec.models import gemma_jax
from specdec.models.checkpoint import checkpoint_fingerprint

ROWS = 48
PROMPT = (4, 12)  # prompt lengths drawn from this range
RESPONSE = (28, 44)
WIDTH = PROMPT[1] + RESPONSE[1]


def greedy_rows(path, rows=ROWS, seed=0):
    """[(input_ids, loss_mask)]: random prompts and the target's greedy continuations."""
    cfg, params = gemma_jax.load_params(path, jnp.float32)
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(*PROMPT, rows)
    response_len = rng.integers(*RESPONSE, rows)
    tokens = np.zeros((rows, WIDTH), np.int32)
    for r in range(rows):
        tokens[r, : prompt_len[r]] = rng.integers(3, cfg.vocab_size, prompt_len[r])
    positions = jnp.broadcast_to(jnp.arange(WIDTH, dtype=jnp.int32), tokens.shape)

    @jax.jit
    def next_tokens(tokens):
        cache = gemma_jax.init_cache(cfg, rows, 1, 0, jnp.float32)
        logits, _, _ = gemma_jax.forward(params, cfg, tokens, positions, cache)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    for t in range(PROMPT[0], WIDTH):
        greedy = np.asarray(next_tokens(jnp.asarray(tokens)))[:, t - 1]
        grow = (t >= prompt_len) & (t < prompt_len + response_len)
        tokens[grow, t] = greedy[grow]
    out = []
    for r in range(rows):
        n = prompt_len[r] + response_len[r]
        mask = np.r_[np.zeros(prompt_len[r], np.int8), np.ones(response_len[r], np.int8)]
        out.append((tokens[r, :n].copy(), mask))
    return out


def target_states(path, rows, aux_layer_ids=None):
    """Per row: (hidden [len, 3, H], last_hidden [len, H]) float32, one forward over the whole row."""
    cfg, params = gemma_jax.load_params(path, jnp.float32)
    aux = aux_layer_ids or default_aux_layer_ids(cfg.num_layers)
    layers = engine_taps(aux) + (cfg.num_layers - 1,)
    tokens = np.zeros((len(rows), WIDTH), np.int32)
    for r, (ids, _) in enumerate(rows):
        tokens[r, : len(ids)] = ids
    cache = gemma_jax.init_cache(cfg, len(rows), WIDTH, 0, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(WIDTH, dtype=jnp.int32), tokens.shape)
    forward = jax.jit(lambda p, t, c: gemma_jax.forward(p, cfg, t, positions, c, hidden_layers=layers)[1])
    hidden = np.asarray(forward(params, jnp.asarray(tokens), cache))
    return [(hidden[r, : len(ids), :-1], hidden[r, : len(ids), -1]) for r, (ids, _) in enumerate(rows)], aux


def write_dataset(out, rows, target, features=None, fingerprint=None):
    """A save_to_disk directory in specdec distill's layout, with its manifest. features: None, "float32"
    or "float16" (the target's states stored for offline training)."""
    import datasets

    datasets.disable_progress_bars()
    spec = {"input_ids": datasets.List(datasets.Value("int32")), "loss_mask": datasets.List(datasets.Value("int8"))}
    columns = {"input_ids": [ids for ids, _ in rows], "loss_mask": [m for _, m in rows]}
    aux = None
    if features:
        states, aux = target_states(target, rows)
        H = states[0][1].shape[-1]
        spec["hidden"] = datasets.Array3D((None, 3, H), features)
        spec["last_hidden"] = datasets.Array2D((None, H), features)
        columns["hidden"] = [h.astype(features) for h, _ in states]
        columns["last_hidden"] = [last.astype(features) for _, last in states]
    datasets.Dataset.from_dict(columns, features=datasets.Features(spec)).save_to_disk(str(out))
    manifest = {"format": "specdec-distill/1",
                "target": {"path": str(target), "fingerprint": fingerprint or checkpoint_fingerprint(target)},
                "settings": {"aux_layer_ids": list(aux) if aux else None}}
    (Path(out) / "manifest.json").write_text(json.dumps(manifest))
    return Path(out)


def base_config(data, out, target, **overrides):
    """The settings every training test shares (one compiled train step for all of them): 30 steps of 8
    sequences of 48 tokens, 3 TTT steps, a draft vocabulary of 256 of the target's 512 ids; shorter runs
    stop early (`stop_after`), as a killed run would."""
    from specdec.training.config import TrainConfig

    settings = dict(data=str(data), out=str(out), target=str(target), steps=30, batch_size=8, seq_len=48, lr=3e-3,
                    warmup=3, ttt_steps=3, draft_vocab_size=256, save_every=3, keep=20, log_every=3)
    return TrainConfig(**{**settings, **overrides})


def read_train_log(out):
    return [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]


def read_eval_log(out):
    return [json.loads(line) for line in (Path(out) / "eval_log.jsonl").read_text().splitlines()]
