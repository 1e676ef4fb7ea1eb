"""FastBatchGenerator's CUDA-graph decode step, run for real (marked `cuda`; skipped without a GPU, like
tests/test_cuda.py; SPECDRAFT_CUDA_TESTS_ON_CPU=1 runs the same checks eagerly on the CPU, a check of the tests
only): in fp32 the graphs give generate's greedy tokens on the tiny base and the eager path's on a random-init base
of SmolLM2's config (models/random_base.py); in bf16 the eager path's on the first tokens (the graphs attend over a
padded KV length, which may round differently later); a batch whose KV cache cannot fit fails at once with the
batch size to try."""

from __future__ import annotations

import os

import pytest
import torch

from data.self_distill import HFGenerator
from eval.engine.batch_generate import BatchOutOfMemory, FastBatchGenerator
from models.random_base import random_llama
from models.tiny import diverse_tiny_llama

ON_CUDA = torch.cuda.is_available()
_ON_CPU = os.environ.get("SPECDRAFT_CUDA_TESTS_ON_CPU") == "1" and not ON_CUDA
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not (ON_CUDA or _ON_CPU),
                                                   reason="needs a CUDA GPU (run on the GPU machine)")]
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

# SmolLM2-135M(-Instruct)'s config.json, architecture fields (as bench/decode_backends.py).
SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
NEW = 24
EOS = [2]


def _prompts(n: int, vocab: int = 49152) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (int(k),), generator=gen).tolist()
            for k in torch.randint(5, 150, (n,), generator=gen)]


def _graph_keys_are_few(engine) -> None:
    """The graphs are what ran, a few of them: (width, kv bucket) pairs."""
    if ON_CUDA:
        keys = sorted(engine._graphs)
        assert 1 <= len(keys) <= 12, keys
        assert all(kv % 128 == 0 or kv == engine.capacity for _, kv in keys), keys


@pytest.mark.parametrize("batch_size", [8, 3])  # 6 prompts: all in one batch; 3 slots refilled, then compacted
def test_graphs_equal_generate_in_fp32(batch_size):
    """The tiny base with clear top-2 gaps: generate's tokens exactly, end-of-turn hits included."""
    model = diverse_tiny_llama(0).to(DEVICE)
    prompts = [p[:40] for p in _prompts(6, vocab=320)]
    want = HFGenerator(model, [2, 7], 0, NEW, 0.0)(prompts, seed=0)
    engine = FastBatchGenerator(model, [2, 7], NEW, 0.0, batch_size=batch_size)
    assert engine.graphs == ON_CUDA
    got = engine(prompts, seed=0)
    assert got == want
    _graph_keys_are_few(engine)
    keys = set(engine._graphs)
    assert engine(prompts, seed=0) == got and set(engine._graphs) == keys  # a second call replays only


def test_graphs_equal_eager_on_the_smollm2_shape_in_fp32():
    model = random_llama(SMOLLM2, dtype=torch.float32, device=DEVICE)
    prompts = _prompts(6)
    graphs = FastBatchGenerator(model, EOS, NEW, 0.0, batch_size=4)
    eager = FastBatchGenerator(model, EOS, NEW, 0.0, batch_size=4, cuda_graphs=False)
    assert graphs(prompts, seed=0) == eager(prompts, seed=0)
    _graph_keys_are_few(graphs)


def test_graphs_equal_eager_on_the_smollm2_shape_in_bf16_on_the_first_tokens():
    model = random_llama(SMOLLM2, dtype=torch.bfloat16, device=DEVICE)
    prompts = _prompts(6)
    graphs = FastBatchGenerator(model, EOS, NEW, 0.0, batch_size=8)(prompts, seed=0)
    eager = FastBatchGenerator(model, EOS, NEW, 0.0, batch_size=8, cuda_graphs=False)(prompts, seed=0)
    assert [g[:6] for g in graphs] == [e[:6] for e in eager]  # 5 decode steps after the (eager) prefill's token
    same = sum(g == e for g, e in zip(graphs, eager))
    assert same >= 4, f"only {same}/6 answers identical: {graphs} vs {eager}"


def test_a_batch_that_cannot_fit_fails_with_the_size_to_try():
    if not ON_CUDA:
        pytest.skip("an impossible allocation on the CPU may be granted lazily; CUDA refuses it at once")
    model = random_llama(SMOLLM2, dtype=torch.bfloat16, device=DEVICE)
    engine = FastBatchGenerator(model, EOS, 4096, 0.0, batch_size=1 << 20)  # ~ 2.8 TB of KV cache
    with pytest.raises(BatchOutOfMemory, match=r"at batch size 1048576 .*retry with batch size 524288$"):
        engine([[5, 6, 7]] * (1 << 20), seed=0, limits=[1] * (1 << 20))
    assert engine(_prompts(2), seed=0, limits=[3, 3]) is not None  # still usable at a size that fits
