"""Stored base answers (eval/field/refs.py) on the tiny base: the answers are the base's greedy decode with
the tail past their end, too-long prompts are skipped with a count, and a later build resumes from the store itself
(no partial file: another machine) and generates only what is new."""

from __future__ import annotations

import torch
from helpers.regen_base import regen_base

import eval.field.refs as field_refs
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate
from eval.field.refs import TAIL, build_refs, read_refs


def test_answers_are_greedy_with_a_tail_and_a_build_resumes_from_the_store(tmp_path, monkeypatch):
    base = regen_base()
    out = tmp_path / "refs"
    card = build_refs(out, base, sets=["mtbench"], max_new_tokens=6, max_prompt_tokens=300, batch_size=16,
                      cache_dir=tmp_path / "c1", progress=False)
    _, refs = read_refs(out, base.fingerprint)
    assert card["counts"]["mtbench"] == len(refs) > 0
    assert card["prompts"] + card["skipped_too_long"].get("mtbench", 0) == 80  # every question stored or counted
    backend = HFBackend(base.model)
    for r in refs[:3]:
        want = autoregressive_generate(backend, torch.tensor(r.prompt), max_new_tokens=6 + TAIL).tokens
        assert r.answer == want and r.n == 6 and len(r.answer) == 6 + TAIL  # no end-of-turn in the tiny base

    calls = []
    real = field_refs._engine

    def counting(*a, **k):
        engine = real(*a, **k)
        return lambda prompts, seed: calls.append(len(prompts)) or engine(prompts, seed)

    monkeypatch.setattr(field_refs, "_engine", counting)
    card2 = build_refs(out, base, sets=["mtbench", "mtbench-turn2"], max_new_tokens=6, max_prompt_tokens=300,
                       batch_size=16, cache_dir=tmp_path / "c2", progress=False)  # a new cache: only the store
    _, refs2 = read_refs(out, base.fingerprint)
    assert [r.answer for r in refs2 if r.set == "mtbench"] == [r.answer for r in refs]  # kept, in source order
    assert card2["counts"]["mtbench-turn2"] > 0
    assert sum(calls) == card2["counts"]["mtbench-turn2"]  # only the new set was generated
    calls.clear()
    card3 = build_refs(out, base, sets=["mtbench-turn2"], max_new_tokens=6, max_prompt_tokens=300, batch_size=16,
                       cache_dir=tmp_path / "c3", progress=False)  # one set asked for: the others stay stored
    assert card3["counts"] == card2["counts"] and card3["sets"] == ["mtbench", "mtbench-turn2"] and not calls
    assert [r.answer for r in read_refs(out, base.fingerprint)[1]] == [r.answer for r in refs2]
