"""The PyTorch verifier: a GemmaModel, its static KV cache, and one decode forward of fixed width.

Row invariance (the default, `invariant=True`): every decode forward, a plain one-token step as much as a
K+1-token verify, runs `decode_width(k_max)` rows wide (k_max + 1 rounded up to a multiple of 8), the
real tokens first and pad tokens after them. Matmul, norm and softmax kernels are then always launched at
the same shapes, and a decode forward commits its keys/values before attending (gemma_torch), so a row's
logits, hidden states and committed keys/values are bitwise the same wherever it sits in the forward and
whatever the rows after it hold: greedy speculative decoding emits exactly the plain decode's tokens,
near-ties included. The pad rows cost little on a GPU, where decoding is bound by reading the weights.
`invariant=False` runs each forward at its own width (faster on CPU, where the pad rows are real
arithmetic); its speculative output can then differ from plain decoding where the target's top-2 logits
are a floating-point near-tie.

On CUDA each forward width is captured once as a CUDA graph and replayed: the model is launch-bound at
small batch, and a replay issues hundreds of kernels for the price of one launch. `compile=True` (the
default on CUDA) first fuses the forward's elementwise work with torch.compile (~1 minute, cached on
disk by inductor), so each replay also runs far fewer kernels; a fused cycle's drafting and acceptance
are compiled with it, and prefill runs a compiled program of its own, dynamic in the prompt's length, each chunk
padded to a multiple of 64 tokens (with `graph_prefill`, replayed as a graph of that width). On CPU
the forwards run eagerly. Graphed and eager run the same kernels on the same buffers, so they give the same tokens.
"""

from __future__ import annotations

import functools
import itertools
import os

import torch

from specdec.errors import SpecdecError
from specdec.generate import check_context
from specdec.models import skinny_gemm
from specdec.models.config import SLIDING, decode_width, round_up
from specdec.models.gemma_torch import SPLIT_MAX_ROWS, GemmaModel, KVCache
from specdec.protocol import VerifyOutput

PREFILL_CHUNK = 512  # prompt tokens per prefill forward (bounds activation memory)
# Graphed prefill pads a chunk to a multiple of this many tokens, past SPLIT_MAX_ROWS (where the compiled forward
# splits its products, another program): a graph per multiple, and at most 63 pad tokens of work.
PREFILL_WIDTH_STEP = 64
# A prefill of one row is graphed in engines of at most this batch: a graph per row and width (a server's rows,
# captured by warm_up_prefill). Distillation's batches of hundreds prefill their rows one run of equal lengths at a
# time, most of one row: a graph for each would be hundreds.
GRAPHED_PREFILL_MAX_BATCH = 16


PERSISTENT_REDUCTION_WIDTH = 8192  # rows up to this wide are reduced in one pass from registers


def _configure_compile(model: GemmaModel | None = None) -> None:
    # Every model, width and batch in a process is one more compilation of a function. Past dynamo's limit
    # (8) it would silently run eager, and eager rounds differently from compiled: a plain and a
    # speculative decode could then disagree. Allow many, and fail loudly past them.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    from torch._inductor import config

    # A user's own heuristics stay; a torch without the setting (pyproject admits 2.4 on) keeps its own limit.
    if getattr(config, "inductor_choices_class", "absent") is None:
        config.inductor_choices_class = wide_persistent_reductions
        # Inductor makes a thread's handler from the setting once, at the thread's first compilation: after an
        # earlier one, the setting alone would change the compile cache's key and not the kernels.
        from torch._inductor.virtualized import V

        V.set_choices_handler(wide_persistent_reductions())
    # Programmatic dependent launch (inductor's, on Hopper and later): each Triton kernel is launched while the
    # one before it drains, and waits in-kernel for the values it reads. The same kernels in the same order, so
    # the same bits; a 270M cycle on an H100 took 0.800 ms without, 0.721-0.728 with (docs/journal, issue
    # 11). TORCHINDUCTOR_ENABLE_PDL, where set, decides instead.
    if hasattr(config.triton, "enable_pdl") and "TORCHINDUCTOR_ENABLE_PDL" not in os.environ:
        config.triton.enable_pdl = True
    # skinny_gemm leaves a product's slices (up to 16) to be added where they are read. RoPE reads q and k twice
    # (rotate_half), so the sum there counts as 2 x slices reads; past inductor's threshold (4) it is written out
    # instead, and the q/k/v epilogue broke into four kernels where it ran in two (38 more a 270M cycle, H100).
    # Where the kernel does not run, inductor's own threshold stays.
    if skinny_gemm.available():
        config.realize_reads_threshold = max(config.realize_reads_threshold, 2 * skinny_gemm.MAX_SPLITS)
    if model is not None and model.tp_parts is not None:
        # Parts promise the same bits on every device count, whose programs inductor fuses differently (a
        # collective ends a fused kernel). Fused, inductor drops the rounding of a bf16 result that the next
        # operation reads, so the bits would depend on where kernels end: keep every rounding, as eager does.
        # On an H100, 1 and 2 ranks of a 31B cut differed in the bits without this and agreed with it.
        config.emulate_precision_casts = True
        if hasattr(config, "deterministic"):  # nor reduction configurations chosen by timing (they set the order)
            config.deterministic = True
    # Combo kernels: inductor launches independent kernels as one (horizontal fusion). A decode layer's q
    # epilogue and its k/v epilogue with the cache write read the same products and nothing of each other: one
    # launch where there were two. Its block sizes are chosen per compiled graph, and every decode forward runs at
    # the engine's one width, so a row's bits still do not depend on how many tokens a forward verifies (the GPU
    # row-invariance tests pass with it). On an H100 the 270M's cycle ran 191 kernels in 0.565 ms of GPU time where
    # it ran 215 in 0.589 (docs/journal, issue 11). Triton's alone (GPUs). Not in a process that holds
    # tensor-parallel parts (emulate_precision_casts, set above, stays set for it, as later calls without a model,
    # `compiled`'s, must not switch them back on): a combined kernel shares block sizes across what it combines,
    # and which kernels meet depends on where collectives cut the program, so a reduction's layout could differ
    # between device counts. Parts were checked on two GPUs without them.
    if torch.cuda.is_available() and hasattr(config, "combo_kernels"):
        config.combo_kernels = not config.emulate_precision_casts


def wide_persistent_reductions():
    """Inductor's heuristics, except that a reduction along rows up to PERSISTENT_REDUCTION_WIDTH wide is
    persistent (the row held in registers, one pass) where inductor stops at 1,024 and loops over wider rows,
    reading them twice. A decode forward's norms reduce 16 rows of the hidden size (2,560 in E4B, 5,376 in the
    31B): on an H200 they took 4.5-5.8 us looped and take 2.7-3.5 us persistent, 1.1% of the 31B's forward and
    2.1% of E4B's. Set as inductor's `inductor_choices_class`, whose uuid() enters the compile cache's key."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class WidePersistentReductions(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
            if (config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER):
                return V.graph.sizevars.statically_known_leq(features.reduction_numel, PERSISTENT_REDUCTION_WIDTH)
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

        def uuid(self) -> str:
            return f"specdec-persistent-reductions-{PERSISTENT_REDUCTION_WIDTH}"

    return WidePersistentReductions()


def compiled_forward(model: GemmaModel, one_width: bool = True):
    """The model's decode forward under torch.compile, compiled once per model and kind and shared by its engines.
    `one_width` (an invariant engine's): static shapes, a program for the one width it runs. Left to dynamo, that
    program came out dynamic in T wherever a compiled prefill (dynamic in the chunk's length, the same function)
    had run first, as in every decode after a prompt of more than SPLIT_MAX_ROWS tokens. Engines whose widths vary
    share another program, which dynamo makes dynamic in T once a second width runs."""
    attribute = "_compiled_forward" if one_width else "_compiled_forward_any_width"
    if getattr(model, attribute, None) is None:
        _configure_compile(model)
        setattr(model, attribute, torch.compile(model.forward, fullgraph=True, dynamic=False if one_width else None))
    return getattr(model, attribute)


def compiled_prefill(model: GemmaModel):
    """The model's forward for prefill chunks under torch.compile, dynamic in the chunk's length: one program
    serves every prompt, where the eager forward spends ~25 ms per prompt launching its kernels from Python.
    Its own compilation (not compiled_forward's): dynamo keeps each torch.compile's programs apart, so a
    decode forward never runs this dynamic-shape program. Only the tensors' length is marked dynamic
    (`dynamic=True` would make integer arguments such as the hidden layers' indices symbolic too)."""
    if getattr(model, "_compiled_prefill", None) is None:
        _configure_compile(model)
        forward = torch.compile(model.forward, fullgraph=True)

        def prefill(tokens, positions, cache, **kwargs):
            for tensor in (tokens, positions):
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
            return forward(tokens, positions, cache, **kwargs)

        model._compiled_prefill = prefill
    return model._compiled_prefill


def chunk_positions(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width]: each row's positions lengths[b] + 0..width-1, where its next chunk goes."""
    return lengths[:, None] + torch.arange(width, device=lengths.device)[None]


def capture_graph(run, warmups: int = 1, after_each=lambda: None, pool=None, generators=()):
    """Warm `run()` up `warmups` times on a side stream, as capture requires (calling `after_each()` after each
    warm-up), then capture one call of it -> (graph, the outputs that each replay refills). `generators` are
    registered with the graph, so each replay draws fresh numbers from them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            run()
            after_each()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph, outputs


@functools.cache
def compiled(fn):
    """`fn` (a function of tensors: drafting, acceptance, a cycle's bookkeeping, which updates its buffers in place)
    under torch.compile, made once per function. In a CUDA graph every small op is a node that costs a few
    microseconds however little it does; fused, an n-gram lookup or an EAGLE-3 step runs a handful of kernels
    instead of dozens."""
    _configure_compile()
    return torch.compile(fn, fullgraph=True)


class TorchEngine:
    """Implements specdec.protocol.Verifier. Row b's committed length is `lengths[b]`; its pending token
    (not yet in the cache) goes first in the next verify."""

    framework = "torch"

    def __init__(
        self,
        model: GemmaModel,
        batch: int = 1,
        max_seq_len: int | None = None,
        k_max: int = 8,
        hidden_layers: tuple[int, ...] = (),
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        invariant: bool = True,
        lookahead: int = 0,
        graph_prefill: bool = False,
    ):
        """`lookahead`: extra sliding-ring slots for decode forwards chained past the committed length
        (GemmaConfig.cache_slots), for an engine that drafts (specdec.drafters.model). `graph_prefill` (a compiled
        engine on a GPU): prefill chunks replayed as CUDA graphs, a prompt's prefill about 2.5x shorter on the 270M (~6
        ms to ~2.4), but every decode cycle in the same process ~60 us (12%) longer on an H200, for a cause not yet
        found (docs/journal): it pays where requests are short, and costs past ~60 cycles a request."""
        self.model = model
        self.lookahead = lookahead
        self.cfg = model.cfg
        self.vocab_size = model.cfg.vocab_size
        self.k_max = k_max
        self.width = decode_width(k_max)
        self.batch = batch
        self.hidden_layers = tuple(hidden_layers)
        self.invariant = invariant
        self.device = model.embed_tokens.weight.device
        self.max_seq_len = max_seq_len or model.max_seq_len
        self.cache: KVCache = model.allocate_cache(batch, k_max, self.max_seq_len, lookahead)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.compiles = self.device.type == "cuda" if compile is None else compile
        self._model_fn = compiled_forward(model, invariant) if self.compiles else model.forward
        self._prefill_fn = compiled_prefill(model) if self.compiles else model.forward
        self._pad_tokens = torch.full((batch, self.width - 1), model.cfg.pad_token_id, dtype=torch.long, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, VerifyOutput]] = {}
        # A compiled engine on a GPU runs prefill chunks padded to PREFILL_WIDTH_STEP, graphed or not: its graphed and
        # ungraphed twins commit a prompt's same bits. Padded, a short prompt runs the compiled program, not the eager
        # forward: 14 tokens took 30 ms eagerly on an H200, 5.9 ms compiled. With graph_prefill, graphs by (first row,
        # rows, width) replay the chunks, sharing one memory pool: they replay one at a time. An eager engine's
        # prefill (a short `generate` command's, one prompt) is not graphed: a capture there would cost more than it
        # saves.
        self.pad_prefill = self.compiles and self.device.type == "cuda"
        self.graph_prefill = graph_prefill and self.pad_prefill
        self._prefill_graphs: dict[tuple[int, int, int], tuple] = {}
        self._prefill_pool = None
        # Per row, the hidden states of `hidden_layers` at its committed prompt positions [P-1, n, H] (an
        # EAGLE-3 head starts from them); set by prefill and prefill_row when hidden_layers are asked for.
        self.prefill_hidden: list[torch.Tensor | None] = [None] * batch

    # -- the protocol -------------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Commit each row's prompt but its last token; returns the last prompt tokens [B] (pending)."""
        if len(prompts) != self.batch:
            raise SpecdecError(f"{len(prompts)} prompts for an engine of batch {self.batch}")
        for prompt in prompts:
            self._check_prompt(prompt)
        self.cache.reset()
        # Consecutive rows of one prompt length prefill together; no row is ever padded.
        first = 0
        for last in range(1, len(prompts) + 1):
            if last < len(prompts) and len(prompts[last]) == len(prompts[first]):
                continue
            self._prefill_rows(first, prompts[first:last])
            first = last
        self.lengths.copy_(torch.tensor([len(p) - 1 for p in prompts], device=self.device))
        return torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=self.device)

    def prefill_row(self, row: int, prompt: list[int]) -> torch.Tensor:
        """Start a new request in one row, leaving the other rows' requests as they are (continuous
        batching); returns its pending token [1]. Every row prefills alone here, so a request's cache,
        and then its tokens, do not depend on which other requests share the batch."""
        if not 0 <= row < self.batch:
            raise SpecdecError(f"row {row} outside the engine's batch of {self.batch}")
        self._check_prompt(prompt)
        for pos in self.cache.rows(row, row + 1).slot_pos.values():
            pos.fill_(-1)
        self._prefill_rows(row, [prompt])
        self.lengths[row] = len(prompt) - 1
        return torch.tensor(prompt[-1:], dtype=torch.long, device=self.device)

    def warm_up_prefill(self) -> None:
        """Compile prefill, and run each padded width once (with graph_prefill, capture each row's graph of it), ahead
        of the prompts that need them: a server's first requests waited 10-94 s for the compilation on an H100, and
        a width's first run after it took 20-24 ms against 6 on an H200, which `bench` timed in the first method of
        a prompt. dynamo's dynamic program holds a guard where the forward branches on the length, at a sliding
        layer's ring: a chunk on each side of it, and the longest, compile what any unpadded chunk needs. The rows
        keep their junk until their next prefill_row."""
        if not self.compiles:
            return
        longest = self._longest_chunk()
        ring = self.cache.slots(SLIDING)
        for length in sorted({SPLIT_MAX_ROWS + 1, ring, ring + 1, longest}):
            if SPLIT_MAX_ROWS < length <= longest:
                self.prefill_row(0, [self.cfg.pad_token_id] * (length + 1))
        if not self.pad_prefill:
            return
        graphed = self.use_graphs and self.graph_prefill and self.batch <= GRAPHED_PREFILL_MAX_BATCH
        rows = range(self.batch) if graphed else [0]  # ungraphed, a width runs alike in every row
        for row, length in itertools.product(rows, self.padded_prefill_widths().values()):
            self.prefill_row(row, [self.cfg.pad_token_id] * (length + 1))

    def padded_prefill_widths(self) -> dict[int, int]:
        """Each width a prompt's first chunk can run padded at (`_prefill_width`) -> the longest chunk that runs at it.
        Later chunks run at these widths too (with graph_prefill, replay their graphs). At `bench`'s context of 333
        positions the 270M's prompts of 321 to 324 tokens run unpadded: 384 would run past the context."""
        longest = self._longest_chunk()
        widths = {}
        for n in range(1, longest + 1):
            width = self._prefill_width(0, n)
            if width % PREFILL_WIDTH_STEP == 0:
                widths[width] = n
        return widths

    def _longest_chunk(self) -> int:
        """The most tokens a prefill chunk commits: a chunk's, or the longest prompt's but its pending token."""
        return min(PREFILL_CHUNK, self.max_seq_len - self.width - 1)

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise SpecdecError("empty prompt")
        if len(prompt) + self.width > self.max_seq_len:
            raise SpecdecError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_seq_len} tokens")

    def _prefill_rows(self, first: int, prompts: list[list[int]]) -> None:
        """Commit equal-length prompts but their last tokens into rows first.., chunk by chunk."""
        rows = self.cache.rows(first, first + len(prompts))
        ids = torch.tensor([p[:-1] for p in prompts], dtype=torch.long, device=self.device)
        chunks = []
        with torch.inference_mode():
            for start in range(0, ids.shape[1], PREFILL_CHUNK):
                chunks.append(self._prefill_chunk(first, rows, ids[:, start : start + PREFILL_CHUNK], start))
        if self.hidden_layers:
            hidden = torch.cat(chunks, dim=1) if chunks else torch.zeros(
                len(prompts), 0, len(self.hidden_layers), self.cfg.hidden_size, dtype=self.model.dtype, device=self.device)
            for i in range(len(prompts)):
                self.prefill_hidden[first + i] = hidden[i]

    def _prefill_chunk(self, first: int, rows: KVCache, chunk: torch.Tensor, start: int) -> torch.Tensor | None:
        """Commit a chunk [B, n] of rows first.. at positions start..; -> its hidden states of `hidden_layers`.

        The chunk runs padded to its width (`_prefill_width`) where the engine pads: through the compiled forward,
        or with graph_prefill as one graph. The compiled forward alone took ~6 ms a prompt, 1.8-2.8 ms as a graph
        (the 270M up to 400 tokens, H200). Unpadded, chunks of up to SPLIT_MAX_ROWS tokens run eagerly (25-46 ms on a
        GPU): compiled, dynamo would build three more programs for them (chunks of 1 and 2 tokens, which it
        specialises, and those up to SPLIT_MAX_ROWS, where a compiled forward splits its products), about a minute
        each on an H100."""
        B, n = chunk.shape
        graphable_rows = B == self.batch or (B == 1 and self.batch <= GRAPHED_PREFILL_MAX_BATCH)
        width = self._prefill_width(start, n)
        tokens = torch.cat([chunk, chunk.new_full((B, width - n), self.cfg.pad_token_id)], dim=1)
        # Contiguous, as a graph's static copy is: dynamo compiles an expanded tensor (stride 0) into another program
        positions = torch.arange(start, start + width, device=self.device).repeat(B, 1)
        key = (first, B, width)
        # A capture runs the chunk twice (its warm-up, then the replay): harmless only where the chunk reads no
        # cache it writes, the first; later chunks replay a graph that a first one captured.
        if self.use_graphs and self.graph_prefill and graphable_rows and width % PREFILL_WIDTH_STEP == 0 and (
                start == 0 or key in self._prefill_graphs):
            hidden = self._replay_prefill(key, rows, tokens, positions)
        else:
            forward = self._prefill_fn if width > SPLIT_MAX_ROWS else self.model.forward
            hidden = forward(tokens, positions, rows, hidden_layers=self.hidden_layers, last_only=True)[1]
        return None if hidden is None else hidden[:, :n].clone()

    def _prefill_width(self, start: int, n: int) -> int:
        """The tokens a prefill chunk of n runs as: n, or padded up to a multiple of PREFILL_WIDTH_STEP past
        SPLIT_MAX_ROWS where `pad_prefill` and the pads are harmless. Pads sit after the prompt (causal) at the
        positions the next decode forwards overwrite first, as rejected drafts do, so they must not wrap onto a
        slot still inside a query's window: no pad past the context (nor so past the full cache's slots, which
        hold at least the context; nor past the RoPE tables, which hold the model's positions: at bench's context of
        333 a pad at 333 indexed past them, on an H200), and on a sliding ring either no wrap at all or no more
        pads than the ring's slots past the window (a pad at position p then takes the slot of p - ring, before
        every later query's window)."""
        if not self.pad_prefill:
            return n
        width = round_up(max(n, SPLIT_MAX_ROWS + 1), PREFILL_WIDTH_STEP)
        end = start + width
        ring = self.cache.slots(SLIDING)
        fits_ring = end <= ring or width - n <= ring - self.cfg.sliding_window
        return width if end <= self.max_seq_len and fits_ring else n

    def _replay_prefill(self, key: tuple[int, int, int], rows: KVCache, tokens: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor | None:
        """Run the prefill forward of tokens [B, W] at `positions` into `rows` as the CUDA graph of `key` (first
        row, B, W), captured at its first chunk."""
        if key not in self._prefill_graphs:
            static_tokens, static_positions = tokens.clone(), positions.clone()
            forward = functools.partial(self._prefill_fn, static_tokens, static_positions, rows,
                                        hidden_layers=self.hidden_layers, last_only=True)
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            graph, (_, hidden) = capture_graph(forward, pool=self._prefill_pool)
            self._prefill_graphs[key] = (graph, static_tokens, static_positions, hidden)
        graph, static_tokens, static_positions, hidden = self._prefill_graphs[key]
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        graph.replay()
        return hidden

    def verify(self, tokens: torch.Tensor) -> VerifyOutput:
        """Run tokens [B, T] at positions lengths + 0..T-1 (T <= k_max + 1); nothing is committed."""
        T = tokens.shape[1]
        if T > self.k_max + 1:
            raise SpecdecError(f"{T - 1} drafts exceed the engine's k_max of {self.k_max}")
        padded = self.pad(tokens.to(self.device))
        if not self.use_graphs:
            with torch.inference_mode():
                out = self._forward(padded)
        else:
            width = padded.shape[1]
            if width not in self._graphs:
                self._capture(width)
            graph, static_tokens, out = self._graphs[width]
            static_tokens.copy_(padded)
            graph.replay()
        if padded.shape[1] == T:
            return out
        return VerifyOutput(out.logits[:, :T], None if out.hidden is None else out.hidden[:, :T])

    def commit(self, num_tokens: torch.Tensor) -> None:
        self.lengths += num_tokens

    # -- internals -------------------------------------------------------------------------------------

    def pad(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] tokens as the forward runs them: padded to the decode width in invariant mode. Pad rows
        come after the real ones (causal), and their cache writes lie past them: rolled back like drafts."""
        padding = self.padding(tokens.shape[1])
        return tokens if padding.shape[1] == 0 else torch.cat([tokens, padding], dim=1)

    def padding(self, T: int) -> torch.Tensor:
        """The pad tokens `pad` appends to a chunk of T tokens, [B, 0..width-1] (none outside invariant mode)."""
        return self._pad_tokens[:, : self.width - T if self.invariant else 0]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                 cache: KVCache | None = None) -> VerifyOutput:
        """The decode forward of tokens [B, T] at `positions` (default: lengths + 0..T-1) into `cache` (default: the
        engine's; a `cache.rows` view for a forward of the first rows alone)."""
        if positions is None:
            positions = chunk_positions(self.lengths, tokens.shape[1])
        logits, hidden = self._model_fn(tokens, positions, self.cache if cache is None else cache,
                                        hidden_layers=self.hidden_layers, commit_first=True)
        return VerifyOutput(logits, hidden)

    def widths_keeping_bits(self, widths: list[int]) -> tuple[int, ...]:
        """Of `widths` (forwards over the first w rows alone), those whose decode forward gives each of its rows the
        bits the whole batch's forward gives it, and the whole batch. Every kernel the forward runs picks its
        blocks by the forward's shapes alone, never by the values, so one forward of random tokens at each width
        shows whether that width rounds as the whole batch does; a product whose library picks another kernel for
        more rows fails it. Run on an idle engine: its writes lie past each row's committed length, rolled back
        like rejected drafts."""
        narrower = sorted(set(widths) - {self.batch})
        if not narrower:
            return (self.batch,)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(self.vocab_size, (self.batch, self.width), generator=generator).to(self.device)
        positions = chunk_positions(self.lengths, self.width)
        outputs = lambda out: [t for t in (out.logits, out.hidden) if t is not None]  # noqa: E731
        with torch.inference_mode():
            whole = [t.clone() for t in outputs(self._forward(tokens, positions))]
            kept = []
            for w in narrower:
                part = outputs(self._forward(tokens[:w], positions[:w], self.cache.rows(0, w)))
                if all(torch.equal(mine, theirs[:w]) for mine, theirs in zip(part, whole)):
                    kept.append(w)
        return (*kept, self.batch)

    def _capture(self, T: int) -> None:
        """Capture the T-token forward. Warm-up runs on a side stream, as CUDA graphs require. Warm-up and
        capture write dummy tokens at positions lengths .. lengths+T-1: exactly what rejected drafts do,
        so the next verify (which starts at lengths) never sees them."""
        static_tokens = torch.full((self.batch, T), self.cfg.pad_token_id, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            graph, out = capture_graph(lambda: self._forward(static_tokens), warmups=2)
        self._graphs[T] = (graph, static_tokens, out)

    # -- plain decode: the baseline every speculative run is compared with ----------------------------

    def greedy_decode(self, prompt: list[int], max_new_tokens: int, eos_ids=(), on_token=None) -> list[int]:
        """Plain greedy decode of one prompt (batch 1): one T=1 forward per token, argmax (lowest id on
        ties). `on_token(token)` streams each token as it is chosen."""
        if self.batch != 1:
            raise SpecdecError("greedy_decode runs batch 1")
        check_context(self, [prompt], max_new_tokens)
        pending = self.prefill([prompt])
        out: list[int] = []
        one = torch.ones(1, dtype=torch.long, device=self.device)
        while len(out) < max_new_tokens:
            logits = self.verify(pending[:, None]).logits
            self.commit(one)
            pending = logits[:, -1].argmax(dim=-1)
            token = int(pending[0])
            out.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos_ids:
                break
        return out
