"""The serving scheduler's fused cycle, driven step by step (no thread, no HTTP), on both engines: a greedy request
gets the tokens `specdec generate`'s cycle gives its prompt on the same engine (the first of a batch of equal
prompts), a sampled one those it gets alone, also beside other requests and when the cycle prefetches (as on a
GPU): a request admitted while a cycle is in flight. The JAX engine's server may run several cycles a call; its
requests get the same tokens."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.ngram import NgramDrafter
from specdec.engines.cycle_torch import FusedCycle
from specdec.engines.verifier_torch import TorchEngine
from specdec.errors import SpecdecError
from specdec.generate import StopCondition, run_cycles
from specdec.models.gemma_torch import GemmaModel
from specdec.protocol import is_device_state
from specdec.sampling import SamplingParams
from specdec.serve.scheduler import JAX_CYCLES_PER_CALL, Request, Scheduler, SpeculativeConfig

PROMPT = [2, 17, 301, 17, 301, 17, 45, 9, 45, 9]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["torch", "jax"])
def engine(request, random_checkpoints):
    if request.param == "jax":
        from specdec.engines.verifier_jax import JaxEngine

        return JaxEngine.from_checkpoint(random_checkpoints["gemma3"], batch=2, max_seq_len=128, k_max=4)
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=128)
    return TorchEngine(model, batch=2, max_seq_len=128, k_max=4)


def is_jax(engine) -> bool:
    return engine.framework == "jax"


def request(prompt, max_new_tokens, sampling=SamplingParams()):
    return Request(list(prompt), sampling, StopCondition(max_new_tokens), on_update=lambda update: None)


def generated(engine, prompt, max_new_tokens, sampling=SamplingParams(), k=4) -> list[int]:
    """Row 0's tokens of `specdec generate`'s fused cycle over a batch of `prompt`, row 0 seeded by `sampling`."""
    draft_fn = NgramDrafter().device_draft_fn("jax" if is_jax(engine) else "torch", k) if k else None
    if is_jax(engine):
        from specdec.engines.cycle_jax import JaxFusedCycle as Cycle
    else:
        from specdec.engines.cycle_torch import FusedCycle as Cycle
    cycle = Cycle(engine, draft_fn, k, sampling)
    return run_cycles(cycle, [list(prompt)] * engine.batch, k, StopCondition(max_new_tokens)).tokens[0]


class Steps:
    """A scheduler whose loop the test turns by hand."""

    def __init__(self, engine, k: int, prefetch: bool = False, cycles_per_call: int = 1, narrow_cycles: bool = True):
        if cycles_per_call > 1 and not is_jax(engine):
            pytest.skip("a torch cycle is one graph replay")
        self.scheduler = Scheduler(engine, SpeculativeConfig("ngram", k) if k else SpeculativeConfig(),
                                   cycles_per_call, narrow_cycles)
        self.scheduler.cycle.prefetch = prefetch  # a CPU engine's default is off
        self.turns = 0

    def turn(self) -> None:
        """One iteration of the scheduler's loop (a bound on them: a loop that serves nothing fails, not hangs)."""
        self.turns += 1
        assert self.turns <= 2000, "the scheduler's loop turns without finishing its requests"
        self.scheduler._turn()

    def run(self, req: Request) -> list[int]:
        self.scheduler.submit(req)
        while self.scheduler.running or self.scheduler.num_waiting:
            self.turn()
        return req.tokens


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("cycles_per_call", [1, 3])
def test_a_greedy_request_gets_the_tokens_of_generate(engine, k, prefetch, cycles_per_call):
    served = Steps(engine, k, prefetch, cycles_per_call).run(request(PROMPT, NEW_TOKENS))
    assert served == generated(engine, PROMPT, NEW_TOKENS, k=k)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("cycles_per_call", [1, 3])
def test_a_greedy_request_keeps_its_tokens_when_a_sampled_one_joins_and_leaves(engine, prefetch, cycles_per_call):
    solo = Steps(engine, 4).run(request(PROMPT, NEW_TOKENS))
    steps = Steps(engine, 4, prefetch, cycles_per_call)
    scheduler = steps.scheduler
    greedy = request(PROMPT, NEW_TOKENS)
    scheduler.submit(greedy)
    steps.turn()
    steps.turn()
    sampled = request([5, 6, 7, 8], 3, SamplingParams(temperature=1.0, seed=3))
    scheduler.submit(sampled)
    while len(sampled.tokens) < 3:
        steps.turn()
    while scheduler.running:
        steps.turn()
    assert greedy.tokens == solo


SAMPLED = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.8, top_p=0.9, seed=5),
           SamplingParams(temperature=1.5, top_k=20, min_p=0.05, seed=7)]


@pytest.mark.parametrize("prefetch", [False, True])
def test_sampled_requests_get_their_solo_tokens_beside_others(engine, prefetch):
    """Each row samples by its own settings, drawing by its own seed and position: a seeded request's tokens are
    those it gets alone, beside a greedy request or one of other filters; torch's are those of generate's cycle,
    which runs the same rule (JAX's names its filters where a server picks them on the device, so their floats may
    round apart)."""
    def solo(sampling):
        return Steps(engine, 4).run(request(PROMPT, NEW_TOKENS, sampling))

    if not is_jax(engine):
        for sampling in SAMPLED:
            assert solo(sampling) == generated(engine, PROMPT, NEW_TOKENS, sampling), sampling
    assert len({tuple(solo(s)) for s in SAMPLED}) == len(SAMPLED)
    assert solo(SAMPLED[0]) == solo(SAMPLED[0])
    for first, second in [(SAMPLED[1], SamplingParams()), (SAMPLED[1], SAMPLED[2]), (SAMPLED[0], SAMPLED[2])]:
        steps = Steps(engine, 4, prefetch=prefetch)
        requests = [request(PROMPT, NEW_TOKENS, first), request(PROMPT, NEW_TOKENS, second)]
        steps.scheduler.submit(requests[0])
        steps.turn()  # the second joins a cycle later, at another position
        steps.scheduler.submit(requests[1])
        while steps.scheduler.running or steps.scheduler.num_waiting:
            steps.turn()
        assert [r.tokens for r in requests] == [solo(first), solo(second)]


def test_a_greedy_request_in_a_row_a_sampled_one_left_gets_its_solo_tokens_beside_a_sampled_one(engine):
    """A row's settings are its request's alone: a greedy request that takes the row a sampled request (temperature
    1.5, top-k, min-p) left, while another sampled request keeps the other row (so every cycle runs the sampled
    rule), decodes greedily, inheriting neither the temperature nor the filters."""
    solo_greedy = Steps(engine, 4).run(request(PROMPT, NEW_TOKENS))
    solo_sampled = Steps(engine, 4).run(request(PROMPT, 3 * NEW_TOKENS, SAMPLED[0]))
    steps = Steps(engine, 4)
    scheduler = steps.scheduler
    leaving, staying = request([5, 6, 7, 8], 3, SAMPLED[2]), request(PROMPT, 3 * NEW_TOKENS, SAMPLED[0])
    scheduler.submit(leaving)
    scheduler.submit(staying)
    while len(leaving.tokens) < 3:
        steps.turn()
    greedy = request(PROMPT, NEW_TOKENS)
    scheduler.submit(greedy)
    steps.turn()
    assert scheduler.rows[0] is greedy and scheduler.rows[1] is staying
    while len(greedy.tokens) < NEW_TOKENS:
        steps.turn()
    assert scheduler.rows[1] is staying  # it sampled beside every cycle of the greedy request
    while scheduler.running:
        steps.turn()
    assert (greedy.tokens, staying.tokens) == (solo_greedy, solo_sampled)


def test_a_cancelled_row_stops_advancing_and_its_row_serves_the_next_request(engine):
    solo = Steps(engine, 4).run(request(PROMPT[:6], 12))
    steps = Steps(engine, 4)
    first = request(PROMPT, NEW_TOKENS)
    steps.scheduler.submit(first)
    steps.turn()
    first.cancel()
    steps.turn()  # drops it; nothing runs
    cycle = steps.scheduler.cycle
    assert steps.scheduler.running == 0
    assert bool(cycle.state.done.all()) if is_jax(engine) else not cycle.limit.any()
    assert steps.run(request(PROMPT[:6], 12)) == solo


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("cycles_per_call", [1, 3])
def test_a_request_that_fills_the_context_leaves_its_row_safe_for_the_rows_beside_it(engine, prefetch,
                                                                                       cycles_per_call):
    """Its last cycle may accept past its budget; the row must not advance past the context, or the cycles the
    other rows go on with would run its position past the cache and the RoPE tables. With prefetch the second
    request arrives while a cycle is in flight; with several cycles a call the first one's row rides along, done,
    to its call's end."""
    longest = engine.max_seq_len - engine.width + 1 - len(PROMPT)  # what the server allows without max_tokens
    short = [7, 3, 7, 3, 7]
    solo_long = Steps(engine, 4).run(request(PROMPT, longest))
    solo_short = Steps(engine, 4).run(request(short, 80))
    steps = Steps(engine, 4, prefetch, cycles_per_call)
    scheduler = steps.scheduler
    first, second = request(PROMPT, longest), request(short, 80)
    scheduler.submit(first)
    while len(first.tokens) < longest - 40:
        steps.turn()
    scheduler.submit(second)
    while scheduler.running:
        steps.turn()
    assert (first.tokens, second.tokens) == (solo_long, solo_short)
    assert int(scheduler.engine.lengths.max()) < engine.max_seq_len - engine.width + 1


@pytest.mark.parametrize("cycles_per_call", [1, 3])
def test_a_prefetching_cycle_hands_out_the_cycle_in_flight_before_a_request_is_admitted(engine, cycles_per_call):
    """Requests arriving one after another while fused cycles run ahead: each gets its solo tokens, and no turn
    admits a row while a cycle run over the rows as they were waits to be handed out (the cycle refuses that)."""
    prompts = [PROMPT, [7, 3, 7, 3, 7], [4, 4, 9, 4, 4, 9, 4], PROMPT[:5]]
    solo = [Steps(engine, 4).run(request(p, 16)) for p in prompts]
    steps = Steps(engine, 4, True, cycles_per_call)
    scheduler = steps.scheduler
    requests = [request(p, 16) for p in prompts]
    for req in requests:
        scheduler.submit(req)
        for _ in range(3):
            steps.turn()
    while scheduler.running or scheduler.num_waiting:
        steps.turn()
    assert [r.tokens for r in requests] == solo
    assert scheduler.cycle.collect() is not None  # cycles did run ahead


def test_requests_admitted_in_one_turn_get_their_solo_tokens(engine, monkeypatch):
    """Requests waiting together start in one turn; JAX prefills their rows in the same forwards."""
    prompts = [PROMPT, [7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 3, 7, 5]]  # the second spans two chunks
    samplings = [SamplingParams(), SamplingParams(temperature=1.0, seed=11)]
    solo = [Steps(engine, 4).run(request(p, 16, s)) for p, s in zip(prompts, samplings)]
    if is_jax(engine):
        prefills = []
        prefill_rows = type(engine).prefill_rows
        monkeypatch.setattr(type(engine), "prefill_rows", lambda self, rows: (prefills.append(sorted(rows)),
                                                                                prefill_rows(self, rows))[1])
    steps = Steps(engine, 4)
    requests = [request(p, 16, s) for p, s in zip(prompts, samplings)]
    for req in requests:
        steps.scheduler.submit(req)
    while steps.scheduler.running or steps.scheduler.num_waiting:
        steps.turn()
    assert [r.tokens for r in requests] == solo
    if is_jax(engine):
        assert prefills == [[0, 1]]


def test_a_request_the_host_stops_mid_call_decodes_to_its_end_and_its_row_serves_the_next(engine):
    """Three cycles a call: an EOS ends the first request inside a call, its row running on to the call's end while
    the other request decodes; the next request takes the freed row. Each gets its tokens of one cycle a call."""
    if not is_jax(engine):
        pytest.skip("a torch cycle is one graph replay")
    long, after = request(PROMPT, NEW_TOKENS), request([7, 3, 7, 3, 7], 12)
    solo = [Steps(engine, 4).run(request(r.prompt, r.stop.max_new_tokens)) for r in (long, after)]
    eos = solo[1][4]  # a token of its own: the stopped request's solo tokens up to it
    stopped_solo = solo[1][: solo[1].index(eos) + 1]
    steps = Steps(engine, 4, True, cycles_per_call=3)
    stopped = Request([7, 3, 7, 3, 7], SamplingParams(), StopCondition(12, eos_ids=[eos]), lambda update: None)
    for req in (long, stopped, after):
        steps.scheduler.submit(req)
    while steps.scheduler.running or steps.scheduler.num_waiting:
        steps.turn()
    assert stopped.tokens == stopped_solo and (long.tokens, after.tokens) == tuple(solo)


def test_only_the_jax_server_runs_several_cycles_a_call(engine):
    if is_jax(engine):
        assert Scheduler(engine, SpeculativeConfig(), 3).cycle.cycles_per_call == 3
        assert Scheduler(engine, SpeculativeConfig()).cycle.cycles_per_call == JAX_CYCLES_PER_CALL > 1
    else:
        assert Scheduler(engine, SpeculativeConfig()).cycle.cycles_per_call == 1
        with pytest.raises(SpecdecError, match="only the JAX engine runs several cycles a call"):
            Scheduler(engine, SpeculativeConfig(), 3)


@pytest.fixture(scope="module")
def engine_of_4(random_checkpoints):
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], max_seq_len=128)
    return TorchEngine(model, batch=4, max_seq_len=128, k_max=4)


def test_a_torch_cycle_runs_the_rows_in_use_and_a_request_keeps_its_tokens(engine_of_4, monkeypatch):
    """A lone request runs cycles of its row alone; as requests join in higher rows the cycles widen to hold them,
    and narrow again as they leave. Every request gets the tokens it gets alone, and those it gets from cycles that
    all run every row."""
    widths_run = []
    width = FusedCycle.width
    monkeypatch.setattr(FusedCycle, "width", lambda self: (widths_run.append(width(self)), widths_run[-1])[1])
    steps = Steps(engine_of_4, 4)
    widths = steps.scheduler.cycle.widths
    # Which widths keep a row's bits is the machine's: CI's 2-core CPU kept 1, 2 and 4; a 16-core one dropped 1.
    assert set(widths) <= {1, 2, 4} and widths[-1] == 4
    assert Steps(engine_of_4, 4, narrow_cycles=False).scheduler.cycle.widths == (4,)
    fit = lambda rows: min(w for w in widths if w >= rows)  # noqa: E731
    prompts = [PROMPT, [7, 3, 7, 3, 7], [4, 4, 9, 4, 4, 9, 4]]
    solo = [steps.run(request(p, 16)) for p in prompts]
    assert set(widths_run) == {fit(1)}
    assert solo == [Steps(engine_of_4, 4, narrow_cycles=False).run(request(p, 16)) for p in prompts]

    widths_run.clear()
    requests = [request(p, 16) for p in prompts]
    for req in requests:
        steps.scheduler.submit(req)
        steps.turn()  # admits it into the next row (0, 1, 2), then runs a cycle
    for leaving in (2, 1):  # rows 2, then 1, leave after a cycle each
        requests[leaving].cancel()
        steps.turn()
    while steps.scheduler.running:
        steps.turn()
    assert requests[0].tokens == solo[0]
    assert [r.tokens for r in requests[1:]] == [solo[1][: len(requests[1].tokens)], solo[2][:len(requests[2].tokens)]]
    assert widths_run[:5] == [fit(1), fit(2), fit(3), fit(2), fit(1)] and set(widths_run[5:]) == {fit(1)}


@pytest.mark.gpu
def test_a_compiled_cuda_servers_narrow_cycles_give_the_tokens_of_cycles_over_every_row(random_checkpoints):
    """What `specdec serve` runs on a GPU: bf16, compiled, each width its own CUDA graph, prefetching. Requests that
    join and leave get the tokens a server cycling over every row gives them."""
    model = GemmaModel.from_checkpoint(random_checkpoints["gemma3"], dtype=torch.bfloat16, device="cuda",
                                       max_seq_len=128)
    engine = TorchEngine(model, batch=4, max_seq_len=128, k_max=4, compile=True)
    prompts = [PROMPT, [7, 3, 7, 3, 7], [4, 4, 9, 4, 4, 9, 4]]

    def staggered(steps: Steps) -> list[list[int]]:
        requests = [request(p, 16) for p in prompts]
        for req in requests:
            steps.scheduler.submit(req)
            steps.turn()
        while steps.scheduler.running or steps.scheduler.num_waiting:
            steps.turn()
        return [r.tokens for r in requests]

    narrow = Steps(engine, 4, prefetch=True)
    assert narrow.scheduler.cycle.widths[-1] == 4 and len(narrow.scheduler.cycle.widths) > 1
    assert staggered(narrow) == staggered(Steps(engine, 4, prefetch=True, narrow_cycles=False))


def test_the_width_check_keeps_the_widths_that_round_as_the_batch_does_and_drops_the_others(engine_of_4, monkeypatch):
    """The engine's check compares a width's rows with the whole batch's bit for bit. Over a forward that runs each
    row alone every width rounds as the batch does, and is kept; one whose 2-row forward rounds one logit otherwise
    (as a product whose library picks another kernel for fewer rows would) loses width 2 alone."""
    forward = engine_of_4._model_fn

    def row_by_row(tokens, positions, cache, **kwargs):
        logits, hidden = zip(*(forward(tokens[i:i + 1], positions[i:i + 1], cache.rows(i, i + 1), **kwargs)
                               for i in range(len(tokens))))
        return torch.cat(logits), None if hidden[0] is None else torch.cat(hidden)

    def two_rows_round_otherwise(tokens, positions, cache, **kwargs):
        logits, hidden = row_by_row(tokens, positions, cache, **kwargs)
        if len(tokens) == 2:
            logits = logits.clone()
            logits[0, 0, 0] = torch.nextafter(logits[0, 0, 0], torch.tensor(torch.inf))
        return logits, hidden

    monkeypatch.setattr(engine_of_4, "_model_fn", row_by_row)
    assert engine_of_4.widths_keeping_bits([1, 2]) == (1, 2, 4)
    monkeypatch.setattr(engine_of_4, "_model_fn", two_rows_round_otherwise)
    assert engine_of_4.widths_keeping_bits([1, 2]) == (1, 4)
    assert Scheduler(engine_of_4, SpeculativeConfig("ngram", 4)).cycle.widths == (1, 4)


def test_a_stateful_drafters_cycle_runs_every_row(engine_of_4):
    class Stateful:  # specdec.protocol.DeviceState
        sampling = SamplingParams()

        def begin(self, *args):
            pass

        def draft(self, *args):
            pass

        def observe(self, *args):
            pass

    assert is_device_state(Stateful())
    with pytest.raises(SpecdecError, match="spans the batch"):
        FusedCycle(engine_of_4, Stateful(), 4, widths=(1, 4))
    with pytest.raises(SpecdecError, match="the batch among them"):
        FusedCycle(engine_of_4, None, 0, widths=(1, 2))
