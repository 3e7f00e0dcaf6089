"""N-gram drafter: host, torch and JAX versions against the shared oracle and each other."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from specdec.drafters.ngram import NgramDrafter, ngram_propose, ngram_propose_jax, ngram_propose_torch
from specdec.errors import SpecdecError
from tests import oracle

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from specdec.engines.verifier_torch import capture_graph  # noqa: E402


def propose_torch(sequences, k, min_ngram, max_ngram, buffer_len):
    tokens, lengths = padded_buffer(sequences, buffer_len)
    draft, draft_len = ngram_propose_torch(
        torch.from_numpy(tokens), torch.from_numpy(lengths), k, min_ngram, max_ngram)
    return unpad(draft.numpy(), draft_len.numpy())


@functools.cache
def jitted_propose_jax(k, min_ngram, max_ngram):
    return jax.jit(functools.partial(ngram_propose_jax, k=k, min_ngram=min_ngram,
                                     max_ngram=max_ngram))


def propose_jax(sequences, k, min_ngram, max_ngram, buffer_len):
    tokens, lengths = padded_buffer(sequences, buffer_len)
    draft, draft_len = jitted_propose_jax(k, min_ngram, max_ngram)(tokens, lengths)
    return unpad(np.asarray(draft), np.asarray(draft_len))


def padded_buffer(sequences, buffer_len):
    # Padding repeats real tokens, so reading past a length would show up as a wrong match.
    tokens = np.full((len(sequences), buffer_len), 1, dtype=np.int64)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    return tokens, np.array([len(s) for s in sequences], dtype=np.int64)


def unpad(draft, draft_len):
    assert (draft[np.arange(draft.shape[1]) >= draft_len[:, None]] == 0).all()
    return [row[:n].tolist() for row, n in zip(draft, draft_len)]


HAND_CASES = [
    # (tokens, k, min_ngram, max_ngram, proposal)
    ([], 3, 1, 3, []),
    ([7], 3, 1, 3, []),  # shorter than any n with a token after it
    ([7, 7], 3, 1, 3, [7]),  # the suffix [7] occurs at 0, followed by the end
    ([4, 5, 6], 3, 1, 3, []),  # no match
    ([5, 6, 7, 1, 5], 3, 1, 3, [6, 7, 1]),  # match at the very start
    ([1, 1, 1, 1], 3, 1, 3, [1]),  # overlapping match [1,1,1] at 0, continuation runs into the end
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, 1, 3, [8, 1]),  # the most recent of two matches
    ([7, 1, 2, 5, 3, 1, 2, 6, 7, 1, 2], 3, 1, 3, [5, 3, 1]),  # longer n beats a more recent match
    ([7, 1, 2, 5, 3, 1, 2, 6, 7, 1, 2], 3, 1, 2, [6, 7, 1]),  # capped at n = 2
    ([3, 9, 4, 3], 2, 2, 3, []),  # a 1-gram match is below min_ngram
    ([3, 9, 4, 3], 0, 1, 3, []),  # k = 0
]


@pytest.mark.parametrize("tokens,k,min_ngram,max_ngram,proposal", HAND_CASES)
def test_hand_cases(tokens, k, min_ngram, max_ngram, proposal):
    assert oracle.ngram_propose(tokens, k, min_ngram, max_ngram) == proposal
    assert ngram_propose(tokens, k, min_ngram, max_ngram) == proposal
    buffer_len = len(tokens) + 3
    assert propose_torch([tokens], k, min_ngram, max_ngram, buffer_len) == [proposal]
    assert propose_jax([tokens], k, min_ngram, max_ngram, buffer_len) == [proposal]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 1), (1, 3), (2, 2), (2, 4)])
def test_all_versions_agree_on_random_sequences(k, min_ngram, max_ngram):
    rng = np.random.default_rng(k * 100 + min_ngram * 10 + max_ngram)
    # Small vocabularies make repeats, overlaps and multiple matches common.
    sequences = [
        rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(0, 30))).tolist()
        for _ in range(200)
    ]
    want = [oracle.ngram_propose(s, k, min_ngram, max_ngram) for s in sequences]
    assert any(want) and not all(want)
    assert [ngram_propose(s, k, min_ngram, max_ngram) for s in sequences] == want
    drafter = NgramDrafter(min_ngram, max_ngram)
    drafter.begin(sequences)
    draft = drafter.propose(k)
    assert [row[:n].tolist() for row, n in zip(draft.tokens, draft.lengths)] == want
    assert propose_torch(sequences, k, min_ngram, max_ngram, 32) == want
    assert propose_jax(sequences, k, min_ngram, max_ngram, 32) == want


def test_drafter_follows_emitted_tokens():
    drafter = NgramDrafter()
    drafter.begin([[1, 2, 3, 4, 1]])
    assert drafter.propose(3).tokens.tolist() == [[2, 3, 4]]
    drafter.observe([[2, 3, 9]])
    assert drafter.propose(3).lengths.tolist() == [0]  # "2 3 9", "3 9" and "9" are all new
    drafter.observe([[1, 2]])
    assert drafter.propose(2).tokens.tolist() == [[3, 9]]  # the most recent "1 2" is followed by 3 9


@pytest.mark.parametrize("k,min_ngram,max_ngram", [(-1, 1, 3), (2, 0, 3), (2, 3, 2)])
def test_bad_settings_are_rejected(k, min_ngram, max_ngram):
    with pytest.raises(SpecdecError):
        ngram_propose([1, 2, 1], k, min_ngram, max_ngram)


@pytest.mark.gpu
def test_torch_version_replays_in_a_cuda_graph():
    rng = np.random.default_rng(11)
    k, min_ngram, max_ngram, buffer_len = 4, 1, 3, 32

    def fresh_sequences():
        return [rng.integers(0, 4, int(rng.integers(0, buffer_len))).tolist() for _ in range(64)]

    tokens, lengths = (torch.from_numpy(x).cuda() for x in padded_buffer(fresh_sequences(),
                                                                            buffer_len))
    graph, (draft, draft_len) = capture_graph(lambda: ngram_propose_torch(tokens, lengths, k, min_ngram, max_ngram))

    for _ in range(3):
        sequences = fresh_sequences()
        new_tokens, new_lengths = padded_buffer(sequences, buffer_len)
        tokens.copy_(torch.from_numpy(new_tokens))
        lengths.copy_(torch.from_numpy(new_lengths))
        graph.replay()
        want = [oracle.ngram_propose(s, k, min_ngram, max_ngram) for s in sequences]
        assert unpad(draft.cpu().numpy(), draft_len.cpu().numpy()) == want
