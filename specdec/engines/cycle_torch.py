"""The PyTorch fused cycle: draft, verify, accept and emit on the device, one CUDA graph replay a cycle
(specdec.engines.verifier_torch runs the forwards it replays; docs/design.md, "The cycle")."""

from __future__ import annotations

import torch

from specdec.acceptance.rule_torch import RowSampling, accept_greedy, accept_sampled, keyed_uniform
from specdec.engines.verifier_torch import TorchEngine, capture_graph, chunk_positions, compiled
from specdec.errors import SpecdecError
from specdec.generate import CycleResult
from specdec.protocol import is_device_state
from specdec.sampling import SamplingParams, seed_words


def cycle_inputs(buffer, context_len, lengths, draft, pad_tokens):
    """A cycle's forward inputs: each row's pending token (buffer[context_len - 1]), its drafts and `pad_tokens`
    up to the forward's width, and their positions from lengths."""
    pending = buffer.gather(1, (context_len - 1)[:, None])
    tokens = torch.cat([pending, draft, pad_tokens], dim=1)
    return tokens, chunk_positions(lengths, tokens.shape[1])


def emit(buffer, context_len, limit, lengths, draft, draft_len, num_accepted, next_token):
    """After acceptance: write each row's emitted tokens (its accepted drafts, then the target's token) after its
    context in `buffer` and advance context_len and lengths in place; -> (emitted [B, k + 1], advance [B], lengths
    before the advance, and what the host reads of the cycle, packed into one tensor for one copy). Slots past
    the emitted tokens get junk that the next cycle overwrites (they lie beyond the new context length).

    A row's last cycle may accept past its budget: it keeps no more than the budget, so the cache does not either.
    Past it, the forwards a finished row rides along in would run its positions off the context."""
    j = torch.arange(draft.shape[1] + 1, device=draft.device)[None]
    padded = torch.cat([draft, next_token[:, None]], dim=1)
    emitted = torch.where(j < num_accepted[:, None], padded, next_token[:, None])
    slots = (context_len[:, None] + j).clamp(max=buffer.shape[1] - 1)
    buffer.scatter_(1, slots, emitted)
    live = context_len < limit
    advance = torch.minimum(num_accepted + 1, limit - context_len) * live
    start = lengths.clone()
    lengths += advance
    context_len += advance
    packed = torch.cat([num_accepted[:, None], next_token[:, None], draft_len[:, None], draft], dim=1)
    return emitted, advance, start, packed


def accept_and_emit(buffer, context_len, limit, lengths, draft, draft_len, logits):
    """Greedy acceptance (accept_greedy), then emit."""
    num_accepted, next_token = accept_greedy(draft, draft_len, logits)
    return emit(buffer, context_len, limit, lengths, draft, draft_len, num_accepted, next_token)


class FusedCycle:
    """A whole cycle for a device-side drafter as one CUDA graph replay: draft from the device token buffer,
    verify, accept, append the emitted tokens to the buffer, advance the cache. The host reads only the
    small per-row result (one sync per cycle). Eager on CPU, same operations.

    `draft_fn` is a device drafter's function (specdec.protocol.DeviceDrafter) proposing k tokens, or a
    stateful device drafter (specdec.drafters.eagle3_torch.TorchEagle3: `draft`, then `observe` of the
    verify's hidden states, on static buffers captured with the cycle); with k = 0 nothing is drafted
    (draft_fn may be None) and each cycle is one plain decode step. Greedy sampling keeps the
    argmax-matching prefix. Otherwise lossless rejection sampling against the drafter's probabilities (a
    point mass for a deterministic drafter). Each row has its own settings and seed (`start` gives every row
    `sampling`, row b the seed sampling.seed + b; `admit` a request's own), and draws keyed by its seed and
    position (specdec.acceptance): a seeded request draws the same numbers whatever ran before it or beside it,
    graphed or eager. A row's draws for every position of the context are hashed when its settings are set, so
    that a cycle gathers them: the hash is some sixty small kernels, a gather one. A cycle whose live rows are
    all greedy runs the greedy rule alone; otherwise one capture per set of filters the sampled rows use, each
    row warped by its own settings.

    `prefetch` (default: where there are graphs to replay): `step` launches the next cycle before it reads this
    one's results, so the device runs a cycle while the host streams the last one's tokens (nothing the host
    decides feeds the next cycle: budgets are on the device, and a row's tokens past its end are dropped). The
    cycle run after the last one read is wasted; `drain` waits for it. A server decides per step, and reads the
    cycle in flight (`collect`) before it admits or loads a row: that cycle ran over the rows as they were.
    A stateful drafter starts an admitted row alone too (`begin_row`), from the hidden states the row's prefill
    leaves; it must be greedy (SamplingParams()), its drafts a point mass for every row's rule, since a sampling
    drafter's random stream is the batch's. A retired row rides along, drafting from its state as it was; its
    drafts and results are junk that no other row reads.

    `widths` (a server's, stateless drafters only): a cycle runs over the first w rows alone, w the narrowest of
    them that holds every row admitted and not retired, as vLLM captures a graph per batch size. A lone request
    on a wide server then pays for its own row, not for every row. Each width is a graph over views of the first
    rows of the buffers and the cache; the engine checked that each gives a row the whole batch's bits
    (TorchEngine.widths_keeping_bits), so a request's tokens do not depend on how many rows run beside it."""

    cycles_per_call = 1  # a replay runs one cycle (JaxFusedCycle's run several)

    def __init__(self, engine: TorchEngine, draft_fn, k: int, sampling: SamplingParams = SamplingParams(),
                 prefetch: bool | None = None, widths: tuple[int, ...] | None = None):
        if not 0 <= k <= engine.k_max:
            raise SpecdecError(f"k={k} is outside 0..{engine.k_max} (the engine's captured maximum)")
        if k > 0 and draft_fn is None:
            raise SpecdecError(f"k={k} drafts need a draft function")
        self.verifier, self.draft_fn, self.k, self.sampling = engine, draft_fn, k, sampling
        self.drafter = draft_fn if k > 0 and is_device_state(draft_fn) else None
        self.widths = tuple(sorted(widths or (engine.batch,)))
        if self.widths[-1] != engine.batch or self.widths[0] < 1:
            raise SpecdecError(f"cycle widths {self.widths}: each within 1..{engine.batch}, the batch among them")
        if self.drafter is not None and len(self.widths) > 1:
            raise SpecdecError("a stateful drafter's state spans the batch: its cycle runs every row")
        self._live = [False] * engine.batch  # rows admitted and not retired: a cycle's width holds them
        # With the engine's forward compiled, so are the cycle's other pieces (a stateful drafter compiles
        # its own step): its inputs, greedy acceptance and the bookkeeping after it, in CUDA graphs some twenty
        # small eager kernels otherwise. Greedy acceptance is an argmax either way (lowest id on ties), and the
        # rest is integer arithmetic, so compiling changes no token. Sampled acceptance stays eager, as in the
        # host loop: fused floats would round differently from it.
        maybe_compiled = compiled if engine.compiles else (lambda fn: fn)
        self._inputs, self._emit, self._accept_and_emit = map(maybe_compiled, (cycle_inputs, emit, accept_and_emit))
        if engine.compiles and k > 0 and self.drafter is None:
            self.draft_fn = compiled(draft_fn)
        self._pad_tokens = engine.padding(k + 1)
        self.buffer = torch.zeros(engine.batch, engine.max_seq_len + k + 1, dtype=torch.long, device=engine.device)
        self.context_len = torch.zeros(engine.batch, dtype=torch.long, device=engine.device)  # pending included
        self.limit = torch.zeros_like(self.context_len)  # a row advances while context_len < limit
        self._no_drafts = torch.zeros_like(self.context_len)  # draft_len at k = 0
        self.rows = [SamplingParams()] * engine.batch  # each row's settings, for the host to pick the rule
        self.row_sampling = RowSampling.of(self.rows, engine.device)  # the same on the device
        # Each row's keyed draws at every position [B, max_seq_len, k + 1], made when a sampled row is set.
        self.draws = torch.zeros(engine.batch, engine.max_seq_len, k + 1, device=engine.device)
        self._graphs: dict = {}  # per (rule (None: greedy; else the filters), width): (graph, packed results)
        self._pool = None  # the graphs' shared memory: one replays at a time, its results copied out at once
        self.prefetch = engine.use_graphs if prefetch is None else prefetch
        self._in_flight: tuple | None = None  # (event, results) of a launched cycle that step has not read
        self._launches = 0
        self._host_results: list[torch.Tensor] = []  # pinned; two, so that a cycle in flight does not write the one read
        self.device_cycles = 0  # cycles whose results step read, one per step

    decode_cycles_in_start = 0  # start prefills alone (run_cycles times it apart)

    def start(self, prompts: list[list[int]], stop=None) -> None:
        """Prefill the prompts and seed the sampler. Rows stop on the host, but a row that has emitted its token
        budget (`stop.max_new_tokens`) stops advancing on the device: it rides along until every row is done
        without running past the context the budget was checked against. A cycle still in flight from an earlier
        run is dropped (the prefill, queued after it, overwrites what it advanced)."""
        self._in_flight = None
        self.verifier.prefill(prompts)
        self.buffer.zero_()
        for b, prompt in enumerate(prompts):
            self.buffer[b, : len(prompt)] = torch.tensor(prompt, device=self.buffer.device)
        self.context_len.copy_(torch.tensor([len(p) for p in prompts], device=self.buffer.device))
        budget = stop.max_new_tokens if stop is not None else self.verifier.max_seq_len
        self.limit.copy_(self.context_len + budget)
        for b, seed in enumerate(self.sampling.row_seeds(len(prompts))):
            self._set_sampling(b, self.sampling, seed)
        if self.drafter is not None:
            self.drafter.begin(prompts, self.verifier.prefill_hidden)
        self._live = [True] * len(prompts)

    def admit(self, row: int, prompt: list[int], max_new_tokens: int,
              sampling: SamplingParams = SamplingParams()) -> None:
        """Start a request in one row while the other rows keep theirs (continuous batching): prefill it alone,
        start a stateful drafter's row from it, load its prompt into the row's token buffer, set its sampling
        settings and seed (None: 0)."""
        if self.drafter is not None and not self.drafter.sampling.greedy:
            raise SpecdecError("rows are admitted one by one only beside a greedy drafter (SamplingParams()): a "
                               "sampling drafter draws from one random stream for the whole batch")
        self._refuse_in_flight("admitted")
        self.verifier.prefill_row(row, prompt)
        if self.drafter is not None:
            self.drafter.begin_row(row, prompt, self.verifier.prefill_hidden[row])
        self.load_row(row, prompt)
        self.limit[row] = len(prompt) + max_new_tokens  # it advances while its context is shorter
        self._set_sampling(row, sampling, sampling.seed or 0)
        self._live[row] = True

    def _set_sampling(self, row: int, sampling: SamplingParams, seed: int) -> None:
        self.rows[row] = sampling
        for name in RowSampling.SETTINGS:
            getattr(self.row_sampling, name)[row] = getattr(sampling, name)
        if not sampling.greedy:
            positions = torch.arange(self.verifier.max_seq_len, device=self.draws.device)
            seeds = torch.from_numpy(seed_words([seed])).to(self.draws.device).expand(len(positions), 2)
            self.draws[row] = keyed_uniform(seeds, positions, self.k + 1)

    def load_row(self, row: int, context: list[int]) -> None:
        """Set one row's tokens (prompt + emitted, the last one pending), whose keys and values but the last are in
        the cache."""
        self._refuse_in_flight("loaded")
        self.buffer[row, : len(context)] = torch.tensor(context, device=self.buffer.device)
        self.context_len[row] = len(context)

    def retire(self, row: int) -> None:
        """Stop one row advancing: it rides along, drafting from the one token it keeps, until it is admitted again.
        A cycle in flight may still advance it once; its results for the row are the caller's to ignore."""
        self.limit[row] = 0
        self.context_len[row].clamp_(min=1)  # the pending token is read at context_len - 1
        self.rows[row] = SamplingParams()  # a retired row's draws are never read: it needs no sampled rule
        self._live[row] = False

    def width(self) -> int:
        """The rows the next cycle runs: the narrowest width that holds every live row."""
        needed = max((b + 1 for b, live in enumerate(self._live) if live), default=1)
        return next(w for w in self.widths if w >= needed)

    def _draft(self, buffer, context_len):
        """-> (draft [B, k], draft_len [B], draft probabilities [B, k, V] or None for a point mass)."""
        if self.k == 0:
            return buffer[:, :0], self._no_drafts[: len(buffer)], None
        if self.drafter is not None:
            return self.drafter.draft()
        return *self.draft_fn(buffer, context_len), None

    def _rule(self) -> frozenset[str] | None:
        """The acceptance the rows need: None (all greedy), else the filters any sampled row uses."""
        sampled = [r for r in self.rows if not r.greedy]
        return frozenset().union(*(r.filters for r in sampled)) if sampled else None

    def _cycle(self, rule: frozenset[str] | None, width: int):
        """One cycle over the first `width` rows (views of the buffers and the cache; all of them at the batch)."""
        engine = self.verifier
        whole = width == engine.batch
        buffer, context_len, limit, lengths, pad_tokens, draws = (
            t[:width] for t in (self.buffer, self.context_len, self.limit, engine.lengths, self._pad_tokens, self.draws))
        draft, draft_len, draft_probs = self._draft(buffer, context_len)
        tokens, positions = self._inputs(buffer, context_len, lengths, draft, pad_tokens)
        out = engine._forward(tokens, positions, None if whole else engine.cache.rows(0, width))
        logits = out.logits[:, : self.k + 1]
        rows = (buffer, context_len, limit, lengths, draft, draft_len)
        if rule is None:
            emitted, advance, start, packed = self._accept_and_emit(*rows, logits)
        else:  # each row's draws at its pending token's position, which engine.lengths holds
            batch = torch.arange(width, device=draft.device)
            uniform = draws[batch, lengths.clamp(max=engine.max_seq_len - 1)]
            accepted = accept_sampled(draft, draft_len, draft_probs, logits, self.row_sampling.first(width, rule),
                                      uniform)
            emitted, advance, start, packed = self._emit(*rows, *accepted)
        if self.drafter is not None:
            self.drafter.observe(out.hidden, emitted, advance, start)
        return packed

    def _refuse_in_flight(self, what: str) -> None:
        if self._in_flight is not None:
            raise SpecdecError(f"a row is {what} while a cycle is in flight, which ran over the rows as they were: "
                               "collect it first")

    def _capture(self, rule: frozenset[str] | None, width: int) -> None:
        """Warm up and capture on a side stream, putting back the state each cycle advanced. Every one of
        them must start from the committed state: their cache writes then lie within one forward width past
        the committed length, rolled back like rejected drafts. Cycles chained from one another would write
        further and overwrite ring slots that the window still needs. A sampled drafter's generator is put
        back too, so the first replay draws what an eager first cycle would; registered with the graph, it
        gives each replay fresh numbers (its offset advances by the graph's draws, as eager cycles advance it)."""
        engine = self.verifier
        state = [self.buffer, self.context_len, engine.lengths] + (self.drafter.state() if self.drafter else [])
        saved = [t.clone() for t in state]
        generators = [self.drafter.generator] if self.drafter is not None and self.drafter.generator is not None else []
        saved_rng = [g.get_state() for g in generators]

        def restore():
            for live, snapshot in zip(state, saved):
                live.copy_(snapshot)
            for g, rng in zip(generators, saved_rng):
                g.set_state(rng)

        self._pool = self._pool or torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            graph, outputs = capture_graph(lambda: self._cycle(rule, width), warmups=2, after_each=restore,
                                           pool=self._pool, generators=generators)
        restore()
        self._graphs[rule, width] = (graph, outputs)

    def capture_widths(self, rule: frozenset[str] | None) -> None:
        """Capture the cycle of `rule` at every width, so that a server's warm-up requests, each at the narrowest,
        leave no request to wait for a capture."""
        for width in self.widths:
            if (rule, width) not in self._graphs:
                self._capture(rule, width)

    def _launch(self) -> tuple:
        """Queue one cycle and the copy of its results to the host -> (event to wait for or None, results)."""
        rule, width = self._rule(), self.width()
        if self.verifier.use_graphs:
            if (rule, width) not in self._graphs:  # a rule's first cycle captures it at every width
                self.capture_widths(rule)
            graph, packed = self._graphs[rule, width]
            graph.replay()
        else:
            with torch.inference_mode():
                packed = self._cycle(rule, width)
        if packed.device.type != "cuda":
            return None, packed.clone()
        if not self._host_results:  # the whole batch's rows; a narrower cycle fills the first
            shape = (self.verifier.batch, packed.shape[1])
            self._host_results = [torch.empty(shape, dtype=packed.dtype, pin_memory=True) for _ in range(2)]
        host = self._host_results[self._launches % 2][:width]
        self._launches += 1
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event, host

    def step(self, prefetch: bool | None = None) -> CycleResult:
        """This cycle's results (the one in flight, else one launched now); `prefetch` (None: the cycle's
        setting) launches the next one first."""
        launched = self._in_flight if self._in_flight is not None else self._launch()
        self._in_flight = self._launch() if (self.prefetch if prefetch is None else prefetch) else None
        return self._read(*launched)

    def collect(self) -> CycleResult | None:
        """The results of the cycle in flight, launching none; None if there is none."""
        if self._in_flight is None:
            return None
        launched, self._in_flight = self._in_flight, None
        return self._read(*launched)

    def _read(self, event, host) -> CycleResult:
        if event is not None:
            event.synchronize()
        self.device_cycles += 1
        results = host.numpy().copy()
        return CycleResult(results[:, 0], results[:, 1], results[:, 3:], results[:, 2])

    def drain(self) -> None:
        """Wait for the cycle in flight, whose results no one will read, so that it is not timed with what
        runs next."""
        if self._in_flight is not None and self._in_flight[0] is not None:
            self._in_flight[0].synchronize()
        self._in_flight = None
