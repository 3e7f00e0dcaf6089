"""The JAX fused cycle for the host loop and the server: a few of the engine's `decode_step`s per compiled call
(specdec.engines.verifier_jax holds the step itself, traced with its forward; docs/design.md, "The cycle")."""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from specdec.acceptance.rule_jax import RowSampling
from specdec.engines.verifier_jax import NO_EOS, DecodeState, JaxEngine, draft_params, stop_arrays, unpack_cycles
from specdec.errors import SpecdecError
from specdec.generate import CycleResult, StopCondition
from specdec.protocol import DeviceDraftFn, is_device_state
from specdec.sampling import SamplingParams, seed_words


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

    def __init__(self, engine: JaxEngine, draft_fn: DeviceDraftFn | None, k: int, sampling: SamplingParams = SamplingParams(),
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
        self._prefills_in_cycle = (engine.prefill_chunk is None and not is_device_state(self.draft_fn)
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
        if is_device_state(self.draft_fn):
            engine.start_transfer()
            return
        prompts = [[engine.cfg.pad_token_id]] * engine.batch
        state = jax.eval_shape(lambda cache: engine._decode_state(prompts, self.sampling, False, {},
                                                                  prefilled=not self._prefills_in_cycle, cache=cache),
                               engine.cache_shapes)
        device_stop = stop_arrays(stop.max_new_tokens, stop.eos_ids)
        lowered = [self._steps.lower(engine.param_shapes, state, *device_stop, None),
                   engine._reset_fn.lower(engine.cache_shapes)]  # start empties the cache first
        if not self._prefills_in_cycle:
            lowered.append(engine.lower_prefill())
        pool = ThreadPoolExecutor(len(lowered))
        self._compiling = [pool.submit(program.compile) for program in lowered]
        pool.shutdown(wait=False)
        engine.start_transfer()

    def compile_row_starts(self, longest_prompt: int) -> None:
        """A stateful drafter's programs that start an admitted row, for every prompt up to `longest_prompt` tokens
        (a server's warm-up: compile_ahead leaves a stateful drafter's programs to their first use)."""
        if is_device_state(self.draft_fn):
            self.draft_fn.compile_row_starts(self.verifier.params, longest_prompt)

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
        self._stop = stop_arrays(stop.max_new_tokens, stop.eos_ids)
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
        if is_device_state(self.draft_fn) and not self.draft_fn.sampling.greedy:
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
            drafter = self.draft_fn.init_state() if is_device_state(self.draft_fn) else {}
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
        if is_device_state(self.draft_fn):
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
        self._stop = jax.device_put((self._budget, NO_EOS))

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
        self.state, results = self._steps(engine.params, self.state, *self._stop, draft_params(self.draft_fn))
        engine.cache, engine.lengths = self.state.cache, self.state.length
        results.copy_to_host_async()  # the copy follows the call on the device; _read then finds it done
        return results

    def _read(self, results) -> None:
        """Wait for a call's results; its decode cycles' join the queue (a prefill cycle has none to hand out)."""
        self.device_cycles += self.cycles_per_call
        self._ready = unpack_cycles(np.asarray(results))[::-1] + self._ready
