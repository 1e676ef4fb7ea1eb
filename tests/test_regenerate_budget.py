"""Regeneration up to the training length (token_budget) and transformers' static cache as the hf engine, on a
tiny random LLaMA in fp32 (data/self_distill.py)."""

import json

import pytest
import torch
from helpers.regen_base import SHAREGPT_FIXTURE, regen_base

from data.self_distill import HFGenerator, build_self_distilled, end_of_turn_ids, sidecar

FIXTURE = SHAREGPT_FIXTURE


@pytest.fixture(scope="module")
def base():
    return regen_base()


def _records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _answers(rec):
    return [m["value"] for m in rec["conversations"] if m["from"] == "gpt"]


def test_a_budget_cuts_each_conversation_where_training_would(base, tmp_path):
    """Greedy answers under a budget are the unbudgeted answers cut at the budget: conversations that fit are
    identical, the one that crosses it ends in a prefix of the full answer and has no later turn, and fewer
    tokens are generated."""
    kw = dict(max_records=6, max_new_tokens=40, max_turns=3, batch_size=4)
    full = build_self_distilled(base, FIXTURE, out=tmp_path / "full.jsonl", **kw)
    cut = build_self_distilled(base, FIXTURE, out=tmp_path / "cut.jsonl", token_budget=120, **kw)
    full_meta, cut_meta = (json.loads(sidecar(p).read_text()) for p in (full, cut))
    assert cut_meta["key"] != full_meta["key"] and cut_meta["token_budget"] == 120
    assert 0 < cut_meta["generated_tokens"] < full_meta["generated_tokens"]
    assert cut_meta["budget_cut_records"] > 0
    partial_flags = 0
    tok = base.tokenizer
    for rid, rec in _records(cut).items():
        a, b = _answers(rec), _answers(_records(full)[rid])
        assert a[:-1] == b[:len(a) - 1]  # every turn before the last is the full answer
        assert b[len(a) - 1].startswith(a[-1])  # the last one is the full answer or its beginning
        rendered = len(tok.apply_chat_template([{"role": {"human": "user", "gpt": "assistant", "system": "system"}[
            m["from"]], "content": m["value"]} for m in rec["conversations"]], tokenize=True))
        if a != b:
            partial_flags += 1
            assert rendered <= 120 + 8  # cut at the budget (+ the end-of-turn suffix the template adds)
        else:
            assert rendered <= 120 + 8 or len(a) == 3
    assert partial_flags == cut_meta["budget_cut_records"]


def test_the_engine_is_asked_for_what_fits_the_budget_only(base, tmp_path):
    """Each prompt's limit is min(max_new_tokens, budget - its rendered length); a first prompt that fills the
    budget skips the record; a conversation stops once its next prompt would."""
    seen = []

    class Scripted:
        name, version = "scripted", "1"

        def __call__(self, prompts, seed, limits=None):
            seen.append(list(zip(map(len, prompts), limits)))
            return [[65] * n for n in limits]  # never ends a turn: always runs into its limit

    out = build_self_distilled(base, FIXTURE, max_records=4, max_new_tokens=30, max_turns=3, batch_size=4,
                               out=tmp_path / "s.jsonl", engine=Scripted(), token_budget=100)
    assert seen and all(n == min(30, 100 - p) for call in seen for p, n in call)
    assert all(p + n <= 100 for call in seen for p, n in call)
    meta = json.loads(sidecar(out).read_text())
    assert 0 < meta["budget_cut_records"] < meta["records"]  # single-turn ones stopped at max_new_tokens instead
    roomy = build_self_distilled(base, FIXTURE, max_records=4, max_new_tokens=30, max_turns=3, batch_size=4,
                                 out=tmp_path / "r.jsonl", engine=Scripted(), token_budget=10_000)
    assert json.loads(sidecar(roomy).read_text())["budget_cut_records"] == 0
    first = seen[0]
    too_long = build_self_distilled(base, FIXTURE, max_records=4, max_new_tokens=30, max_turns=1, batch_size=4,
                                    out=tmp_path / "t.jsonl", engine=Scripted(),
                                    token_budget=min(p for p, _ in first) + 1)
    assert json.loads(sidecar(too_long).read_text())["skipped_long"] >= 1


def test_a_budget_below_two_tokens_is_refused(base, tmp_path):
    with pytest.raises(ValueError, match="token_budget=1"):
        build_self_distilled(base, FIXTURE, max_records=2, out=tmp_path / "x.jsonl", token_budget=1)


def test_static_cache_generator_matches_generate_in_fp32(base):
    """transformers' static cache (padded prompt width, preallocated K/V) gives generate's greedy tokens, with
    per-row limits honoured."""
    tok, eos = base.tokenizer, end_of_turn_ids(base)
    prompts = [tok(t)["input_ids"] for t in ("hello there", "a much longer prompt about the weather in Paris", "x")]
    dynamic = HFGenerator(base.model, eos, tok.pad_token_id, 24, 0.0)
    static = HFGenerator(base.model, eos, tok.pad_token_id, 24, 0.0, cache="static")
    assert "static" in static.version and static.version != dynamic.version  # another file key
    want = dynamic(prompts, seed=0)
    assert static(prompts, seed=0) == want
    limits = [5, 24, 1]
    got = static(prompts, seed=0, limits=limits)
    assert got == [w[:n] for w, n in zip(want, limits)] == dynamic(prompts, seed=0, limits=limits)
    with pytest.raises(ValueError, match="cache='paged'"):
        HFGenerator(base.model, eos, tok.pad_token_id, 24, 0.0, cache="paged")


def test_static_cache_regeneration_equals_the_dynamic_one(base, tmp_path):
    tok, eos = base.tokenizer, end_of_turn_ids(base)
    kw = dict(max_records=4, max_new_tokens=16, max_turns=2, batch_size=4, token_budget=90)
    dyn = build_self_distilled(base, FIXTURE, out=tmp_path / "d.jsonl", **kw)
    stat = build_self_distilled(base, FIXTURE, out=tmp_path / "s.jsonl", **kw,
                                engine=HFGenerator(base.model, eos, tok.pad_token_id, 16, 0.0, cache="static"))
    assert dyn.read_text() == stat.read_text()


def test_a_time_budget_writes_what_is_done_and_the_same_call_continues(base, tmp_path, monkeypatch):
    """max_seconds: no batch starts after it; the finished file holds the conversations done (complete: false,
    derived_from counts only them) and the same call later generates the rest, ending where an uninterrupted
    build ends."""
    import data.self_distill as sd

    clock = iter(range(0, 10_000, 10))  # every perf_counter() call: 10 s later
    monkeypatch.setattr(sd.time, "perf_counter", lambda: next(clock))
    kw = dict(max_records=6, max_new_tokens=8, batch_size=2, out=tmp_path / "t.jsonl")
    out = build_self_distilled(base, FIXTURE, max_seconds=25, **kw)
    meta = json.loads(sidecar(out).read_text())
    assert meta["complete"] is False and 0 < meta["derived_from"]["max_records"] < 6
    assert len(out.read_text().splitlines()) == meta["records"] == meta["derived_from"]["max_records"]
    monkeypatch.undo()
    again = build_self_distilled(base, FIXTURE, **kw)
    meta = json.loads(sidecar(again).read_text())
    assert meta["complete"] is True and meta["derived_from"]["max_records"] == 6
    whole = build_self_distilled(base, FIXTURE, **{**kw, "out": tmp_path / "whole.jsonl"})
    assert again.read_text() == whole.read_text()


def test_out_of_memory_is_one_line_with_the_batch_size_to_try(base, tmp_path, monkeypatch):
    """An engine that runs out of memory on the second batch: one error naming the batch size to try; the first
    batch stays in the partial file and a rerun with that size resumes after it."""
    tok, eos = base.tokenizer, end_of_turn_ids(base)
    engine = HFGenerator(base.model, eos, tok.pad_token_id, 8, 0.0)
    real, calls = base.model.generate, []

    def generate(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(*a, **kw)

    monkeypatch.setattr(base.model, "generate", generate)
    kw = dict(max_records=6, max_new_tokens=8, out=tmp_path / "o.jsonl", engine=engine)
    with pytest.raises(ValueError, match=r"out of memory at a batch of 3 .* --batch-size 1 \(it resumes"):
        build_self_distilled(base, FIXTURE, batch_size=3, **kw)
    partial = tmp_path / "o.jsonl.partial"
    assert len(partial.read_text().splitlines()) == 1 + 3  # header + the first batch
    monkeypatch.setattr(base.model, "generate", real)
    out = build_self_distilled(base, FIXTURE, batch_size=1, **kw)
    assert json.loads(sidecar(out).read_text())["records"] == 6
