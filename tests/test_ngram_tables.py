"""Model-derived n-gram tables: batched bigram vs per-token reference, greedy chaining, unigram, disk cache."""

from __future__ import annotations

import pytest
import torch

from models.base import load_base
from models.families.ngram.model import (
    BigramTable,
    bigram_table_for,
    build_bigram_table,
    build_bigram_table_reference,
    extend_bigram,
    extend_bigram_reference,
    model_unigram,
    unigram_distances,
    unigram_distances_reference,
)


def test_bigram_table_matches_per_token_reference(model):
    fast = build_bigram_table(model, 5, batch_size=64, progress=False)  # 320 tokens: 5 batches
    ref = build_bigram_table_reference(model, 5)
    assert fast.tokens.shape == (320, 5)
    assert torch.equal(fast.tokens, ref.tokens)
    torch.testing.assert_close(fast.probs, ref.probs, rtol=1e-4, atol=1e-6)
    assert bool((fast.probs[:, :-1] >= fast.probs[:, 1:]).all())  # best first
    # Spot check against a direct forward on one token.
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[77]])).logits[0, -1]
    assert fast.tokens[77].tolist() == logits.topk(5).indices.tolist()


def test_extend_bigram_chains_greedily():
    top1 = torch.tensor([1, 2, 0, 3])  # 0 -> 1 -> 2 -> 0 ..., 3 -> 3
    chain = extend_bigram(top1, 4)
    assert chain.tolist() == [[1, 2, 0, 1], [2, 0, 1, 2], [0, 1, 2, 0], [3, 3, 3, 3]]
    rand = torch.randint(0, 50, (50,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(extend_bigram(rand, 6), extend_bigram_reference(rand, 6))
    assert extend_bigram(rand, 0).shape == (50, 0)


def test_unigram_distance_matches_sum_form_and_ranks(model):
    d = unigram_distances(model)
    torch.testing.assert_close(d, unigram_distances_reference(model), rtol=1e-4, atol=1e-5)
    tokens, p = model_unigram(model)
    assert torch.equal(tokens, d.argsort(stable=True))  # nearest to the mean = most likely
    assert abs(float(p.sum()) - 1) < 1e-5 and bool((p[:-1] >= p[1:]).all())


def test_bigram_cache_is_reused_and_serves_smaller_k(tmp_path):
    base = load_base("tiny", dtype="fp32")
    t8, path, cached = bigram_table_for(base, 8, cache_dir=tmp_path, progress=False)
    assert not cached and path.exists() and path.parent == tmp_path / "ngram" and base.fingerprint in path.name
    assert not list(path.parent.glob(".*tmp*"))  # atomic write left no temp file
    again, path2, cached2 = bigram_table_for(base, 8, cache_dir=tmp_path, progress=False)
    assert cached2 and path2 == path and torch.equal(again.tokens, t8.tokens)
    t3, path3, cached3 = bigram_table_for(base, 3, cache_dir=tmp_path, progress=False)  # served from k=8
    assert cached3 and path3 == path and torch.equal(t3.tokens, t8.tokens[:, :3])


def test_truncate_refuses_more_than_stored():
    t = BigramTable(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="rebuild it with k >= 5"):
        t.truncate(5)
