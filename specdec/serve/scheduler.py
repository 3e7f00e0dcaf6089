"""Continuous batching: one thread owns the batch-B engine and runs every request in flight together.

Each iteration of the loop:
  1. drops requests whose client went away, and admits waiting requests into free rows (the engine's
     `prefill_row`, the other rows keeping their state; JAX prefills the rows admitted in one turn together);
  2. runs one cycle of every row: n-gram drafts, one `verify` of [pending, drafts] for all B rows (drafts
     padded to k, with per-row lengths), acceptance;
  3. hands each request its new tokens (its stop condition applied); the accepted tokens + 1 of the rows
     that go on are committed, free and finished rows ride along and commit nothing.

Step 2 is one fused cycle over the whole batch, on either engine: drafting over the device token buffer, verify,
acceptance and commit are one CUDA graph replay (torch) or one compiled call (JAX) and one read of the results,
as in `specdec generate`. Each row is accepted by its request's sampling settings (greedy rows by the greedy rule
alone while no sampled request is in flight), its draws keyed by its seed and position (specdec.acceptance), so a
seeded request draws the same numbers whatever else shares the batch. On a GPU the next cycle is launched before
this one's results are read, so the device decodes while this thread hands out tokens. Before it admits a
request, the loop hands out the cycles run or in flight, which ran over the rows as they were. The JAX engine can
run several cycles a call (`cycles_per_call`), which spreads a call's host cost over them: a request then joins
and leaves between calls, and a row stopped by EOS or a stop string decodes on to its call's end, unread.

Every row of every forward runs at one fixed number of tokens (the engine's row-invariant decode width), so a
request's tokens are those it gets alone in the same server. A torch cycle runs over the first rows alone where fewer
are busy (FusedCycle's widths: 1, 2, 4, ... rows and the batch), at those widths whose forward the engine checked to
give a row the whole batch's bits (TorchEngine.widths_keeping_bits); a lone request then does not pay for the idle
rows.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from specdec.drafters import registry as drafter_registry
from specdec.errors import SpecdecError
from specdec.generate import CycleResult, SpecStats, StopCondition
from specdec.protocol import Verifier
from specdec.sampling import SamplingParams

log = logging.getLogger("specdec.serve")

# A JAX server's default cycles a call. A call costs the host ~0.7 ms (its ~230 arrays), about a 270M cycle's
# device time at 8 rows; two cycles a call served 5-14% more tokens/s to 1-8 clients on an H200, and a request
# waits at most one call longer to join (docs/journal). A torch cycle is one graph replay.
JAX_CYCLES_PER_CALL = 2


def narrower_widths(batch: int) -> list[int]:
    """The widths below the batch a torch server's cycle may run over: 1, 2, 4, ... rows."""
    return [1 << i for i in range(batch.bit_length()) if 1 << i < batch]


def widths_label(widths) -> str:
    """What a server's description (its start line, a load record's, a plot's) adds for its cycle widths: ""
    where every cycle runs every row."""
    return f", cycles over {'/'.join(map(str, widths))} rows" if len(widths) > 1 else ""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests are drafted, as vLLM's `--speculative-config` says it: `method` (a drafter kind's
    vllm_method: ngram, eagle3, draft_model, mtp; None or "none": plain decoding, one token a verify), `model`
    (the drafter's directory), `num_speculative_tokens` (k), and the method's own keys (ngram's
    prompt_lookup_min/max, eagle3's parallel_drafting) in `options`."""

    method: str | None = None
    num_speculative_tokens: int = 0
    model: str | None = None
    options: tuple[tuple[str, object], ...] = ()

    @classmethod
    def from_json(cls, text: str | None) -> "SpeculativeConfig":
        import json

        if not text:
            return cls()
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"--speculative-config is not JSON ({e}): {text!r}") from None
        if not isinstance(fields, dict):
            raise SpecdecError(f"--speculative-config must be a JSON object, got {text!r}")
        _, k, _ = drafter_registry.from_speculative_config(fields)  # checks every key
        if k == 0:
            return cls()
        options = {name: value for name, value in fields.items() if name not in ("method", "num_speculative_tokens", "model")}
        return cls(fields["method"], k, fields.get("model"), tuple(sorted(options.items())))

    @property
    def k(self) -> int:
        return self.num_speculative_tokens if self.method not in (None, drafter_registry.NONE) else 0

    def as_json(self) -> dict:
        """The settings as --speculative-config spells them."""
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        return {**fields, **({"model": self.model} if self.model else {}), **dict(self.options)}

    def source(self, target_path=None) -> drafter_registry.DrafterSource:
        """The drafter, for the target checkpoint a server loads."""
        spec, _, options = drafter_registry.from_speculative_config(self.as_json()) if self.k else ("none", 0, {})
        return drafter_registry.DrafterSource(spec, target_path, **options)


@dataclass
class Update:
    """What one iteration gave a request: its newly kept tokens, and whether it is finished (or failed)."""

    tokens: list[int]
    finished: bool = False
    error: str | None = None


@dataclass
class Request:
    """One generation in the scheduler. `on_update` is called from the scheduler thread."""

    prompt: list[int]
    sampling: SamplingParams  # seed set: the request's own random stream
    stop: StopCondition
    on_update: Callable[[Update], None]
    tokens: list[int] = field(default_factory=list)  # kept so far (stop token included)
    stats: SpecStats | None = None  # its own cycles' counts, from submission on
    cancelled: bool = False  # set by the client's side: the scheduler drops it at its next iteration

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """Runs requests on a batch-B verifier with continuous batching (module docstring). `submit` from any
    thread; `stats` (SpecStats over every row cycle) and the counters are read by the metrics."""

    def __init__(self, engine: Verifier, speculative: SpeculativeConfig, cycles_per_call: int | None = None,
                 narrow_cycles: bool = True, source: drafter_registry.DrafterSource | None = None):
        """`cycles_per_call` None: JAX_CYCLES_PER_CALL on the JAX engine, 1 on torch. `narrow_cycles` False: every
        torch cycle runs every row (the widths are not checked or compiled). `source`: the drafter as the server
        opened it for its target, whose taps the engine returns (None: `speculative.source()`, for drafters that
        need no target files, as n-gram)."""
        if speculative.k > engine.k_max:
            raise SpecdecError(f"num_speculative_tokens={speculative.k} exceeds the engine's k_max {engine.k_max}")
        self._jax = engine.framework == "jax"
        if cycles_per_call is None:
            cycles_per_call = JAX_CYCLES_PER_CALL if self._jax else 1
        self.cycles_per_call = cycles_per_call
        self.narrow_cycles = narrow_cycles
        self.engine = engine
        self.speculative = speculative
        self.k = speculative.k
        self.rows: list[Request | None] = [None] * engine.batch  # the request each row runs
        self.waiting: deque[Request] = deque()
        self.stats = SpecStats(k=self.k)
        self.prompt_tokens = 0
        self.steps = 0  # verify forwards of the whole batch
        self.cycle = self._fused_cycle(source or speculative.source())
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)

    def _fused_cycle(self, source: drafter_registry.DrafterSource):
        """The fused cycle over the whole batch, its rows free: torch's FusedCycle (a graph replay a cycle), or a
        JaxFusedCycle of `cycles_per_call` cycles a call. The drafter drafts greedily whatever a row samples: its
        drafts are then a point mass, which the acceptance rule keeps lossless for sampled rows too (as vLLM's
        EAGLE proposer), and one drafter serves rows of any settings."""
        if not self._jax and self.cycles_per_call != 1:
            raise SpecdecError(f"--cycles-per-call {self.cycles_per_call}: only the JAX engine runs several cycles "
                               "a call (a torch cycle is one graph replay)")
        drafter = source.build(self.engine, self.k) if self.k else None
        draft_fn = drafter.device_draft_fn(self.engine.framework, self.k) if drafter is not None else None
        if self._jax:
            from specdec.engines.cycle_jax import JaxFusedCycle

            return JaxFusedCycle(self.engine, draft_fn, self.k, cycles_per_call=self.cycles_per_call)
        from specdec.engines.cycle_torch import FusedCycle

        # a drafter's state on the device spans the batch: its cycles run every row
        narrow = self.narrow_cycles and not (drafter is not None and drafter.stateful)
        narrower = narrower_widths(self.engine.batch) if narrow else []
        widths = self.engine.widths_keeping_bits(narrower)
        log.info("torch cycles over %s rows (each checked to keep a row's bits)", ", ".join(map(str, widths)))
        cycle = FusedCycle(self.engine, draft_fn, self.k, widths=widths)
        for b in range(self.engine.batch):
            cycle.retire(b)
        return cycle

    @property
    def running(self) -> int:
        return sum(row is not None for row in self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()

    def submit(self, request: Request) -> None:
        request.stats = SpecStats(k=self.k)
        with self._wakeup:
            self.waiting.append(request)
            self._wakeup.notify()

    def reset_stats(self) -> None:
        """Count from zero (after the warm-up)."""
        self.stats = SpecStats(k=self.k)
        self.prompt_tokens = 0
        self.steps = 0

    def generate(self, prompt: list[int], sampling: SamplingParams, stop: StopCondition) -> list[int]:
        """One request, waiting for it (warm-up)."""
        done = threading.Event()
        errors: list[str] = []

        def on_update(update: Update) -> None:
            if update.error:
                errors.append(update.error)
            if update.finished:
                done.set()

        request = Request(prompt, sampling, stop, on_update)
        self.submit(request)
        done.wait()
        if errors:
            raise SpecdecError(errors[0])
        return request.tokens

    # -- the loop ------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopping and not self.waiting and not self.running:
                    self._wakeup.wait()
                if self._stopping:
                    return
            self._turn()

    def _turn(self) -> None:
        """One iteration of the loop (module docstring)."""
        try:
            self._drop_cancelled()
            self._admit()
            if self.running:
                self._step()
        except Exception as e:  # a bug: fail the requests in flight, keep serving
            log.exception("decoding step failed")
            for b, row in enumerate(self.rows):
                if row is not None:
                    row.on_update(Update([], finished=True, error=f"internal error: {e}"))
                    self._free(b)

    def _active(self) -> list[int]:
        return [b for b, row in enumerate(self.rows) if row is not None]

    def _collect(self) -> None:
        """Hand out the cycles run or in flight, if any, to the rows still running. An admission comes after
        them: they ran over the rows as they were."""
        while (result := self.cycle.collect()) is not None:
            self._deliver(self._active(), result)

    def _drop_cancelled(self) -> None:
        for b, row in enumerate(self.rows):
            if row is not None and row.cancelled:
                self._free(b)

    def _free(self, b: int) -> None:
        """Free a row; its cache stays as it is until the next request's prefill_row."""
        self.rows[b] = None
        self.cycle.retire(b)

    def _admit(self) -> None:
        for b in range(len(self.rows)):
            if self.rows[b] is not None:
                continue
            request = self._next_waiting()
            if request is None:
                return
            self._collect()
            try:
                self.cycle.admit(b, request.prompt, request.stop.max_new_tokens, request.sampling)
            except Exception as e:  # the server checked the prompt: a bug, but only this request's
                log.exception("prefill failed")
                request.on_update(Update([], finished=True, error=f"prefill failed: {e}"))
                continue
            self.prompt_tokens += len(request.prompt)
            self.rows[b] = request

    def _next_waiting(self) -> Request | None:
        with self._wakeup:
            while self.waiting:
                request = self.waiting.popleft()
                if not request.cancelled:
                    return request
        return None

    def _step(self) -> None:
        # The cycle in flight was launched over these rows (admissions collect it first); rows freed since
        # ride along in it and are not handed its tokens. No cycle runs ahead of a due admission.
        with self._wakeup:
            admission_due = bool(self.waiting) and any(row is None for row in self.rows)
        self._deliver(self._active(), self.cycle.step(prefetch=self.cycle.prefetch and not admission_due))

    def _deliver(self, active: list[int], result: CycleResult) -> None:
        """Hand each active request its cycle's tokens, free the finished rows."""
        self.steps += 1
        for b in active:
            request = self.rows[b]
            emitted = result.emitted(b)
            kept, finished = request.stop.take(request.tokens, emitted)
            request.tokens.extend(kept)
            for stats in (self.stats, request.stats):
                stats.record(int(result.draft_len[b]), int(result.num_accepted[b]), len(emitted), len(kept))
            if finished:
                self._free(b)
            request.on_update(Update(kept, finished))

