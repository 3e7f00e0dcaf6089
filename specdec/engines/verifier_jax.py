"""The JAX verifier: gemma_jax's forward compiled once per T bucket, and decoding fused on the device.

- Row invariance (the default, `invariant=True`, as in verifier_torch): every decode forward, plain or
  verify, host-driven or inside the fused loop, runs `decode_width(k_max)` rows wide as a commit-first
  forward, so a row's logits do not depend on how many real tokens share the forward. The logits leave
  each forward through an optimization barrier, so XLA cannot shrink the LM head to the rows a program
  happens to read (a 1-row product rounds differently). `invariant=False` compiles buckets of 1 and
  k_max + 1 tokens instead; its speculative output can differ from plain decoding at near-ties.
- `verify` pads T up to its bucket; the cache is donated, so XLA updates it in place. Padding is
  harmless: padded tokens sit after the real ones (causal), and the slots they take are those of a
  full-width verify, which the ring is sized for.
- Prompts prefill all rows together, in one of two ways (`prefill_chunk`). By default through the same decode
  forward, a forward's width of tokens at a time. Pads are harmless for the same reason: a pad written at
  position p takes the ring slot of p - slots, which stays outside every later query's window while p is
  within the decode width of the next real token. `JaxFusedCycle` then prefills inside its cycle program
  (`decode_step`'s prefill cycles), so a run compiles one program holding the forward, not two: XLA spends
  seconds on each copy of the forward, which a one-off command waits for. With `prefill_chunk`, prefill runs
  a forward of its own over chunks that many tokens wide (gemma_jax's prefill forward; its pads store nothing
  and its LM head is never computed): a second program to compile, and a prompt's prefill in a forward or two
  rather than one decode cycle per decode width of it, for engines that serve many prompts.
- `generate_fused` runs the whole decode in one `lax.while_loop` dispatch. Its body, `decode_step`, is one
  draft -> verify -> accept -> commit cycle, greedy or sampled (lossless rejection sampling, each row's draws
  keyed by its seed, in the loop's state, and its position); with no drafter it is plain decoding (k = 0). A
  device-side drafter plugs in as `draft_fn(tokens, context_len) -> [B, k]` tokens and the loop stays on the
  device. `JaxFusedCycle` runs a few `decode_step`s per compiled call for the host loop
  (specdec.generate.run_cycles), as torch's FusedCycle runs one per graph replay.
- With a `mesh`, weights are split over its "tp" axis by attention head and MLP column (o_proj / down_proj
  by row, so XLA reduces after them) and the cache by KV head; XLA inserts the collectives. With `tp_parts` P
  as well, the forward runs in P parts inside shard_map (forward_in_parts): every mesh of a size dividing P
  computes the same bits.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specdec.acceptance.rule_jax import RowSampling, accept_greedy, accept_sampled, keyed_uniform
from specdec.errors import SpecdecError
from specdec.generate import CycleResult, check_context
from specdec.models.checkpoint import load_checkpoint
from specdec.models.config import PARTS_GPU_XLA_FLAGS, GemmaConfig, check_tp_parts, decode_width, round_up
from specdec.models.gemma_jax import (Cache, Params, Parts, default_dtype, forward, init_cache, is_fp8, load_params,
                                      reset_cache, to_device, to_device_shapes)
from specdec.models.sharding_jax import (TP_AXIS, cache_shardings, forward_in_parts, make_mesh, packed_params,
                                         shard_params)
from specdec.protocol import DeviceDraftFn, VerifyOutput, is_device_state
from specdec.sampling import SamplingParams, seed_words

# Tokens per row in a forward of prefill's own (JaxEngine's prefill_chunk). An H200's bf16 GEMMs turn from reading
# weights to computing near 200 rows at peak rates (989 TFLOP/s over 4.8 TB/s, 2 bytes a weight): a chunk of 128
# still costs about what a decode step's weights do, where wider ones would cost a short prompt more.
PREFILL_CHUNK = 128


class DecodeState(NamedTuple):
    """Everything the decode loop carries; all device arrays, B rows."""

    cache: Cache
    tokens: jax.Array  # [B, max_seq_len + k_max + 1] int32: the prompt, then every emitted token
    length: jax.Array  # [B] tokens in the cache; tokens[b, length[b]] is the pending token
    generated: jax.Array  # [B] tokens emitted so far
    done: jax.Array  # [B] bool: hit EOS or max tokens
    cycles: jax.Array  # [B] verify cycles run while not done (tau = generated / cycles)
    prefill_end: jax.Array  # [B] the committed length where a row's prompt ends (its length - 1)
    prefill_cycles: jax.Array  # [] prefill cycles left: they commit every row's prompt up to prefill_end
    seeds: jax.Array  # [B, 2] uint32: each row's seed (specdec.sampling.seed_words), keying its sampled draws
    drafter: dict  # a stateful device drafter's state (EAGLE-3: its KV cache, rows to catch up on); {} if none
    sampling: RowSampling | None = None  # each row's settings (a server's rows each their own); None: all greedy


class StepResult(NamedTuple):
    """What one decode_step drafted and accepted, per row (the fields of specdec.generate.CycleResult)."""

    num_accepted: jax.Array  # [B]
    next_token: jax.Array  # [B]
    draft: jax.Array  # [B, k]
    draft_len: jax.Array  # [B]
    prefill: jax.Array  # []: a prefill cycle, which committed prompt tokens and emitted nothing


def pack_results(results: StepResult) -> jax.Array:
    """StepResults stacked over cycles -> one int32 array [cycles, B, 4 + k]: per row num_accepted, next_token,
    draft_len, whether the cycle prefilled, then the draft. The host reads a call's results as one transfer, which
    starts when the call is dispatched: at one cycle per call (a server's), reading five arrays took 0.53 ms a call
    on an H200, this one 0.17 ms, and a token 0.71 ms against 1.28 (docs/journal)."""
    cycles, B = results.num_accepted.shape
    prefill = jnp.broadcast_to(results.prefill[:, None], (cycles, B))
    columns = [results.num_accepted, results.next_token, results.draft_len, prefill]
    return jnp.concatenate([jnp.stack([c.astype(jnp.int32) for c in columns], axis=-1),
                            results.draft.astype(jnp.int32)], axis=-1)


def unpack_cycles(packed: np.ndarray) -> list[CycleResult]:
    """pack_results' array, on the host -> the CycleResult of each cycle that was not a prefill cycle, in order."""
    return [CycleResult(num_accepted=c[:, 0], next_token=c[:, 1], draft_tokens=c[:, 4:], draft_len=c[:, 2])
            for c in packed if not c[0, 3]]


# A device drafter's function (specdec.protocol.DeviceDrafter): (tokens, context_len) -> (draft [B, k], draft_len [B]);
# or a stateful device drafter (specdec.drafters.eagle3_jax.JaxEagle3, model.JaxModelDraft, mtp_jax.JaxMtp: draft
# and observe over a state the loop carries, its params an argument of the compiled program; draft also reads
# the target's cache, where an MTP assistant attends).


def draft_params(draft_fn):
    """What the compiled decode takes as the drafter's params: a stateful drafter's, else nothing."""
    return draft_fn.params if is_device_state(draft_fn) else None


def _draft_fn_key(draft_fn: DeviceDraftFn | None):
    """Compiled decode functions are shared by drafters of equal settings: device_draft_fn makes a new
    functools.partial per call, equal to the last one in function and arguments but not in identity."""
    if is_device_state(draft_fn):
        return draft_fn.cache_key
    if isinstance(draft_fn, functools.partial):
        return draft_fn.func, draft_fn.args, tuple(sorted(draft_fn.keywords.items()))
    return draft_fn


class JaxEngine:
    """Implements specdec.protocol.Verifier over gemma_jax. Row b's committed length is `lengths[b]`; its
    pending token (not yet in the cache) goes first in the next verify."""

    framework = "jax"

    def __init__(
        self,
        cfg: GemmaConfig,
        params: Params,
        batch: int = 1,
        max_seq_len: int = 4096,
        k_max: int = 8,
        hidden_layers: tuple[int, ...] = (),
        mesh: Mesh | None = None,
        invariant: bool = True,
        lookahead: int = 0,
        allocate_cache: bool = True,
        tp_parts: int | None = None,
        prefill_chunk: int | None = None,
    ):
        """`lookahead`: extra sliding-ring slots for decode forwards chained past the committed length
        (GemmaConfig.cache_slots), for an engine that drafts (specdec.drafters.model). `allocate_cache`
        False: the caller makes the cache (from_checkpoint's background transfer, beside the weights).
        `tp_parts`: compute every split weight in that many parts over the mesh (one device without one), so that
        every mesh of a size dividing it computes the same bits (config.check_tp_parts). `prefill_chunk`: prefill
        through a forward of its own, chunks of that many tokens (PREFILL_CHUNK, the usual choice, or fewer: no
        more than the cache's smallest ring); None: through the decode forward (module docstring). Plain and
        speculative runs of one engine prefill alike either way, but the two ways round differently: their text
        can differ at near-ties."""
        for layer in hidden_layers:
            if not 0 <= layer < cfg.num_layers:
                raise SpecdecError(f"hidden layer {layer} out of range (the model has {cfg.num_layers} layers)")
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.k_max = k_max
        self.width = decode_width(k_max)
        self.batch = batch
        self.max_seq_len = max_seq_len
        self.hidden_layers = tuple(hidden_layers)
        self.invariant = invariant
        self.buckets = (self.width,) if invariant else tuple(sorted({1, k_max + 1}))
        self.parts = None
        if tp_parts is not None:
            mesh = mesh or make_mesh(1)
            check_tp_parts(cfg, tp_parts, mesh.shape[TP_AXIS])
            self.parts = Parts(tp_parts, mesh.shape[TP_AXIS], TP_AXIS)
        self.mesh = mesh
        if prefill_chunk is not None:
            if self.parts is not None:
                raise SpecdecError("prefill's own forward does not run in tensor-parallel parts: prefill_chunk=None")
            if prefill_chunk < 1:
                raise SpecdecError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
            # A chunk's tokens take distinct slots of every cache (gemma_jax.forward's counts)
            prefill_chunk = min(prefill_chunk, *cfg.cache_slots(max_seq_len, k_max, lookahead).values())
        self.prefill_chunk = prefill_chunk
        self.fp8 = is_fp8(params)
        if self.fp8 and self.parts is not None and jax.default_backend() == "gpu":
            # PARTS_GPU_XLA_FLAGS turn XLA's Triton GEMMs off, and cuBLAS takes no FP8 weight beside bf16 rows
            warnings.warn("FP8 weights in tensor-parallel parts on GPUs ran 2.6x slower than on one GPU in the JAX "
                          "engine (cuBLAS's products, docs/journal); the torch engine's parts ran 1.46x faster "
                          "on two GPUs", stacklevel=2)
        if self.parts is not None and jax.default_backend() == "gpu" and (
                not set(PARTS_GPU_XLA_FLAGS) <= set(os.environ.get("XLA_FLAGS", "").split())):
            raise SpecdecError(f"tensor-parallel parts on GPUs compute the same bits on every device count only with "
                               f"XLA_FLAGS='{' '.join(PARTS_GPU_XLA_FLAGS)}' set before JAX starts (specdec's "
                               "commands set them)")
        self._params = shard_params(params, cfg, mesh, self.parts) if mesh is not None else packed_params(params)
        # What programs are lowered against: the weights' shapes, known before the weights themselves arrive;
        # with a mesh, their shardings too (on one device, a sharding named here would lower another program
        # than the call with the arrays does).
        self.param_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=a.sharding if mesh is not None else None), self._params)
        # from_checkpoint(background=True): the transfer of (weights, cache), before and after it starts
        self._transfer: Callable[[], tuple[Params, Cache]] | None = None
        self._in_transfer: Future | None = None
        self.weights_ready_at: float | None = None  # perf_counter when a background transfer ended
        self.lookahead = lookahead
        # Like param_shapes: the cache's shapes, for lowering programs before the cache exists.
        self.cache_shapes = jax.eval_shape(functools.partial(
            init_cache, cfg, batch, max_seq_len, k_max, params["embed_tokens.weight"].dtype, lookahead))
        self._cache_shardings = None
        if mesh is not None:  # lowered with the shardings the cache will have (as param_shapes)
            self._cache_shardings = cache_shardings(self.cache_shapes, mesh)
            self.cache_shapes = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                                      sharding=sharding),
                                             self.cache_shapes, self._cache_shardings)
        self._cache = self._new_cache() if allocate_cache else None
        self.lengths = self._zero_lengths()
        self.dispatches = 0  # compiled calls made from the host (generate_fused makes one for the decode)
        # Every program that runs the decode forward (prefill's, each decode step's, a model drafter's
        # chained steps) calls this one jitted forward: JAX traces the layers once per process, not once
        # per program (0.4-0.6 s of a cold start for the 270M), and XLA inlines the call.
        self._forward = jax.jit(self._decode_forward)
        self._verify_fn = jax.jit(self._forward, donate_argnums=1)
        self._prefill_fn = jax.jit(self._prefill_forward, donate_argnums=1)
        self._reset_fn = jax.jit(self._reset, donate_argnums=0)
        self._reset_row_fn = jax.jit(self._reset_row, donate_argnums=0)
        self._decode_fns: dict[tuple, Callable] = {}  # compiled decode loops and steps (see _decode_fn)
        # Per row, the hidden states of `hidden_layers` at its committed prompt positions [P-1, n, H] (an
        # EAGLE-3 head starts from them); set by prefill and prefill_row when hidden_layers are asked for.
        self.prefill_hidden: list[np.ndarray | None] = [None] * batch

    @classmethod
    def from_checkpoint(cls, path, dtype=None, background: bool = False, fp8: bool = False, **kwargs) -> "JaxEngine":
        """The engine of a HF checkpoint directory. `background`: the checkpoint is read and checked now, and
        its weights and the cache go to the device in a thread, so that programs compile meanwhile (against
        param_shapes and cache_shapes). The thread starts at `start_transfer` or at the first use of `params`
        or `cache`, which wait for it (and raise what it raised). `fp8`: the linears in FP8 (specdec.models.fp8)."""
        pack = kwargs.get("mesh") is None and kwargs.get("tp_parts") is None
        if not background:
            cfg, params = load_params(path, dtype, pack, fp8=fp8)
            return cls(cfg, params, **kwargs)
        cfg, tensors = load_checkpoint(path, framework="numpy")
        dtype = jnp.dtype(dtype or default_dtype())
        engine = cls(cfg, to_device_shapes(tensors, dtype, fp8=fp8, tied=cfg.tie_word_embeddings),
                     allocate_cache=False, **kwargs)

        def transfer():
            # The cache here too: on a first run its constructors compile small programs (about 0.5 s on an H200).
            params, cache = to_device(tensors, dtype, pack, fp8=fp8, tied=cfg.tie_word_embeddings), engine._new_cache()
            jax.block_until_ready((params, cache))
            engine.weights_ready_at = time.perf_counter()
            return params, cache

        engine._transfer = transfer
        return engine

    def start_transfer(self) -> None:
        """Start from_checkpoint's background transfer, if it has not started. JaxFusedCycle.compile_ahead
        starts it once its programs are lowered: started before, the transfer delayed the compile's start by
        about 0.5 s on an H200 (docs/journal, issue 8)."""
        if self._transfer is not None:
            pool = ThreadPoolExecutor(1)
            self._in_transfer = pool.submit(self._transfer)
            self._transfer = None
            pool.shutdown(wait=False)  # its thread ends with the transfer

    def _wait_for_transfer(self) -> None:
        """Take the weights and cache of a background transfer, once there (raising what it raised)."""
        self.start_transfer()
        if self._in_transfer is not None:
            self._params, self._cache = self._in_transfer.result()
            self._in_transfer = None

    @property
    def params(self) -> Params:
        """The weights on the device; waits for a transfer still under way (from_checkpoint's background)."""
        self._wait_for_transfer()
        return self._params

    @property
    def cache(self) -> Cache:
        """The KV cache on the device (None while donated to a call); waits like `params`."""
        self._wait_for_transfer()
        return self._cache

    @cache.setter
    def cache(self, cache: Cache | None) -> None:
        self._wait_for_transfer()
        self._cache = cache

    def _new_cache(self) -> Cache:
        dtype = self.param_shapes["embed_tokens.weight"].dtype
        cache = init_cache(self.cfg, self.batch, self.max_seq_len, self.k_max, dtype, self.lookahead)
        return jax.device_put(cache, self._cache_shardings) if self._cache_shardings is not None else cache

    def _zero_lengths(self) -> jax.Array:
        return jax.device_put(np.zeros(self.batch, np.int32))  # moved, not built by a compiled program

    # -- compiled bodies ----------------------------------------------------------------------------------

    def _constrain(self, cache: Cache) -> Cache:
        """Pin the cache to its KV-head sharding so donation updates it in place across calls."""
        if self._cache_shardings is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, self._cache_shardings)

    def _decode_forward(self, params, cache, tokens, lengths):
        """The decode forward of every verify and loop cycle: commit-first, its LM head behind a barrier."""
        positions = lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        if self.parts is None:
            logits, hidden, cache = forward(params, self.cfg, tokens, positions, cache, self.hidden_layers,
                                            commit_first=True, head_barrier=True)
        else:
            run = forward_in_parts(self.cfg, self.mesh, self.parts, params, cache, hidden_layers=self.hidden_layers,
                                   commit_first=True, head_barrier=True)
            logits, hidden, cache = run(params, tokens, positions, cache)
        return logits, hidden, self._constrain(cache)

    def _prefill_forward(self, params, cache, tokens, lengths, counts):
        """Prefill's own forward (`prefill_chunk`): row b commits its first counts[b] tokens, and only the hidden
        states of `hidden_layers` leave it, so XLA drops the LM head."""
        positions = lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        _, hidden, cache = forward(params, self.cfg, tokens, positions, cache, self.hidden_layers, counts=counts)
        return hidden, self._constrain(cache)

    def _reset(self, cache: Cache) -> Cache:
        """Every slot empty again."""
        return self._constrain(reset_cache(cache))

    def _reset_row(self, cache: Cache, row) -> Cache:
        """Every slot of one row empty again."""
        slot_pos = {kind: p.at[row].set(-1) for kind, p in cache["slot_pos"].items()}
        return self._constrain(dict(cache, slot_pos=slot_pos))

    def decode_step(self, params, state: DecodeState, max_new_tokens, eos_ids, draft_fn: DeviceDraftFn | None = None,
                    draft_params=None) -> tuple[DecodeState, StepResult]:
        """One cycle for every row: draft k tokens (k = 0 without a drafter), verify [pending] + drafts,
        accept (greedy: the longest argmax-matching prefix and the target's next token; sampled: lossless
        rejection sampling against the drafter's probabilities, a point mass for a deterministic drafter),
        commit and emit them. Rows already done emit nothing, and a row keeps no more tokens than its budget
        (`max_new_tokens`, one for all rows or [B]), so its cache does not either. Each row is accepted by its
        settings in the state (`state.sampling`; None: all greedy) with draws keyed by its seed (`state.seeds`),
        so a program serves any temperature, filter values and seed."""
        B = state.length.shape[0]
        rows = jnp.arange(B)[:, None]
        pending = state.tokens[rows, state.length[:, None]]
        draft_probs, drafter_state = None, state.drafter
        if draft_fn is None:
            draft, draft_len = jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32)
        elif is_device_state(draft_fn):  # its random key is in its state: the acceptance stream is the host loop's
            draft, draft_len, draft_probs, drafter_state = draft_fn.draft(params, draft_params, drafter_state, state.cache)
        else:  # the pending token at tokens[b, length[b]] ends each row's context
            draft, draft_len = draft_fn(state.tokens, state.length + 1)
            draft, draft_len = draft.astype(jnp.int32), draft_len.astype(jnp.int32)
        k = draft.shape[1]
        if k > self.k_max:
            raise SpecdecError(f"the drafter proposes {k} tokens, more than the engine's k_max of {self.k_max}")
        offsets = jnp.arange(k + 1, dtype=jnp.int32)
        tokens = self._pad(jnp.concatenate([pending, draft], axis=1))
        prefilling = state.prefill_cycles > 0
        if tokens.shape[1] == self.buckets[-1]:  # prompts left to commit take this same forward call
            chunk, advance = self._prefill_chunk(state)
            tokens = jnp.where(prefilling, chunk, tokens)
        else:  # a narrower forward than prefill's chunks: the prompts were committed before the loop
            advance = jnp.zeros(B, jnp.int32)
        logits, hidden, cache = self._forward(params, state.cache, tokens, state.length)
        if state.sampling is None:
            num_accepted, next_token = accept_greedy(draft, draft_len, logits[:, : k + 1])
        else:  # each row at its pending token's position
            uniform = keyed_uniform(state.seeds, state.length, k + 1)
            num_accepted, next_token = accept_sampled(draft, draft_len, draft_probs, logits[:, : k + 1],
                                                      state.sampling, uniform)
        next_token = next_token.astype(jnp.int32)
        # Accepted drafts, then the target's token; entries past it are overwritten by the next cycle. A
        # prefill cycle writes nothing (its index is past the buffer's end, where the scatter drops it).
        written = jnp.where(prefilling, state.tokens.shape[1], state.length[:, None] + 1 + offsets)
        padded_draft = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
        emitted = jnp.where(offsets < num_accepted[:, None], padded_draft, next_token[:, None])
        is_eos = (emitted[..., None] == eos_ids).any(-1) & (offsets <= num_accepted[:, None]) & ~prefilling
        hit_eos = is_eos.any(axis=1)
        count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, num_accepted + 1)
        count = jnp.minimum(count, max_new_tokens - state.generated)
        count = jnp.where(state.done | prefilling, 0, count).astype(jnp.int32)
        generated = state.generated + count
        if is_device_state(draft_fn):
            drafter_state = draft_fn.observe(draft_params, drafter_state, hidden, emitted, num_accepted + 1, state.length)
        state = DecodeState(
            cache=self._constrain(cache),
            tokens=state.tokens.at[rows, written].set(emitted, mode="drop"),
            length=state.length + jnp.where(prefilling, advance, count),
            generated=generated,
            done=state.done | hit_eos | (generated >= max_new_tokens),
            cycles=state.cycles + (~state.done & ~prefilling).astype(jnp.int32),
            prefill_end=state.prefill_end,
            prefill_cycles=jnp.maximum(state.prefill_cycles - 1, 0),
            seeds=state.seeds,
            drafter=drafter_state,
            sampling=state.sampling,
        )
        return state, StepResult(num_accepted, next_token, draft, draft_len, prefilling)

    def _prefill_chunk(self, state: DecodeState):
        """A prefill cycle's forward input, as `_feed` builds it: every row takes its next chunk (the rest of
        its prompt, up to the forward's width, then pads; only pads once its prompt is in), so all rows start
        decoding in one cycle, as after `prefill`. -> (tokens [B, W], advance [B]: the prompt tokens each
        row commits)."""
        width = self.buckets[-1]
        offsets = jnp.arange(width, dtype=jnp.int32)
        advance = jnp.clip(state.prefill_end - state.length, 0, width).astype(jnp.int32)
        chunk = jnp.take_along_axis(state.tokens, state.length[:, None] + offsets, axis=1)
        chunk = jnp.where(offsets < advance[:, None], chunk, self.cfg.pad_token_id)
        return chunk, advance

    def _loop_fn(self, draft_fn: DeviceDraftFn | None = None):
        """The whole decode, decode_step until every row is done, as one compiled while_loop."""

        def loop(params, state, max_new_tokens, eos_ids, draft_params=None):
            step = lambda s: self.decode_step(params, s, max_new_tokens, eos_ids, draft_fn, draft_params)[0]  # noqa: E731
            return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)

        return self._decode_fn("loop", loop, draft_fn)

    def _steps_fn(self, cycles: int, draft_fn: DeviceDraftFn | None = None):
        """`cycles` decode_steps as one compiled call (a lax.scan), their StepResults stacked and packed into one
        array (`pack_results`; JaxFusedCycle)."""

        def steps(params, state, max_new_tokens, eos_ids, draft_params=None):
            step = lambda s, _: self.decode_step(params, s, max_new_tokens, eos_ids, draft_fn, draft_params)  # noqa: E731
            state, results = jax.lax.scan(step, state, length=cycles)
            return state, pack_results(results)

        return self._decode_fn(("steps", cycles), steps, draft_fn)

    def _decode_fn(self, kind, fn, draft_fn: DeviceDraftFn | None):
        """fn jitted (the state donated) once per kind and drafter settings. Sampling settings and seeds are in
        the state, so requests reuse the program: jit compiles it once greedy (no RowSampling in the state) and
        once per set of filters a run names (a server's rows name none: one program for every mix)."""
        key = (kind, _draft_fn_key(draft_fn))
        if key not in self._decode_fns:
            self._decode_fns[key] = jax.jit(fn, donate_argnums=1)
        return self._decode_fns[key]

    # -- the protocol -------------------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> jax.Array:
        """Commit each row's prompt but its last token; returns the last prompt tokens [B] (pending)."""
        self._empty_for(prompts)
        self._feed(dict(enumerate(p[:-1] for p in prompts)))
        return jnp.asarray([p[-1] for p in prompts], jnp.int32)

    def _empty_for(self, prompts: list[list[int]]) -> None:
        """Check one prompt per row, then empty every row's cache, ready to commit them."""
        if len(prompts) != self.batch:
            raise SpecdecError(f"{len(prompts)} prompts for an engine of batch {self.batch}")
        for prompt in prompts:
            self._check_prompt(prompt)
        self.cache = self._reset_fn(self.cache)
        self.lengths = self._zero_lengths()

    def prefill_row(self, row: int, prompt: list[int]) -> jax.Array:
        """Start a new request in one row, leaving the other rows' requests as they are (continuous
        batching); returns its pending token [1]."""
        self.prefill_rows({row: prompt})
        return jnp.asarray(prompt[-1:], jnp.int32)

    def prefill_rows(self, prompts: dict[int, list[int]]) -> None:
        """prefill_row of several rows (row -> prompt) together: the same forwards commit all of them."""
        for row, prompt in prompts.items():
            if not 0 <= row < self.batch:
                raise SpecdecError(f"row {row} outside the engine's batch of {self.batch}")
            self._check_prompt(prompt)
        for row in prompts:
            self.cache = self._reset_row_fn(self.cache, row)
            self.lengths = self.lengths.at[row].set(0)
        self._feed({row: prompt[:-1] for row, prompt in prompts.items()})

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise SpecdecError("empty prompt")
        if len(prompt) + self.width > self.max_seq_len:
            raise SpecdecError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_seq_len} tokens")

    @property
    def prefill_width(self) -> int:
        """Tokens per row in each of prefill's forwards."""
        return self.prefill_chunk or self.buckets[-1]

    def _prefill_program(self, params, cache, tokens, lengths, counts):
        """One of prefill's forwards -> (hidden states of hidden_layers or None, the cache): prefill's own
        (`prefill_chunk`), or the host-driven verify's decode forward, where pads commit harmlessly (_feed)."""
        if self.prefill_chunk is not None:
            return self._prefill_fn(params, cache, tokens, lengths, counts)
        _, hidden, cache = self._verify_fn(params, cache, tokens, lengths)
        return hidden, cache

    def lower_prefill(self):
        """Prefill's program lowered against the shapes of the weights and cache (JaxFusedCycle.compile_ahead)."""
        chunk = jax.ShapeDtypeStruct((self.batch, self.prefill_width), jnp.int32)
        if self.prefill_chunk is not None:
            return self._prefill_fn.lower(self.param_shapes, self.cache_shapes, chunk, self.lengths, self.lengths)
        return self._verify_fn.lower(self.param_shapes, self.cache_shapes, chunk, self.lengths)

    def _feed(self, contexts: dict[int, list[int]]) -> None:
        """Commit tokens into rows (row -> tokens), prefill_width at a time. Pads fill the rest of each forward,
        and the other rows run pads too. Prefill's own forward stores none of them. Through the decode forward
        (the host-driven verify's, whose chunks JaxFusedCycle's prefill cycles build as this does), they all lie
        within one forward's width past their row's committed length, which is what rejected drafts take and
        what the sliding-window ring is sized for."""
        chunk = self.prefill_width
        longest = max(len(ids) for ids in contexts.values())
        hidden_chunks = []
        for start in range(0, longest, chunk):
            tokens = np.full((self.batch, chunk), self.cfg.pad_token_id, np.int32)
            advance = np.zeros(self.batch, np.int32)
            for row, ids in contexts.items():
                part = ids[start : start + chunk]
                tokens[row, : len(part)] = part
                advance[row] = len(part)
            self.dispatches += 1
            tokens, advance = jax.device_put((tokens, advance))
            hidden, self.cache = self._prefill_program(self.params, self.cache, tokens, self.lengths, advance)
            self.lengths = self.lengths + advance
            hidden_chunks.append(hidden)
        if self.hidden_layers:
            n, H = len(self.hidden_layers), self.cfg.hidden_size
            hidden = np.concatenate([np.asarray(h, np.float32) for h in hidden_chunks], axis=1) if hidden_chunks \
                else np.zeros((self.batch, 0, n, H), np.float32)
            for row, ids in contexts.items():
                self.prefill_hidden[row] = hidden[row, : len(ids)]

    def verify(self, tokens) -> VerifyOutput:
        """Run tokens [B, T] at positions lengths + 0..T-1 (T <= k_max + 1); nothing is committed."""
        tokens = jnp.asarray(tokens, jnp.int32)
        T = tokens.shape[1]
        if T > self.k_max + 1:
            raise SpecdecError(f"{T - 1} drafts exceed the engine's k_max of {self.k_max}")
        tokens = self._pad(tokens)
        self.dispatches += 1
        logits, hidden, self.cache = self._verify_fn(self.params, self.cache, tokens, self.lengths)
        if tokens.shape[1] > T:
            logits, hidden = logits[:, :T], None if hidden is None else hidden[:, :T]
        return VerifyOutput(logits, hidden)

    def _pad(self, tokens):
        """[B, T] tokens padded to the smallest bucket that holds them (pad rows after the real ones)."""
        bucket = self._bucket(tokens.shape[1])
        return jnp.pad(tokens, ((0, 0), (0, bucket - tokens.shape[1])), constant_values=self.cfg.pad_token_id)

    def _bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def commit(self, num_tokens) -> None:
        self.lengths = self.lengths + jnp.asarray(num_tokens, jnp.int32)

    # -- greedy generation ----------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
        """Plain greedy decode, step by step from the host: one compiled T=1 verify per token, argmax
        (lowest id on ties), stop on EOS or max tokens. The baseline generate_fused must equal."""
        self._check_generation(prompt_ids, max_new_tokens)
        pending = self.prefill([prompt_ids])
        out: list[int] = []
        while len(out) < max_new_tokens:
            logits = self.verify(pending[:, None]).logits
            self.commit(1)
            pending = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            out.append(int(pending[0]))
            if out[-1] in eos_ids:
                break
        return out

    def generate_fused(self, prompt_ids: list[int], max_new_tokens: int, eos_ids=(), draft_fn: DeviceDraftFn | None = None,
                       sampling: SamplingParams = SamplingParams()):
        """Decode in one device dispatch (after prefill): a lax.while_loop of decode_step until EOS or max
        tokens. Greedy by default; with a draft_fn it is speculative decoding, with the same output (greedy:
        the same tokens; sampled: the same distribution, reproducible per seed)."""
        state = self.begin_decode(prompt_ids, max_new_tokens, draft_fn, sampling)
        state = self.decode_fused(state, max_new_tokens, eos_ids, draft_fn)
        return self.emitted_tokens(state, len(prompt_ids), max_new_tokens)

    def begin_decode(self, prompt_ids: list[int], max_new_tokens: int, draft_fn: DeviceDraftFn | None = None,
                     sampling: SamplingParams = SamplingParams()) -> DecodeState:
        """Prefill one prompt and build the loop's state (batch 1)."""
        self._check_generation(prompt_ids, max_new_tokens)
        return self._start_decode([prompt_ids], sampling, done=max_new_tokens <= 0, draft_fn=draft_fn)

    def _start_decode(self, prompts: list[list[int]], sampling: SamplingParams = SamplingParams(),
                      done: bool = False, draft_fn: DeviceDraftFn | None = None) -> DecodeState:
        """Prefill one prompt per row and build the decode state: the prompts in the token buffer, the rows'
        seeds (SamplingParams.row_seeds), a stateful drafter's state started from the prompts."""
        self.prefill(prompts)
        drafter = draft_fn.begin(self.params, prompts, self.prefill_hidden) if is_device_state(draft_fn) else {}
        return self._decode_state(prompts, sampling, done, drafter)

    def _prefill_state(self, prompts: list[list[int]], sampling: SamplingParams) -> DecodeState:
        """The decode state of prompts not yet prefilled: an empty cache, which the loop's first cycles fill
        (decode_step's prefill cycles)."""
        self._empty_for(prompts)
        return self._decode_state(prompts, sampling, False, {}, prefilled=False)

    def prefill_cycles(self, prompts: list[list[int]]) -> int:
        """The cycles decode_step takes to commit prompts into an empty cache, a forward's width at a time."""
        return -(-max(len(p) - 1 for p in prompts) // self.buckets[-1])

    def _decode_state(self, prompts: list[list[int]], sampling: SamplingParams, done: bool, drafter,
                      prefilled: bool = True, cache: Cache | None = None) -> DecodeState:
        """The loop's state over the engine's cache (or `cache`), the prompts committed (`prefilled`) or still
        to commit."""
        tokens = np.zeros((self.batch, self.max_seq_len + self.k_max + 1), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        # Built on the host and moved in one call: jnp's constructors would each compile a program on a first run.
        host = jax.device_put(dict(
            tokens=tokens,
            generated=np.zeros(self.batch, np.int32),
            done=np.full(self.batch, done),
            cycles=np.zeros(self.batch, np.int32),
            prefill_end=np.asarray([len(p) - 1 for p in prompts], np.int32),
            prefill_cycles=np.int32(0 if prefilled else self.prefill_cycles(prompts)),
            seeds=seed_words(sampling.row_seeds(self.batch)).astype(np.uint32),
            sampling=None if sampling.greedy else RowSampling.of([sampling] * self.batch, sampling.filters),
        ))
        return DecodeState(cache=self.cache if cache is None else cache, length=self.lengths, drafter=drafter, **host)

    def decode_fused(self, state: DecodeState, max_new_tokens: int, eos_ids=(), draft_fn: DeviceDraftFn | None = None):
        """The whole decode loop as one compiled call (the state holds the sampling settings); returns the final
        state without waiting for it."""
        self.cache = None  # donated to the loop
        self.dispatches += 1
        loop = self._loop_fn(draft_fn)
        state = loop(self.params, state, *stop_arrays(max_new_tokens, eos_ids), draft_params(draft_fn))
        self.cache, self.lengths = state.cache, state.length
        return state

    @staticmethod
    def emitted_tokens(state: DecodeState, prompt_len: int, max_new_tokens: int) -> list[int]:
        tokens, generated = jax.device_get((state.tokens, state.generated))
        return tokens[0, prompt_len : prompt_len + min(int(generated[0]), max_new_tokens)].tolist()

    def _check_generation(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if self.batch != 1:
            raise SpecdecError("generate runs batch 1")
        check_context(self, [prompt_ids], max_new_tokens)


def stop_arrays(max_new_tokens: int, eos_ids) -> tuple[jax.Array, jax.Array]:
    """The device-side stop: the token budget and the EOS ids, padded with -1 (no token) to a multiple of 8
    (fewer recompiles)."""
    eos_ids = sorted(eos_ids)
    eos = np.full(round_up(max(len(eos_ids), 1), 8), -1, np.int32)
    eos[: len(eos_ids)] = eos_ids
    return jax.device_put(np.int32(max_new_tokens)), jax.device_put(eos)


NO_EOS = np.full(8, -1, np.int32)  # stop_arrays' EOS ids of none
