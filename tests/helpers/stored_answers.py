"""A small store of the tiny base's greedy answers (the format `specdraft field-refs` writes), for tests of the
field benchmark and of what reads it: `sets` x `per_set` random prompts, 20 answer tokens each plus the tail."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate
from eval.field.refs import TAIL, write_refs
from models.base import load_base

ANSWER_TOKENS = 20


def write_tiny_refs(out: Path, fingerprint: str | None = None, sets=("set-a", "set-b"), per_set: int = 3) -> Path:
    """Write the store to `out` and return it; fingerprint: the base the card names (default the tiny base's)."""
    base = load_base("tiny")
    backend = HFBackend(base.model)
    gen = torch.Generator().manual_seed(3)
    lines = []
    for s in sets:
        for k in range(per_set):
            p = torch.randint(3, 300, (6 + 2 * k,), generator=gen)
            a = autoregressive_generate(backend, p, max_new_tokens=ANSWER_TOKENS + TAIL).tokens
            lines.append({"id": f"{s}-{k}", "set": s, "p": p.tolist(), "a": a, "n": ANSWER_TOKENS, "e": 0})
    fake = SimpleNamespace(name="tiny", fingerprint=fingerprint or base.fingerprint)
    settings = {"max_new_tokens": ANSWER_TOKENS, "tail": TAIL, "max_prompt_tokens": 64, "dtype": "float32",
                "sets": []}
    write_refs(out, lines, fake, settings, SimpleNamespace(name="hf", version="test"), {}, "test", 0.0)
    return out


def lockstep_refs(model, prompts: int = 8, new: int = 24):
    """(refs, eos) in memory for the batched-path parity tests: `prompts` prompts of 5, 7, ... tokens with the base's
    greedy answers (`new` + TAIL tokens), alternately in two sets. One answer token is declared end-of-turn, so some
    answers end early (n through it, as field-refs stores them) and others run to `new`."""
    from eval.field.refs import RefPrompt

    backend = HFBackend(model)
    gen = torch.Generator().manual_seed(11)
    ps = [torch.randint(3, 300, (5 + 2 * i,), generator=gen) for i in range(prompts)]
    answers = [autoregressive_generate(backend, p, max_new_tokens=new + TAIL).tokens for p in ps]
    eos = [answers[1][9]]
    refs = []
    for i, (p, a) in enumerate(zip(ps, answers)):
        n = next((j + 1 for j, t in enumerate(a[:new]) if t in eos), new)
        refs.append(RefPrompt(f"p{i}", f"set-{i % 2}", p.tolist(), a, n, n < new))
    assert any(r.eos for r in refs) and not all(r.eos for r in refs)
    return refs, eos


def lockstep_length(r) -> int:
    """Per prompt max_new_tokens in the parity tests: the stored n, one prompt cut shorter (the length truncation)
    and one at 1 (no decode step at all)."""
    return {"p2": min(r.n, 7), "p5": 1}.get(r.id, r.n)


def exact_rows_with_trees(drafter, refs, inputs, eos, vocab, fields, record=lambda tree: tree.tokens.tolist()):
    """The exact path's row per prompt (field.simulate, the decoder loop against the stored answer) with every tree
    it drafted (`record(tree)` per step): what a batched path's rows and trees are compared with. inputs(r) ->
    (hidden, aux, aux_layers) of the prompt's teacher-forced pass."""
    from eval.field.simulation import simulate

    out, original = {}, drafter.propose
    for r in refs:
        trees = []

        def spy(state, trees=trees):
            tree = original(state)
            trees.append(record(tree))
            return tree

        drafter.propose = spy
        try:
            res = simulate(drafter, r.prompt, r.answer, lockstep_length(r), *inputs(r), vocab, eos)
        finally:
            del drafter.propose
        out[r.id] = {**{f: getattr(res, f) for f in fields}, "trees": trees}
    return out


def static_lockstep_rows(run, drafter, refs, states, eos, width, monkeypatch, fields, redo=None) -> dict:
    """A batched path's row per prompt with every tree it verified (spied at static.verify_and_book, the shared
    verify-and-book step): what exact_rows_with_trees gives for the exact path. states(r) -> (aux rows, []) of the
    prompt, as run_field hands them; redo(r) is called for a prompt handed to the exact path (a near tie)."""
    from eval.engine.drafters import static

    out, trees = {}, {}
    original = static.verify_and_book

    def spy(slot, tokens, tree):
        trees.setdefault(slot.ref.id, []).append(list(tokens))
        original(slot, tokens, tree)

    kw = {} if redo is None else {"redo": redo}
    with monkeypatch.context() as m:
        m.setattr(static, "verify_and_book", spy)
        run(drafter, refs, states, lockstep_length, eos,
            lambda r, s: out.setdefault(r.id, {f: getattr(s, f) for f in fields}), width=width, **kw)
    return {rid: {**v, "trees": trees.get(rid, [])} for rid, v in out.items()}
