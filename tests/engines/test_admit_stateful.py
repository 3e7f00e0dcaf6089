"""Continuous batching with stateful drafters (an EAGLE-3 head, a Gemma 4 MTP assistant, a small model), on both
engines: requests admitted row by row into a fused cycle over every row while the other rows decode, as `specdec
serve` runs them, the drafter built greedy. A greedy request gets its plain decode's tokens, token for token, whatever
joins or leaves beside it; a seeded sampled request gets the tokens it gets alone; and the drafts are accepted, so the
drafter state an admission starts is the one the request's prompt gives. The drafters' per-row start gives a row what
starting the whole batch gives it and leaves the other rows as they were."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specdec.generate import HostCycle, StopCondition, run_cycles
from specdec.sampling import SamplingParams
from tests.drafters import test_eagle3, test_model, test_mtp
from tests.drafters.test_eagle3 import aligned_head, head, model, target_cfg  # noqa: F401 (fixtures)

PROMPTS = [[2, 17, 301, 17, 301, 17, 45, 9, 45, 9], [2, 9, 9, 9, 41, 7], [2, 40, 7, 7, 311, 95, 2, 64, 480, 13, 5, 77]]
BUDGETS = [16, 32, 12]  # new tokens of each prompt's request
SAMPLED, SAMPLED_BUDGET = SamplingParams(temperature=0.8, seed=5), 20  # a request of PROMPTS[1]
CYCLES_PER_CALL = 2  # JAX: a request joins between calls of two cycles, as a JAX server's default
KINDS = ("eagle3", "mtp", "model")
FRAMEWORKS = ("torch", "jax")


@pytest.fixture(scope="module")
def random_assistant(tmp_path_factory):
    """An assistant of random weights for gemma4_dense."""
    from specdec.drafters.mtp import load_assistant
    from specdec.models.random_init import write_random_assistant

    return load_assistant(write_random_assistant("gemma4_dense", tmp_path_factory.mktemp("assistant")))


@pytest.fixture(scope="module")
def repeating_assistant(random_assistant, random_checkpoints):
    """The random assistant made to draft its pending token again, mostly: its head reads back the token's
    embedding, which its input passes on, while its layers and the target's hidden state add a little (so that its
    drafts depend on all of its state). The random target's greedy text repeats tokens now and then, where these
    drafts are accepted (a random assistant's never are)."""
    from safetensors.numpy import load_file

    cfg, weak = random_assistant.cfg, 0.3
    params = {name: weak * a if name.endswith(("o_proj.weight", "down_proj.weight")) else a
              for name, a in random_assistant.params.items()}
    pre = weak * params["pre_projection.weight"]  # its input: [the token's embedding, the target's hidden state]
    pre[:, : cfg.backbone_hidden_size] = np.eye(cfg.text.hidden_size, cfg.backbone_hidden_size)
    embed = load_file(random_checkpoints["gemma4_dense"] / "model.safetensors")["model.embed_tokens.weight"]
    params.update({"pre_projection.weight": pre, "norm.weight": np.ones(cfg.text.hidden_size, np.float32),
                   cfg.head_name: np.ascontiguousarray(embed[:, : cfg.text.hidden_size])})
    return dataclasses.replace(random_assistant, params=params)


class Served:
    """A target engine of 3 rows, with each of PROMPTS' plain greedy tokens, and a drafter of one kind for it:
    `weights` whose drafts are accepted now and then, `random_weights` whose drafts move with any of the drafter's
    state (for a model drafter, the target's own weights both)."""

    def __init__(self, request, kind: str, framework: str):
        from specdec.drafters.eagle3_drafter import Eagle3Drafter
        from specdec.drafters.model import ModelDrafter, drafter_engine
        from specdec.drafters.mtp_drafter import MtpDrafter

        checkpoints = request.getfixturevalue("random_checkpoints")
        if kind == "eagle3":
            self.weights, self.random_weights = request.getfixturevalue("aligned_head"), request.getfixturevalue("head")
            engine = test_eagle3.torch_engine(request.getfixturevalue("model"), self.weights, batch=3) \
                if framework == "torch" else test_eagle3.jax_engine(checkpoints, self.weights, batch=3)
            self.k, self.kind_of_drafter = test_eagle3.K, Eagle3Drafter
        elif kind == "mtp":
            self.weights = request.getfixturevalue("repeating_assistant")
            self.random_weights = request.getfixturevalue("random_assistant")
            engine = test_mtp.make_engine(framework, checkpoints["gemma4_dense"], batch=3)
            self.k, self.kind_of_drafter = test_mtp.K, MtpDrafter
        else:  # the target drafting for itself, on a drafter engine of its own
            engine = test_model.make_target(framework, checkpoints["gemma4_e"], batch=3, k_max=2)
            self.weights = self.random_weights = drafter_engine(engine, engine)
            self.k, self.kind_of_drafter = 2, ModelDrafter
        self.kind, self.engine = kind, engine
        plain = run_cycles(HostCycle(engine, None, 0, SamplingParams()), PROMPTS, 0, StopCondition(max(BUDGETS)))
        self.plain = [tokens[:budget] for tokens, budget in zip(plain.tokens, BUDGETS)]
        self.state = self.drafter(self.weights).device_draft_fn(framework, self.k)  # what a server drafts with

    def drafter(self, weights, sampling: SamplingParams = SamplingParams()):
        return self.kind_of_drafter(weights, self.engine, self.k, sampling)

    def server(self) -> Server:
        return Server(self.engine, self.state, self.k)


@dataclasses.dataclass
class Request:
    stop: StopCondition
    sampling: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    drafts: list[list[int]] = dataclasses.field(default_factory=list)  # each cycle's


class Server:
    """The fused cycle over every row driven as the scheduler drives it, by hand: rows admitted and retired between
    cycles, each row's tokens cut to its budget, finished rows retired."""

    def __init__(self, engine, state, k: int):
        if engine.framework == "jax":
            from specdec.engines.cycle_jax import JaxFusedCycle

            self.cycle = JaxFusedCycle(engine, state, k, cycles_per_call=CYCLES_PER_CALL)
        else:
            from specdec.engines.cycle_torch import FusedCycle

            self.cycle = FusedCycle(engine, state, k, widths=(engine.batch,))
        for row in range(engine.batch):
            self.cycle.retire(row)
        self.rows: dict[int, Request] = {}
        self.drafted = self.accepted = 0  # over every request's cycles
        self.cycles = 0

    def admit(self, row: int, prompt: list[int], budget: int, sampling: SamplingParams = SamplingParams()) -> Request:
        while (result := self.cycle.collect()) is not None:  # cycles run over the rows as they were
            self._deliver(result)
        self.cycle.admit(row, prompt, budget, sampling)
        self.rows[row] = Request(StopCondition(budget), sampling)
        return self.rows[row]

    def alone(self, row: int, prompt: list[int], budget: int, sampling: SamplingParams = SamplingParams()) -> Request:
        """A request run to its end with no other in the batch."""
        assert not self.rows
        request = self.admit(row, prompt, budget, sampling)
        self.run()
        return request

    def turn(self, times: int = 1) -> None:
        for _ in range(times):
            self.cycles += 1
            assert self.cycles <= 200, "the requests do not finish"
            self._deliver(self.cycle.step())

    def run(self) -> None:
        while self.rows:
            self.turn()

    def _deliver(self, result) -> None:
        for row, request in list(self.rows.items()):
            kept, finished = request.stop.take(request.tokens, result.emitted(row))
            request.tokens.extend(kept)
            request.drafts.append(result.draft_tokens[row, : result.draft_len[row]].tolist())
            self.drafted += int(result.draft_len[row])
            self.accepted += int(result.num_accepted[row])
            if finished:
                del self.rows[row]
                self.cycle.retire(row)


@pytest.fixture(scope="module", params=[(kind, framework) for kind in KINDS for framework in FRAMEWORKS],
                ids=lambda p: "-".join(p))
def served(request) -> Served:
    return Served(request, *request.param)


def test_greedy_requests_joining_and_leaving_get_their_plain_tokens(served):
    """One request joins while another is mid-way, a third takes the row the first leaves while the second goes on,
    and a row stays free throughout, riding along: each gets its plain decode's tokens, and drafts what it drafts
    alone, cycle by cycle (no admission beside it touched its drafter state)."""
    server = served.server()
    rows = [0, 2, 0]
    alone = [server.alone(row, prompt, budget) for row, prompt, budget in zip(rows, PROMPTS, BUDGETS)]
    first = server.admit(rows[0], PROMPTS[0], BUDGETS[0])
    while len(first.tokens) < BUDGETS[0] // 2:
        server.turn()
    second = server.admit(rows[1], PROMPTS[1], BUDGETS[1])
    while rows[0] in server.rows:
        server.turn()
    assert rows[1] in server.rows and second.tokens, "the second request is mid-way"
    third = server.admit(rows[2], PROMPTS[2], BUDGETS[2])
    server.run()
    requests = [first, second, third]
    assert [r.tokens for r in requests] == [r.tokens for r in alone] == served.plain
    assert [r.drafts for r in requests] == [r.drafts for r in alone]
    assert server.accepted > 0
    if served.kind == "model":  # drafting for itself, from the state its admission started: every draft is right
        assert server.accepted == server.drafted


def test_a_sampled_request_gets_its_own_tokens_beside_greedy_ones(served):
    """A seeded sampled request gets the same tokens alone, twice, and beside greedy requests admitted before and
    after it, which get their plain decode's tokens."""
    server = served.server()
    alone = [server.alone(1, PROMPTS[1], SAMPLED_BUDGET, SAMPLED).tokens for _ in range(2)]
    assert alone[0] == alone[1] != served.plain[1][:SAMPLED_BUDGET]
    greedy = server.admit(0, PROMPTS[0], BUDGETS[0])
    sampled = server.admit(1, PROMPTS[1], SAMPLED_BUDGET, SAMPLED)
    server.turn(2)
    late = server.admit(2, PROMPTS[2], BUDGETS[2])
    server.run()
    assert (greedy.tokens, late.tokens) == (served.plain[0], served.plain[2])
    assert sampled.tokens == alone[0]
    assert server.accepted > 0


def test_a_row_starts_as_the_whole_batch_starts_it_and_leaves_the_others_as_they_were(served):
    """A drafter's per-row start (begin_row, begin_rows) gives the row the drafts `begin` over the whole batch gives
    it, and leaves every other row drafting what it drafted: its cache rows, features, tokens and counts as they were
    (a drafter whose drafts move with any of them)."""
    engine, drafter = served.engine, served.drafter(served.random_weights)

    def drafts() -> np.ndarray:
        """Each row's drafts, then its number of drafts: [B, k + 1]."""
        draft = drafter.propose(served.k)
        return np.concatenate([np.asarray(draft.tokens), np.asarray(draft.lengths)[:, None]], axis=1)

    def begun(prompts) -> np.ndarray:
        engine.prefill(prompts)
        drafter.begin(prompts)
        return drafts()

    whole = begun(PROMPTS)
    before = begun(PROMPTS[1:] + PROMPTS[:1])  # another prompt in every row
    engine.prefill_row(1, PROMPTS[1])
    if engine.framework == "jax":
        drafter.device.state = drafter.device.begin_rows(engine.params, drafter.device.state, {1: PROMPTS[1]},
                                                         engine.prefill_hidden)
    else:
        drafter.device.begin_row(1, PROMPTS[1], engine.prefill_hidden[1])
    after = drafts()
    np.testing.assert_array_equal(after[1], whole[1])
    np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])


def test_rows_are_admitted_one_by_one_only_beside_a_greedy_drafter(served):
    """A sampling drafter draws from one random stream for the whole batch, so a request's drafts would depend on the
    requests beside it."""
    from specdec.errors import SpecdecError

    sampling = served.drafter(served.weights, SAMPLED)
    server = Server(served.engine, sampling.device_draft_fn(served.engine.framework, served.k), served.k)
    with pytest.raises(SpecdecError, match="greedy drafter"):
        server.admit(0, PROMPTS[0], BUDGETS[0])
