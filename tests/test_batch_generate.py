"""FastBatchGenerator (eval/engine/batch_generate.py) on tiny random bases in fp32 on the CPU: greedy answers
token-identical to transformers `generate` (HFGenerator, the regenerate path) for prompts of different lengths,
per-prompt limits and end-of-turn ids hit mid-batch, with every slot refilled from the queue or all prompts in one
batch; sampling deterministic per seed; unsupported bases and out-of-memory refused with the fix."""

import functools
from collections import Counter

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from data.self_distill import HFGenerator
from eval.engine.batch_generate import BatchOutOfMemory, FastBatchGenerator
from models.tiny import TINY_ARCHS, TINY_VOCAB_SIZE, tiny_model

NEW = 20  # max_new_tokens
PAD = 0


def _prompts(n: int = 9, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (n,), generator=gen).tolist()  # 2..39 tokens: the window (16) is crossed
    return [torch.randint(3, TINY_VOCAB_SIZE, (k,), generator=gen).tolist() for k in lengths]


@functools.cache
def _case(arch: str):
    """(model, prompts, eos, limits, generate's answers) for one architecture. eos: the im_end id plus the token
    the base emits most often after its first one, so several rows end mid-batch (and at different steps)."""
    model = tiny_model(arch, seed=0, diverse=True).requires_grad_(False)
    prompts = _prompts()
    free = HFGenerator(model, [2], PAD, NEW, 0.0)(prompts, seed=0)
    common = Counter(t for row in free for t in row[1:]).most_common(1)[0][0]
    eos = [2, common]
    want = HFGenerator(model, eos, PAD, NEW, 0.0)(prompts, seed=0)
    limits = [NEW, 1, 0, 7, NEW, 3, NEW, 12, NEW]
    return model, prompts, eos, limits, want


@pytest.fixture(params=TINY_ARCHS)
def case(request):
    return _case(request.param)


@pytest.fixture
def llama_case():
    return _case("llama")


def test_the_case_is_not_trivial(case):
    """The parity checks below mean something only if rows end at different steps, by eos and by the cap."""
    _, _, eos, _, want = case
    ended = [len(row) for row in want if row and row[-1] in eos]
    assert len(ended) >= 2 and len(set(ended)) >= 2, want
    assert any(len(row) == NEW and row[-1] not in eos for row in want), want


@pytest.mark.parametrize("batch_size", [16, 3])
def test_greedy_equals_generate_in_fp32(case, batch_size):
    """16: every prompt in one batch; 3: slots refilled from the queue as rows finish, then compacted."""
    model, prompts, eos, _, want = case
    engine = FastBatchGenerator(model, eos, NEW, 0.0, batch_size=batch_size, prefill_tokens=64)
    assert engine.name == "fast" and "float32 cpu" in engine.version
    assert engine(prompts, seed=0) == want


@pytest.mark.parametrize("batch_size", [16, 3])
def test_limits_cut_each_prompt_at_its_own_cap(llama_case, batch_size):
    model, prompts, eos, limits, want = llama_case
    engine = FastBatchGenerator(model, eos, NEW, 0.0, batch_size=batch_size)
    got = engine(prompts, seed=0, limits=limits)
    assert got == [row[:n] for row, n in zip(want, limits)]
    assert got[2] == [] and len(got[1]) == 1


def test_a_second_call_with_longer_prompts_grows_the_cache(llama_case):
    model, prompts, eos, _, want = llama_case
    engine = FastBatchGenerator(model, eos, NEW, 0.0, batch_size=4)
    assert engine(prompts[:2], seed=0) == want[:2]
    small = engine.capacity
    long = [p * 5 for p in prompts[:3]]  # up to ~200 tokens: past the first call's capacity
    assert engine(long, seed=0) == HFGenerator(model, eos, PAD, NEW, 0.0)(long, seed=0)
    assert engine.capacity > small and engine.capacity % 64 == 0


def test_compaction_moves_the_live_rows_with_their_cache(llama_case):
    """Prompts longest first fill slots 0..3 in order; rows 0 and 1 stop after 2 and 3 tokens, so rows 2 and 3
    (the live half) move to slots 0 and 1 and go on from there: their answers show whether their K/V moved."""
    model, prompts, _, _, _ = llama_case
    prompts = sorted(prompts, key=len, reverse=True)[:4]
    limits = [2, 3, NEW, NEW]
    want = HFGenerator(model, [2], PAD, NEW, 0.0)(prompts, seed=0)
    assert len(want[2]) == len(want[3]) == NEW  # no end-of-turn: rows 2 and 3 outlive rows 0 and 1
    engine = FastBatchGenerator(model, [2], NEW, 0.0, batch_size=4)
    moved, compact = [], engine._compact

    def recording_compact(owner, *rest):
        moved.append([b for b, o in enumerate(owner) if o >= 0])
        return compact(owner, *rest)

    engine._compact = recording_compact
    assert engine(prompts, seed=0, limits=limits) == [row[:n] for row, n in zip(want, limits)]
    assert moved and moved[0] == [2, 3]


def test_sampling_is_deterministic_per_seed():
    model = tiny_model("llama", seed=0, diverse=True).requires_grad_(False)
    prompts = _prompts()
    engine = FastBatchGenerator(model, [2], NEW, temperature=1.0, batch_size=4)
    a, b, c = engine(prompts, seed=5), engine(prompts, seed=5), engine(prompts, seed=6)
    assert a == b
    assert a != c
    assert all(len(row) <= NEW and all(0 <= t < TINY_VOCAB_SIZE for t in row) for row in a)
    greedy = FastBatchGenerator(model, [2], NEW, 0.0, batch_size=4)(prompts, seed=5)
    assert a != greedy  # the temperature is really applied


def test_unsupported_bases_are_refused_naming_the_hf_engine():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with pytest.raises(ValueError, match="'gpt2'.*--engine hf"):
        FastBatchGenerator(gpt2, [2], NEW)
    llama = tiny_model("llama")
    llama.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'.*--engine hf"):
        FastBatchGenerator(llama, [2], NEW)


def test_bad_limits_are_refused():
    engine = FastBatchGenerator(tiny_model("llama"), [2], NEW)
    with pytest.raises(ValueError, match="limit 21"):
        engine([[5, 6]], seed=0, limits=[NEW + 1])
    with pytest.raises(ValueError, match="2 prompts but 1 limits"):
        engine([[5], [6]], seed=0, limits=[3])


def test_out_of_memory_names_the_batch_size_to_try(monkeypatch):
    engine = FastBatchGenerator(tiny_model("llama"), [2], NEW, batch_size=64)

    def oom(rows, capacity):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(engine, "_ensure", oom)
    with pytest.raises(BatchOutOfMemory, match="at batch size 10 .*retry with batch size 5$") as err:
        engine(_prompts(10), seed=0)
    assert err.value.retry_rows == 5  # what `specdraft regenerate` names as --fast-rows
    assert engine.k_cache is None and not engine._graphs  # released: the next call starts clean
