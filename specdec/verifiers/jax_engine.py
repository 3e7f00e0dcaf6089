"""The JAX verifier: jax_gemma's forward compiled once per T bucket, and decoding fused on the device.

- Row invariance (the default, `invariant=True`, as in torch_engine): every decode forward, plain or
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
  a forward of its own over chunks that many tokens wide (jax_gemma's prefill forward; its pads store nothing
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

import dataclasses
import functools
import itertools
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specdec.acceptance.jax_rule import RowSampling, accept_greedy, accept_sampled, keyed_uniform
from specdec.errors import SpecdecError
from specdec.generate import CycleResult, StopCondition, check_context
from specdec.models.config import (PARTS_GPU_XLA_FLAGS, GemmaConfig, check_tensor_parallel, check_tp_parts,
                                   decode_width, round_up, tp_split_axis)
from specdec.models.checkpoint import load_checkpoint
from specdec.models.jax_fp8 import Fp8Weight
from specdec.models.jax_gemma import (Cache, Params, Parts, default_dtype, forward, init_cache, is_fp8, load_params,
                                      layer_prefix, pack_projections, pack_rows, reset_cache, to_device,
                                      to_device_shapes)
from specdec.protocol import VerifyOutput
from specdec.sampling import SamplingParams, seed_words

TP_AXIS = "tp"
# Tokens per row in a forward of prefill's own (JaxEngine's prefill_chunk). An H200's bf16 GEMMs turn from reading
# weights to computing near 200 rows at peak rates (989 TFLOP/s over 4.8 TB/s, 2 bytes a weight): a chunk of 128
# still costs about what a decode step's weights do, where wider ones would cost a short prompt more.
PREFILL_CHUNK = 128


# -- tensor parallelism ---------------------------------------------------------------------------------


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D tensor-parallel mesh over the first `num_devices` devices (all by default)."""
    devices = jax.devices()[: num_devices or len(jax.devices())]
    return Mesh(np.array(devices), (TP_AXIS,))


def check_mesh(cfg: GemmaConfig, mesh: Mesh) -> None:
    """Every split dimension must divide evenly over the mesh; raised before anything is compiled."""
    check_tensor_parallel(cfg, mesh.shape[TP_AXIS])


def param_partition_spec(cfg: GemmaConfig, name: str, tp: int, param=None):
    """The mesh axis on the dimension config.tp_split_axis names (none: replicated; dimensions past the
    split one are whole). In parts (`tp` the parts), a packed weight (jax_gemma.pack_projections) splits by row.
    For an FP8 `param` (a pytree of values and scales), the specs of both: its scales split as its rows do, and
    stay whole where the reduction splits."""
    axis = 0 if "+" in name else tp_split_axis(cfg, name, tp)
    spec = P() if axis is None else P(*[None] * axis, TP_AXIS)
    if isinstance(param, Fp8Weight):
        return Fp8Weight(spec, spec if axis == 0 else P())
    return spec


def _packed(params: Params) -> Params:
    """One device's weights with q/k/v and gate/up packed (jax_gemma.pack_projections), or their shapes.
    Weights already packed (from_checkpoint's, another engine's) come back as they are; others are copied
    packed, beside the caller's."""
    shapes = jax.eval_shape(pack_projections, params)
    if shapes.keys() == params.keys():
        return params  # packed already, or nothing to pack
    if all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params)):
        return shapes
    return _pack_fn(params)


_pack_fn = jax.jit(pack_projections)


def shard_params(params: Params, cfg: GemmaConfig, mesh: Mesh, parts: Parts | None = None) -> Params:
    """Weights split over the mesh; in `parts`, a layer at a time, split into whole parts and then packed in parts on
    each device (pack_on_devices), so that a device holds no more than one layer's weights twice."""
    if parts is None:
        check_mesh(cfg, mesh)
    tp = mesh.shape[TP_AXIS] if parts is None else parts.count

    def place(names) -> Params:
        return {name: jax.device_put(params[name], _named(mesh, param_partition_spec(cfg, name, tp, params[name])))
                for name in names}

    if parts is None:
        return place(params)
    placed = {}
    for _, names in itertools.groupby(sorted(params), key=layer_prefix):
        placed.update(pack_on_devices(place(names), mesh, parts))
    return placed


def _named(mesh: Mesh, specs):
    """NamedShardings over `mesh` for a spec or a pytree of them (an FP8 weight's)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def pack_on_devices(params: Params, mesh: Mesh, parts: Parts) -> Params:
    """jax_gemma.pack_projections(params, parts.count) of weights split by row over the mesh, each device packing
    its own rows: a device holds consecutive whole parts, so its rows packed part by part are its block of the
    packed whole. Packing the whole 31B on one GPU before splitting it held the packed projections beside the
    weights there, and then that GPU's block as well: more than an H200 holds (docs/journal)."""
    return pack_projections(params, pack=lambda weights: _row_packer(mesh, parts.local, len(weights))(*weights))


@functools.cache
def _row_packer(mesh: Mesh, local: int, count: int) -> Callable:
    """pack_rows of `count` weights in `local` parts on each device of the mesh, from and into row blocks."""
    by_row = P(TP_AXIS)
    return jax.jit(shard_map(lambda *weights: pack_rows(list(weights), local), mesh=mesh,
                             in_specs=(by_row,) * count, out_specs=by_row))



def cache_specs(cache: Cache):
    """Keys/values [B, n_kv, S, hd] split by KV head; slot positions replicated."""
    by_head = P(None, TP_AXIS, None, None)
    return {
        "keys": [None if k is None else by_head for k in cache["keys"]],
        "values": [None if v is None else by_head for v in cache["values"]],
        "slot_pos": {kind: P() for kind in cache["slot_pos"]},
    }


def cache_shardings(cache: Cache, mesh: Mesh):
    return _named(mesh, cache_specs(cache))


def forward_in_parts(cfg: GemmaConfig, mesh: Mesh, parts: Parts, params, cache: Cache, **static) -> Callable:
    """jax_gemma.forward in `parts` as one program over the mesh: (params, tokens, positions, cache) -> forward's
    (logits, hidden, cache). Each device runs its parts on its blocks of the weights and the cache (shard_map);
    the collectives are the forward's own (sum_parts' gathers, the lookups' sums, the LM head's gather), so no
    partitioner chooses where they go or in which order a reduction adds."""
    param_specs = {name: param_partition_spec(cfg, name, parts.count, param) for name, param in params.items()}
    specs = cache_specs(cache)

    def body(params, tokens, positions, cache):
        return forward(params, cfg, tokens, positions, cache, parts=parts, **static)

    hidden_spec = P() if static.get("hidden_layers") else None
    return shard_map(body, mesh=mesh, in_specs=(param_specs, P(), P(), specs), out_specs=(P(), hidden_spec, specs),
                     check_vma=False)


# -- the fused decode loop's state ---------------------------------------------------------------------


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
DraftFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _stateful(draft_fn) -> bool:
    return hasattr(draft_fn, "observe")


def _draft_params(draft_fn):
    """What the compiled decode takes as the drafter's params: a stateful drafter's, else nothing."""
    return draft_fn.params if _stateful(draft_fn) else None


def _draft_fn_key(draft_fn: DraftFn | None):
    """Compiled decode functions are shared by drafters of equal settings: device_draft_fn makes a new
    functools.partial per call, equal to the last one in function and arguments but not in identity."""
    if _stateful(draft_fn):
        return draft_fn.cache_key
    if isinstance(draft_fn, functools.partial):
        return draft_fn.func, draft_fn.args, tuple(sorted(draft_fn.keywords.items()))
    return draft_fn


class JaxEngine:
    """Implements specdec.protocol.Verifier over jax_gemma. Row b's committed length is `lengths[b]`; its
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
            # A chunk's tokens take distinct slots of every cache (jax_gemma.forward's counts)
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
        self._params = shard_params(params, cfg, mesh, self.parts) if mesh is not None else _packed(params)
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

    def decode_step(self, params, state: DecodeState, max_new_tokens, eos_ids, draft_fn: DraftFn | None = None,
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
        elif _stateful(draft_fn):  # its random key is in its state: the acceptance stream is the host loop's
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
        if _stateful(draft_fn):
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

    def _loop_fn(self, draft_fn: DraftFn | None = None):
        """The whole decode, decode_step until every row is done, as one compiled while_loop."""

        def loop(params, state, max_new_tokens, eos_ids, draft_params=None):
            step = lambda s: self.decode_step(params, s, max_new_tokens, eos_ids, draft_fn, draft_params)[0]  # noqa: E731
            return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)

        return self._decode_fn("loop", loop, draft_fn)

    def _steps_fn(self, cycles: int, draft_fn: DraftFn | None = None):
        """`cycles` decode_steps as one compiled call (a lax.scan), their StepResults stacked and packed into one
        array (`pack_results`; JaxFusedCycle)."""

        def steps(params, state, max_new_tokens, eos_ids, draft_params=None):
            step = lambda s, _: self.decode_step(params, s, max_new_tokens, eos_ids, draft_fn, draft_params)  # noqa: E731
            state, results = jax.lax.scan(step, state, length=cycles)
            return state, pack_results(results)

        return self._decode_fn(("steps", cycles), steps, draft_fn)

    def _decode_fn(self, kind, fn, draft_fn: DraftFn | None):
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

    def generate_fused(self, prompt_ids: list[int], max_new_tokens: int, eos_ids=(), draft_fn: DraftFn | None = None,
                       sampling: SamplingParams = SamplingParams()):
        """Decode in one device dispatch (after prefill): a lax.while_loop of decode_step until EOS or max
        tokens. Greedy by default; with a draft_fn it is speculative decoding, with the same output (greedy:
        the same tokens; sampled: the same distribution, reproducible per seed)."""
        state = self.begin_decode(prompt_ids, max_new_tokens, draft_fn, sampling)
        state = self.decode_fused(state, max_new_tokens, eos_ids, draft_fn)
        return self.emitted_tokens(state, len(prompt_ids), max_new_tokens)

    def begin_decode(self, prompt_ids: list[int], max_new_tokens: int, draft_fn: DraftFn | None = None,
                     sampling: SamplingParams = SamplingParams()) -> DecodeState:
        """Prefill one prompt and build the loop's state (batch 1)."""
        self._check_generation(prompt_ids, max_new_tokens)
        return self._start_decode([prompt_ids], sampling, done=max_new_tokens <= 0, draft_fn=draft_fn)

    def _start_decode(self, prompts: list[list[int]], sampling: SamplingParams = SamplingParams(),
                      done: bool = False, draft_fn: DraftFn | None = None) -> DecodeState:
        """Prefill one prompt per row and build the decode state: the prompts in the token buffer, the rows'
        seeds (SamplingParams.row_seeds), a stateful drafter's state started from the prompts."""
        self.prefill(prompts)
        drafter = draft_fn.begin(self.params, prompts, self.prefill_hidden) if _stateful(draft_fn) else {}
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

    def decode_fused(self, state: DecodeState, max_new_tokens: int, eos_ids=(), draft_fn: DraftFn | None = None):
        """The whole decode loop as one compiled call (the state holds the sampling settings); returns the final
        state without waiting for it."""
        self.cache = None  # donated to the loop
        self.dispatches += 1
        loop = self._loop_fn(draft_fn)
        state = loop(self.params, state, *_stop_arrays(max_new_tokens, eos_ids), _draft_params(draft_fn))
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


def _stop_arrays(max_new_tokens: int, eos_ids) -> tuple[jax.Array, jax.Array]:
    """The device-side stop: the token budget and the EOS ids, padded with -1 (no token) to a multiple of 8
    (fewer recompiles)."""
    eos_ids = sorted(eos_ids)
    eos = np.full(round_up(max(len(eos_ids), 1), 8), -1, np.int32)
    eos[: len(eos_ids)] = eos_ids
    return jax.device_put(np.int32(max_new_tokens)), jax.device_put(eos)


_NO_EOS = np.full(8, -1, np.int32)  # _stop_arrays' EOS ids of none


@functools.partial(jax.jit, donate_argnums=0)
def _admitted(state: DecodeState, row, tokens, seeds) -> DecodeState:
    """A state whose row starts a request: its prompt (already committed but its last token) in the token
    buffer, nothing generated, its seed."""
    return state._replace(tokens=state.tokens.at[row].set(tokens), generated=state.generated.at[row].set(0),
                          done=state.done.at[row].set(False), cycles=state.cycles.at[row].set(0),
                          seeds=state.seeds.at[row].set(seeds))


@functools.partial(jax.jit, donate_argnums=0)
def _retired(state: DecodeState, row) -> DecodeState:
    return state._replace(done=state.done.at[row].set(True))


CYCLES_PER_CALL = 8  # decode cycles per dispatch of JaxFusedCycle: fewer host round trips, text still streams


class JaxFusedCycle:
    """Cycles of draft (on the device) -> verify -> accept -> commit, `cycles_per_call` of them per compiled
    call (a lax.scan of decode_step), with the host interface of torch's FusedCycle (`verifier`, `start`,
    `step`): specdec.generate.run_cycles drives either engine's fused cycle, and `step` hands it one cycle's
    results at a time. One dispatch and one host sync per `cycles_per_call` cycles: a cycle costs the device
    time of its step, not a round trip (the whole-decode while_loop avoids even those, but streams nothing).

    The stop condition's EOS ids and token budget go to the device, which stops advancing a row once it is
    done (as the while_loop does), so cycles run past a row's end write nothing beyond its context; stop
    strings and the exact cut stay on the host. `draft_fn` proposes k tokens (a device drafter's function,
    specdec.protocol.DeviceDrafter); with k = 0 nothing is drafted (draft_fn may be None) and each cycle is
    one plain decode step. Sampled decoding draws keyed by each row's seed (sampling.seed + row) and
    position (specdec.acceptance). The compiled program is the engine's, shared by every cycle of equal
    drafter settings and cycles per call: the sampling settings and seeds are in the state (a program greedy, one
    per set of filters in use). `admit` and `retire` serve requests row by row (a server's continuous batching),
    each row by its own settings, the filters picked on the device.

    `prefetch` (default: on an accelerator; torch's FusedCycle has the same): `step` dispatches the next call
    before it reads this one's results, so the device runs cycles while the host streams the last call's tokens.
    The call dispatched after the last one read is wasted; `drain` waits for it. On the CPU the host and the
    "device" share the cores, so the overlap buys little and the wasted call costs."""

    def __init__(self, engine: JaxEngine, draft_fn: DraftFn | None, k: int, sampling: SamplingParams = SamplingParams(),
                 cycles_per_call: int = CYCLES_PER_CALL, prefetch: bool | None = None):
        if not 0 <= k <= engine.k_max:
            raise SpecdecError(f"k={k} is outside 0..{engine.k_max} (the engine's compiled maximum)")
        if k > 0 and draft_fn is None:
            raise SpecdecError(f"k={k} drafts need a draft function")
        if cycles_per_call < 1:
            raise SpecdecError(f"cycles_per_call must be >= 1, got {cycles_per_call}")
        self.verifier, self.k, self.sampling = engine, k, sampling
        self.draft_fn = draft_fn if k > 0 else None
        self._steps = engine._steps_fn(cycles_per_call, self.draft_fn)
        self.cycles_per_call = cycles_per_call
        self.widths = (engine.batch,)  # every cycle runs every row: XLA's kernels take whole arrays, not views
        # decode_step prefills in a forward as wide as prefill's chunks, which a stateful drafter's begin
        # (from prefill's hidden states) cannot wait for; an engine with prefill_chunk prefills in its own program.
        self._prefills_in_cycle = (engine.prefill_chunk is None and not _stateful(self.draft_fn)
                                   and engine._bucket(k + 1) == engine.buckets[-1])
        self.decode_cycles_in_start = 0  # decode cycles the last start ran with its prefill, handed out first by step
        self._compiling: list[Future] = []  # compile_ahead's compilations under way
        self.device_cycles = 0  # cycles of the calls whose results were read, cycles_per_call each (prefill's too)
        self.prefetch = jax.default_backend() != "cpu" if prefetch is None else prefetch
        self._in_flight = None  # the results, on the device, of a call dispatched ahead and not read
        self.state: DecodeState | None = None
        self._stop: tuple[jax.Array, jax.Array] | None = None
        self._ready: list[CycleResult] = []  # cycles run on the device, not yet handed out
        self._rows: list[SamplingParams] | None = None  # serving (admit): each row's settings, seed aside
        self._budget: np.ndarray | None = None  # serving: each row's token budget
        self._admitting: dict[int, tuple] = {}  # serving: row -> (prompt, seed words), prefilled at the next call

    def compile_ahead(self, stop: StopCondition) -> None:
        """Start compiling what a run needs, in threads, and return: `start` waits for it. That is this
        cycle's program, which prefills too; or, where prefill runs on its own (the engine's prefill_chunk, or a
        forward narrower than prefill's chunks), prefill's program as well, the two side by side; and the cache's
        reset, which start runs first. The programs are lowered here (which holds the GIL) against the shapes of the
        weights, the cache and the state the real calls build (eval_shape of the same code), so they need not wait
        for the transfer of the weights and cache, which starts next, and those calls find them compiled; XLA
        compiles without the GIL. Prompt lengths do not enter the programs. A stateful drafter's state takes its
        shape from the drafter's own prefill: with one, the programs compile in turn, at first use."""
        engine = self.verifier
        if _stateful(self.draft_fn):
            engine.start_transfer()
            return
        prompts = [[engine.cfg.pad_token_id]] * engine.batch
        state = jax.eval_shape(lambda cache: engine._decode_state(prompts, self.sampling, False, {},
                                                                  prefilled=not self._prefills_in_cycle, cache=cache),
                               engine.cache_shapes)
        stop_arrays = _stop_arrays(stop.max_new_tokens, stop.eos_ids)
        lowered = [self._steps.lower(engine.param_shapes, state, *stop_arrays, None),
                   engine._reset_fn.lower(engine.cache_shapes)]  # start empties the cache first
        if not self._prefills_in_cycle:
            lowered.append(engine.lower_prefill())
        pool = ThreadPoolExecutor(len(lowered))
        self._compiling = [pool.submit(program.compile) for program in lowered]
        pool.shutdown(wait=False)
        engine.start_transfer()

    def wait_compiled(self) -> None:
        """Wait for compile_ahead's compilations, raising what they raised."""
        for compiling in self._compiling:
            compiling.result()
        self._compiling = []

    def start(self, prompts: list[list[int]], stop: StopCondition) -> None:
        """Prefill: where it can, inside the cycle program, whose calls that hold the prefill cycles run here
        (the decode cycles that end the last of them wait for `step`: `decode_cycles_in_start`); else
        through the engine's `prefill`."""
        self.wait_compiled()
        self._rows = self._budget = None  # a state for these prompts alone
        self._admitting = {}
        self._stop = _stop_arrays(stop.max_new_tokens, stop.eos_ids)
        self._ready = []
        self._in_flight = None  # an earlier run's: its state is replaced below
        if not self._prefills_in_cycle:
            self.state = self.verifier._start_decode(prompts, self.sampling, draft_fn=self.draft_fn)
            self.decode_cycles_in_start = 0
            return
        self.state = self.verifier._prefill_state(prompts, self.sampling)
        for _ in range(-(-self.verifier.prefill_cycles(prompts) // self.cycles_per_call)):
            self._read(self._dispatch())  # nothing ahead: run_cycles times start as the prefill
        self.decode_cycles_in_start = len(self._ready)

    def step(self, prefetch: bool | None = None) -> CycleResult:
        """The next cycle's results; `prefetch` (None: the cycle's setting) dispatches the next call before it
        reads this one."""
        while not self._ready:
            results = self._in_flight if self._in_flight is not None else self._dispatch()
            self._in_flight = self._dispatch() if (self.prefetch if prefetch is None else prefetch) else None
            self._read(results)
        return self._ready.pop()

    # -- serving: rows admitted and retired one by one (continuous batching) ------------------------------

    def admit(self, row: int, prompt: list[int], max_new_tokens: int,
              sampling: SamplingParams = SamplingParams()) -> None:
        """Start a request in one row while the other rows keep theirs, with its budget, settings and seed (None:
        0); each row is then accepted by its own settings (RowSampling). The prompt is checked now and prefilled
        before the next call, in the same forwards as every row admitted since (the engine's prefill_rows), and a
        stateful drafter's state starts those rows from them (`begin_rows`). Such a drafter must be greedy
        (SamplingParams()): its drafts are then a point mass for every row's rule, where a sampling drafter's key
        is the batch's. With several cycles a call, a request joins between calls; the device stops its row at its
        budget, and a row the host stops (EOS, a stop string) decodes on to its call's end, its tokens there the
        caller's to drop."""
        if _stateful(self.draft_fn) and not self.draft_fn.sampling.greedy:
            raise SpecdecError("rows are admitted one by one only beside a greedy drafter (SamplingParams()): a "
                               "sampling drafter draws from one random key for the whole batch")
        if self._in_flight is not None or self._ready:
            raise SpecdecError("a row is admitted while cycles that ran over the rows as they were wait to be handed "
                               "out: collect them first")
        self.verifier._check_prompt(prompt)
        self._start_serving()
        self._rows[row] = dataclasses.replace(sampling, seed=None)
        self._budget[row] = max_new_tokens
        self._admitting[row] = (prompt, seed_words([sampling.seed or 0])[0].astype(np.uint32))

    def retire(self, row: int) -> None:
        """Stop one row advancing: it rides along, done, until it is admitted again. A call in flight may still
        advance it once; its results for the row are the caller's to ignore."""
        if self.state is None:
            return
        self._admitting.pop(row, None)
        self._rows[row] = SamplingParams()
        self._set_state(_retired(self.state, row))
        self._set_rules()

    def collect(self) -> CycleResult | None:
        """The next cycle already run or running (a call in flight is read), dispatching none; None once every
        cycle run is handed out."""
        if self._in_flight is not None:
            results, self._in_flight = self._in_flight, None
            self._read(results)
        return self._ready.pop() if self._ready else None

    def _start_serving(self) -> None:
        """Once: the state rows are admitted into, every row done until admitted, a budget per row, a stateful
        drafter's state of no request."""
        if self._rows is None:
            engine = self.verifier
            batch = engine.batch
            self._rows = [SamplingParams()] * batch
            self._budget = np.zeros(batch, np.int32)
            drafter = self.draft_fn.init_state() if _stateful(self.draft_fn) else {}
            self._set_state(engine._decode_state([[engine.cfg.pad_token_id]] * batch, SamplingParams(), True, drafter))

    def _set_state(self, state: DecodeState) -> None:
        self.state = state
        self.verifier.cache, self.verifier.lengths = state.cache, state.length

    def _prefill_admitted(self) -> None:
        """Prefill the rows admitted since the last call, together, and start them in the state (a stateful
        drafter's too, from the hidden states their prefill leaves)."""
        if not self._admitting:
            return
        engine = self.verifier
        prompts = {row: prompt for row, (prompt, _) in self._admitting.items()}
        engine.prefill_rows(prompts)
        state = self.state._replace(cache=engine.cache, length=engine.lengths)
        if _stateful(self.draft_fn):
            state = state._replace(drafter=self.draft_fn.begin_rows(engine.params, state.drafter, prompts,
                                                                    engine.prefill_hidden))
        for row, (prompt, seeds) in self._admitting.items():
            tokens = np.zeros(state.tokens.shape[1], np.int32)
            tokens[: len(prompt)] = prompt
            state = _admitted(state, row, tokens, seeds)
        self._admitting = {}
        self._set_state(state)
        self._set_rules()

    def _set_rules(self) -> None:
        """The device's copy of each row's budget and settings. While every row is greedy, the state carries no
        RowSampling and the cycle's program is the greedy rule's. No EOS stops a row on the device: the host
        applies each request's stop condition."""
        sampled = any(not r.greedy for r in self._rows)
        self.state = self.state._replace(sampling=jax.device_put(RowSampling.of(self._rows)) if sampled else None)
        self._stop = jax.device_put((self._budget, _NO_EOS))

    def drain(self) -> None:
        """Wait for the call in flight, whose results no one will read, so that it is not timed with what runs
        next."""
        if self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
        self._in_flight = None

    def _dispatch(self):
        """Dispatch one call of `cycles_per_call` cycles (it returns at once) -> its results, on the device."""
        self._prefill_admitted()
        engine = self.verifier
        engine.cache = None  # donated to the call
        engine.dispatches += 1
        self.state, results = self._steps(engine.params, self.state, *self._stop, _draft_params(self.draft_fn))
        engine.cache, engine.lengths = self.state.cache, self.state.length
        results.copy_to_host_async()  # the copy follows the call on the device; _read then finds it done
        return results

    def _read(self, results) -> None:
        """Wait for a call's results; its decode cycles' join the queue (a prefill cycle has none to hand out)."""
        self.device_cycles += self.cycles_per_call
        self._ready = unpack_cycles(np.asarray(results))[::-1] + self._ready
