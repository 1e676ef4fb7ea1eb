"""N-gram drafter: hand-checked context ranking (counts, recency, ragged ends), row filling and
de-duplication, tensor-vs-reference parity, and greedy losslessness through the decoder."""

from __future__ import annotations

import pytest
import torch

from eval.engine.backends.fast import FastBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState
from models.families.ngram.drafter import (
    NgramDrafter,
    context_rows,
    context_rows_reference,
    longest_match_row,
    longest_match_row_reference,
    merge_rows,
    ngram_options,
)
from models.families.ngram.model import BigramTable, build_bigram_table
from models.tiny import diverse_tiny_llama, tiny_llama


def _rows(seq, q, w, limit=10):
    return context_rows(torch.tensor(seq), q, w, limit).tolist()


def test_context_rows_rank_by_count_then_recency():
    # '5' at 0, 3, 6 (9 is the query itself): continuations [7,8] twice (latest 6), [7,9] once.
    assert _rows([5, 7, 8, 5, 7, 9, 5, 7, 8, 5], 1, 2) == [[7, 8], [7, 9]]
    # Equal counts: the later match first.
    assert _rows([1, 2, 1, 3, 1], 1, 1) == [[3], [2]]
    # ... and a count beats recency.
    assert _rows([1, 2, 1, 2, 1, 3, 1], 1, 1) == [[2], [3]]
    # q = 2 matches both tokens; the limit keeps the best rows only.
    assert _rows([1, 2, 3, 1, 2, 4, 1, 9, 1, 2], 2, 1) == [[4], [3]]
    assert _rows([1, 2, 3, 1, 2, 4, 1, 9, 1, 2], 2, 1, limit=1) == [[4]]


def test_context_rows_ragged_end_and_no_match():
    assert _rows([4, 6, 4], 1, 3) == [[6, 4, -1]]  # the continuation runs into the end: padded
    assert _rows([1, 2, 3], 1, 2) == []  # '3' never occurred before
    assert _rows([3], 1, 2) == []  # nothing before the query at all
    assert _rows([2, 2, 2], 1, 2) == [[2, -1], [2, 2]]  # overlapping matches, both lengths, recency


@pytest.mark.parametrize("q,w", [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_context_rows_match_reference(q, w):
    gen = torch.Generator().manual_seed(q * 10 + w)
    for n in (1, 2, 5, 40, 120):
        seq = torch.randint(0, 4, (n,), generator=gen)  # 4 symbols: many matches and ties
        for limit in (1, 3, 50):
            assert context_rows(seq, q, w, limit).tolist() == context_rows_reference(seq.tolist(), q, w, limit)


def _lm(seq, q_min, q_max, w):
    return longest_match_row(torch.tensor(seq), q_min, q_max, w)


def test_longest_match_prefers_length_then_the_earliest_occurrence():
    # Suffix [1, 2]: '2' alone occurs at 1 and 4, but the 2-token query [1, 2] only at 0..1 -> continuation [3, 2].
    assert _lm([1, 2, 3, 2, 1, 2], 1, 2, 2) == [3, 2]
    # Only single tokens allowed: '2' first occurs at 1 -> the tokens after it.
    assert _lm([1, 2, 3, 2, 1, 2], 1, 1, 3) == [3, 2, 1]
    # Earliest, not most frequent or latest: '5' at 0 (-> 7), 2 (-> 8), 4 (-> 8).
    assert _lm([5, 7, 5, 8, 5, 8, 5], 1, 1, 1) == [7]
    # The continuation stops at the end of the sequence; an overlapping run still matches.
    assert _lm([2, 2, 2], 1, 2, 4) == [2]
    # No occurrence of any allowed length, or too short a sequence: no row.
    assert _lm([1, 2, 3], 1, 3, 2) == []
    assert _lm([4], 1, 1, 2) == []
    assert _lm([1, 2, 9, 2], 2, 2, 2) == []  # '2' recurs, but q_min = 2 and [9, 2] does not


@pytest.mark.parametrize("q_min,q_max,w", [(1, 1, 3), (1, 3, 4), (2, 2, 1), (2, 4, 5)])
def test_longest_match_row_matches_reference(q_min, q_max, w):
    gen = torch.Generator().manual_seed(q_min * 100 + q_max * 10 + w)
    for n in (1, 2, 3, 7, 40, 150):
        for symbols in (2, 5):
            seq = torch.randint(0, symbols, (n,), generator=gen)
            assert longest_match_row(seq, q_min, q_max, w) == longest_match_row_reference(seq.tolist(), q_min,
                                                                                           q_max, w)


def test_merge_rows_drops_prefixes_and_duplicates_and_stops_at_k():
    out = merge_rows([[[7, 8], [7, -1], []], [[7, 8, 9], [7, 8], [3, -1], [4]]], k=3)
    assert out == [(7, 8), (7, 8, 9), (3,)]  # [7] is a prefix of [7,8]; [7,8,9] adds a node so it stays
    assert merge_rows([[[1], [2], [3]]], k=5) == [(1,), (2,), (3,)]


def _table(vocab=10, k=4):
    """tokens[a, j] = (a + 2 + j) % vocab: top-1 after a is a + 2 (mod vocab)."""
    a = torch.arange(vocab)[:, None]
    toks = (a + 2 + torch.arange(k)) % vocab
    return BigramTable(toks, torch.full((vocab, k), 0.1))


def test_mixed_fills_context_first_then_bigram_without_duplicates():
    d = NgramDrafter(k=4, w=2, strategy="mixed", bigram_table=_table())
    ids, root = torch.tensor([5, 7, 8, 5, 7, 9]), 5
    # context after '5': [7,9] (latest) then [7,8]; bigram rows from 5: [7,9] (dup), [8,0], [9,1], [0,2].
    assert d.rows(ids, root) == [(7, 9), (7, 8), (8, 0), (9, 1)]
    tree = d.propose(DecodeState(ids=ids, root=root, new_hidden=torch.zeros(1, 4), new_ids=ids[-1:]))
    assert tree.tokens.tolist() == [5, 7, 9, 8, 8, 0, 9, 1]  # the two rows starting with 7 share a node
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0, 4, 0, 6]
    assert tree.num_nodes <= d.max_nodes == 9


def test_strategies_alone():
    ids, root = torch.tensor([5, 7, 8, 5, 7, 9]), 5
    assert NgramDrafter(k=3, w=2, strategy="context").rows(ids, root) == [(7, 9), (7, 8)]
    assert NgramDrafter(k=2, w=3, strategy="bigram", bigram_table=_table()).rows(ids, root) == [(7, 9, 1), (8, 0, 2)]
    uni = NgramDrafter(k=2, w=2, strategy="unigram", bigram_table=_table(), unigram_tokens=torch.tensor([3, 1, 2]))
    assert uni.rows(ids, root) == [(3, 5), (1, 3)]
    # No context match: a 1-node tree (plain AR step), never an error.
    tree = NgramDrafter(k=3, w=2, strategy="context").propose(
        DecodeState(ids=torch.tensor([1, 2]), root=3, new_hidden=torch.zeros(1, 4), new_ids=torch.tensor([2])))
    assert tree.tokens.tolist() == [3]


def test_bad_options_say_how_to_fix():
    with pytest.raises(ValueError, match="needs a bigram table"):
        NgramDrafter(strategy="mixed")
    with pytest.raises(ValueError, match="rebuild it with k >= 10"):
        NgramDrafter(k=10, bigram_table=_table(k=4))
    with pytest.raises(ValueError, match="unknown ngram strategy"):
        NgramDrafter(strategy="trigram")
    with pytest.raises(ValueError, match=r"unknown ngram option\(s\) \['kk'\]"):
        ngram_options({"kk": 3})
    with pytest.raises(ValueError, match="proposes one row; set k=1"):
        NgramDrafter(k=4, strategy="longest_match")
    with pytest.raises(ValueError, match="q_min .* must be in 1..q=2"):
        NgramDrafter(k=1, q=2, q_min=3, strategy="longest_match")



@pytest.mark.parametrize("strategy", ["mixed", "context", "bigram", "longest_match"])
def test_greedy_is_lossless_through_the_decoder(strategy):
    model = diverse_tiny_llama(0)
    table = build_bigram_table(model, 6, progress=False)
    backend = FastBackend(model)
    gen = torch.Generator().manual_seed(5)
    base = torch.randint(3, 320, (6,), generator=gen)
    prompt = torch.cat([base, base, base[:3]])  # repeats: context rows exist from the first step
    k = 1 if strategy == "longest_match" else 6  # vLLM's prompt lookup: one row
    drafter = NgramDrafter(k=k, w=4, q=3, q_min=1, strategy=strategy, bigram_table=table)
    spec = speculative_generate(backend, drafter, prompt, max_new_tokens=40)
    ar = autoregressive_generate(backend, prompt, max_new_tokens=40)
    assert spec.tokens == ar.tokens and len(ar.tokens) == 40
    assert spec.acceptance_length >= 1.0


def test_context_drafts_are_accepted_on_repetitive_output():
    """The default tiny model's greedy output repeats one token: context rows predict it exactly."""
    model = tiny_llama(0)
    backend = FastBackend(model)
    prompt = torch.tensor([5, 9, 11, 13, 17])
    ar = autoregressive_generate(backend, prompt, max_new_tokens=30)
    spec = speculative_generate(backend, NgramDrafter(k=2, w=4, strategy="context"), prompt, max_new_tokens=30)
    assert spec.tokens == ar.tokens
    assert spec.acceptance_length > 3.0  # ~5 (4 drafts + bonus) once the repetition starts
