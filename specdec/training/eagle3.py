"""EAGLE-3 training: the loss, the optimizer and one compiled train step.

The head (specdec.drafters.eagle3_jax) is unrolled over `ttt_steps` training-time-test steps on whole
sequences. Step j at base position t reads the token at t+1+j and predicts the token at t+2+j; its teacher
is the target's distribution at position t+1+j (the target's logits over the draft vocabulary, softmaxed).
A pair (j, t) counts when t+2+j < N, the loss mask is 1 at t+2+j (a response token, not padding) and the
target's argmax there, over its whole vocabulary, is in the draft vocabulary. The loss is
sum_j step_weight_decay**j * mean over counted t of the soft cross-entropy -sum_v p_target(v) log q_j(v).

Online the frozen target's forward runs inside the step (its taps and last state, under stop_gradient);
offline they come from the dataset. Either way the target's embedding table (the head's token embeddings),
final norm and LM head (the teacher) are the target's parameters, passed to the step as arguments. The
target's full-vocabulary argmax is taken a chunk of the LM head at a time, never as [B, N, V] logits.

`make_train_step` compiles target forward + unrolled head + loss + AdamW update as one XLA program over a
mesh with one axis "data": the batch is split over it, the parameters and optimizer state replicated
(gradients are all-reduced by GSPMD). The train state is donated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specdec.drafters import eagle3_jax as ej
from specdec.drafters.eagle3 import Eagle3Config, draft_to_target, random_head
from specdec.models import gemma_jax

ARGMAX_CHUNK = 16384  # target ids per chunk of the full-vocabulary argmax


@dataclass(frozen=True)
class LossSettings:
    ttt_steps: int = 7
    step_weight_decay: float = 0.8
    online: bool = True
    compute_dtype: str = "float32"
    argmax_chunk: int = ARGMAX_CHUNK

    @property
    def step_weights(self) -> tuple[float, ...]:
        return tuple(self.step_weight_decay**j for j in range(self.ttt_steps))


# -- the target's side: states, teacher distribution, argmax -------------------------------------------------


def target_states(tparams, tcfg, tokens, taps: tuple[int, ...]):
    """The frozen target over whole sequences from an empty cache -> (its states after the engine layers
    `taps` [B, N, 3, H], its state after the last layer [B, N, H]). The full logits are never used (XLA
    drops them) and the cache has one slot per layer kind (nothing cached is ever visible)."""
    B, N = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    dtype = tparams["embed_tokens.weight"].dtype
    cache = gemma_jax.init_cache(tcfg, B, 1, 0, dtype)
    _, hidden, _ = gemma_jax.forward(tparams, tcfg, tokens, positions, cache,
                                     hidden_layers=tuple(taps) + (tcfg.num_layers - 1,))
    return hidden[:, :, :-1], hidden[:, :, -1]


def target_argmax(tparams, tcfg, last, chunk: int = ARGMAX_CHUNK):
    """The target's greedy token [B, N] (ties: the lowest id) over its whole vocabulary, a chunk of the LM
    head at a time."""
    V = tcfg.vocab_size
    chunk = min(chunk, V)
    n = -(-V // chunk)

    def body(carry, c):
        best, arg = carry
        ids = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        logits = gemma_jax.final_logits(tparams, tcfg, last, jnp.minimum(ids, V - 1))
        logits = jnp.where(ids < V, logits, -jnp.inf)
        m = logits.max(axis=-1)
        a = jnp.argmax(logits, axis=-1).astype(jnp.int32) + c * chunk
        better = m > best  # an earlier chunk keeps ties: the lowest id wins
        return (jnp.where(better, m, best), jnp.where(better, a, arg)), None

    init = (jnp.full(last.shape[:-1], -jnp.inf, jnp.float32), jnp.zeros(last.shape[:-1], jnp.int32))
    (_, arg), _ = jax.lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return arg


def teacher(tparams, tcfg, last, draft_ids, t2d, chunk: int = ARGMAX_CHUNK):
    """-> (the target's distribution over the draft vocabulary [B, N, Vd] float32, its argmax in draft ids
    [B, N], whether its argmax over the whole vocabulary is in the draft vocabulary [B, N])."""
    last = last.astype(tparams["embed_tokens.weight"].dtype)
    logits = gemma_jax.final_logits(tparams, tcfg, last, draft_ids)
    probs = jax.nn.softmax(logits, axis=-1)
    in_vocab = t2d[target_argmax(tparams, tcfg, last, chunk)]
    return probs, jnp.argmax(logits, axis=-1).astype(jnp.int32), in_vocab


# -- the loss ---------------------------------------------------------------------------------------------


def eagle3_loss(head_params, hcfg: Eagle3Config, tcfg, tparams, vocab: dict, batch: dict, settings: LossSettings):
    """-> (the weighted loss, metrics: the loss, and per TTT step [S] step_loss, step_acc, step_count (the pairs
    counted) and step_total (the pairs predicted, counted or not: the target's argmax may lie outside the draft
    vocabulary)). `vocab` holds
    draft_ids [Vd] (target id of each draft id) and t2d [V]; `batch` tokens [B, N], mask [B, N] (loss mask
    and real token), and offline taps [B, N, 3, H] and last [B, N, H]."""
    tokens = batch["tokens"]
    if settings.online:
        taps, last = target_states(tparams, tcfg, tokens, hcfg.taps)
    else:
        taps, last = batch["taps"], batch["last"]
    taps, last = jax.lax.stop_gradient(taps), jax.lax.stop_gradient(last)
    probs, target_arg, in_vocab = jax.lax.stop_gradient(
        teacher(tparams, tcfg, last, vocab["draft_ids"], vocab["t2d"], settings.argmax_chunk))

    dtype = jnp.dtype(settings.compute_dtype)
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), head_params)
    features = ej.fuse(params, taps.astype(dtype))
    logits = ej.ttt_logits(params, hcfg, tparams["embed_tokens.weight"], tokens, features, settings.ttt_steps)

    mask = batch["mask"].astype(bool)
    losses, accs, counts, totals = [], [], [], []
    for j in range(settings.ttt_steps):
        predicted = ej.shifted(mask, j + 2)  # fill False: t+2+j >= N
        counted = predicted & ej.shifted(in_vocab, j + 1)
        p = ej.shifted(probs, j + 1)
        logq = jax.nn.log_softmax(logits[j], axis=-1)
        ce = -jnp.sum(p * logq, axis=-1)
        count = counted.sum()
        denom = jnp.maximum(count, 1).astype(jnp.float32)
        losses.append(jnp.sum(jnp.where(counted, ce, 0.0)) / denom)
        hits = (jnp.argmax(logits[j], axis=-1) == ej.shifted(target_arg, j + 1)) & counted
        accs.append(hits.sum() / denom)
        counts.append(count)
        totals.append(predicted.sum())
    losses = jnp.stack(losses)
    loss = jnp.sum(jnp.asarray(settings.step_weights, jnp.float32) * losses)
    metrics = {"loss": loss, "step_loss": losses, "step_acc": jnp.stack(accs), "step_count": jnp.stack(counts),
               "step_total": jnp.stack(totals)}
    return loss, metrics


# -- optimizer and state ----------------------------------------------------------------------------------


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, Any]:
    """AdamW with linear warmup and cosine decay, after global-norm clipping; no weight decay on norms.
    `cfg` is a TrainConfig."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup, decay_steps=max(cfg.steps, cfg.warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio)
    decay_mask = lambda params: {k: v.ndim > 1 for k, v in params.items()}  # noqa: E731
    parts = [optax.clip_by_global_norm(cfg.clip)] if cfg.clip > 0 else []
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts), schedule


def init_head_params(hcfg: Eagle3Config, seed: int) -> dict:
    """float32 head parameters: normal(0, 0.02) linears, unit norms (eagle3.random_head)."""
    return {name: jnp.asarray(a, jnp.float32) for name, a in random_head(hcfg, seed).params.items()}


def create_state(params: dict, tx) -> TrainState:
    return TrainState.create(apply_fn=None, params=params, tx=tx)


# -- the compiled step ------------------------------------------------------------------------------------


def data_mesh(devices) -> Mesh:
    return Mesh(np.asarray(devices), ("data",))


def make_train_step(hcfg: Eagle3Config, tcfg, settings: LossSettings, schedule, mesh: Mesh):
    """-> step(state, target_params, vocab, batch) -> (state, metrics): one XLA program, the state donated,
    the batch split over the mesh's "data" axis, everything else replicated. Place the arguments with those
    shardings first (jax.device_put / make_array_from_process_local_data, as the trainer does): arguments
    placed otherwise are moved on every call, which made a step ~30x slower on an H100."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(state: TrainState, tparams, vocab, batch):
        grad_fn = jax.value_and_grad(eagle3_loss, has_aux=True)
        (_, metrics), grads = grad_fn(state.params, hcfg, tcfg, tparams, vocab, batch, settings)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
        return state.apply_gradients(grads=grads), metrics

    return jax.jit(step, in_shardings=(replicated, replicated, replicated, split),
                   out_shardings=(replicated, replicated), donate_argnums=0)


def loss_vocab(d2t, t2d) -> dict:
    """The draft vocabulary as eagle3_loss takes it: draft_ids [Vd] (the target id of each draft id), t2d [V]."""
    return {"draft_ids": jnp.asarray(draft_to_target(d2t), jnp.int32), "t2d": jnp.asarray(t2d)}


def make_eval_loss(hcfg: Eagle3Config, tcfg, settings: LossSettings, mesh: Mesh):
    """-> loss(head_params, target_params, vocab, batch) -> (loss, metrics), compiled, no update."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def loss(params, tparams, vocab, batch):
        return eagle3_loss(params, hcfg, tcfg, tparams, vocab, batch, settings)

    return jax.jit(loss, in_shardings=(replicated, replicated, replicated, split), out_shardings=replicated)
