"""The field benchmark's lockstep EAGLE-3 simulator (models/families/eagle3/lockstep.py) against its slow twin, the
per-prompt path (eval/field/simulation.py: simulate = the unchanged decoder loop against a ReplayBackend), on the tiny
base: per prompt and step the same accepted lengths, accept / proposed counts per depth, tree nodes and tokens, for a
chain, the EAGLE-2 tree (also with a draft vocabulary), P-EAGLE's parallel chain, and a saturated draft whose scores
tie exactly (the tree's tie rules); run_field writes the same rows either way and resumes. Drafts are trained briefly
on the base's greedy continuations so that steps accept several tokens (equal 1s would prove nothing).

Lockstep is not bitwise by construction (a batched matrix product's row may differ from the 1-row product in the
last bits); on the tiny base the two paths agree exactly, which is what these tests assert. On the shipped draft and
real stored answers, tests/test_field_real.py (slow) asserts the same equality row for row and tree for tree; and
every batched run measures its own agreement on a sample of its prompts (the last test here shows that check
catching a defect)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import fit_draft
from helpers.drafts import greedy_continuation_batch, perturb, with_draft_vocab
from helpers.stored_answers import exact_rows_with_trees, lockstep_length, lockstep_refs

from eval.engine.backends.hf import HFBackend
from eval.field.simulation import run_field, teacher_forced
from models.families.eagle3.drafter import Eagle3Drafter
from models.families.eagle3.lockstep import LockstepEagle3, run_lockstep
from models.families.eagle3.model import Eagle3Draft
from train.config import LossSection

NEW = 24  # answer tokens per stored prompt
PROMPTS = 8
FIELDS = ("accepted_lengths", "accept_counts", "proposed_counts", "tree_nodes", "tokens")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, busy CPU


@pytest.fixture(scope="module")
def stored(model):
    """(refs, eos): PROMPTS prompts with the base's greedy answers, some ending early at a declared end-of-turn."""
    return lockstep_refs(model, PROMPTS, NEW)


def _fit(model, view, refs, **kw):
    """An EAGLE-3 draft that memorised the stored answers of the first half of the prompts (the rest are unseen)."""
    torch.manual_seed(0)
    draft = Eagle3Draft(view, **kw)
    prompts = [torch.tensor(r.prompt) for r in refs[: PROMPTS // 2]]
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    fit_draft(draft, [batch], view, LossSection(chunk_size=64, teacher_weight=0.0), steps=40, lr=1e-2)
    return draft.eval()


@pytest.fixture(scope="module")
def plain(model, view, stored):
    return _fit(model, view, stored[0], ttt_steps=3)


@pytest.fixture(scope="module")
def peagle(model, view, stored):
    return _fit(model, view, stored[0], ttt_steps=4, parallel_drafting=True, cod_ratio=1.0, cod_ratio_min=1.0)


def _aux(model, refs, aux_layers):
    """Each prompt's teacher-forced aux states over prompt + stored answer (the field cache's content)."""
    backend = HFBackend(model)
    with torch.inference_mode():
        return {r.id: teacher_forced(backend, torch.tensor(r.prompt + r.answer), tuple(aux_layers))
                for r in refs}


def _per_prompt(drafter, refs, tf, eos, vocab) -> dict:
    return exact_rows_with_trees(drafter, refs, lambda r: (*tf[r.id][:2], tuple(drafter.aux_layers)), eos, vocab,
                                 FIELDS, record=lambda t: (t.tokens.tolist(), t.parents.tolist(), t.depths.tolist()))


def _lockstep(drafter, refs, tf, eos, width, monkeypatch) -> dict:
    out, trees = {}, {}
    original = LockstepEagle3._verify_and_book

    def spy(self, slot, p):
        trees.setdefault(slot.ref.id, []).append((p.tokens, p.parents, p.depths))
        original(self, slot, p)

    with monkeypatch.context() as m:
        m.setattr(LockstepEagle3, "_verify_and_book", spy)
        run_lockstep(drafter, refs, lambda r: (tf[r.id][1], []), lockstep_length, eos,
                     lambda r, s: out.setdefault(r.id, {f: getattr(s, f) for f in FIELDS}), width=width)
    return {rid: {**v, "trees": trees.get(rid, [])} for rid, v in out.items()}


def _assert_same(model, drafter, refs, eos, monkeypatch, widths=(1, 3, 16)) -> dict:
    """Per prompt: the same rows (accepted lengths, counts, tree nodes, tokens) and, step by step, the same drafted
    trees (tokens, parents, depths) as the drafter's propose() in the per-prompt path."""
    tf = _aux(model, refs, drafter.aux_layers)
    want = _per_prompt(drafter, refs, tf, eos, model.config.vocab_size)
    for width in widths:  # one at a time; 3 (slots refilled as prompts end); wider than the queue
        got = _lockstep(drafter, refs, tf, eos, width, monkeypatch)
        assert sorted(got) == sorted(want)
        for rid in want:
            assert got[rid] == want[rid], (width, rid, got[rid], want[rid])
    return want


def _accepting(result: dict) -> None:
    lengths = [x for v in result.values() for x in v["accepted_lengths"]]
    assert max(lengths) >= 3 and sum(lengths) / len(lengths) > 1.5, lengths  # steps accept several drafts


@pytest.mark.parametrize("shape", [dict(mode="chain", num_speculative_tokens=4), dict(mode="tree"),
                                   dict(mode="tree", tree_topk=3, tree_depth=5, tree_nodes=10)])
def test_lockstep_equals_per_prompt(model, plain, stored, shape, monkeypatch):
    refs, eos = stored
    want = _assert_same(model, Eagle3Drafter(plain, **shape), refs, eos, monkeypatch)
    _accepting(want)
    assert want["p5"]["accepted_lengths"] == [] and len(want["p2"]["tokens"]) == 7  # the two truncations ran


def test_lockstep_equals_per_prompt_with_a_draft_vocabulary(model, view, stored, monkeypatch):
    """Draft ids map to base ids (d2t) before they enter the tree or the embedding, in both paths."""
    refs, eos = stored
    d2t = torch.tensor(sorted({t for r in refs for t in r.answer} | {3, 9, 11}))
    torch.manual_seed(2)
    draft = perturb(Eagle3Draft(with_draft_vocab(view, d2t)), 0.1).eval()
    _assert_same(model, Eagle3Drafter(draft, mode="tree", tree_topk=3, tree_depth=3, tree_nodes=12), refs, eos,
                 monkeypatch, widths=(3,))


def test_lockstep_equals_per_prompt_for_a_parallel_chain(model, peagle, stored, monkeypatch):
    """P-EAGLE: each slot's committed rows and K-1 mask slots in the one batched layer call."""
    refs, eos = stored
    chain = Eagle3Drafter(peagle, mode="chain", num_speculative_tokens=4)
    _accepting(_assert_same(model, chain, refs, eos, monkeypatch))


@pytest.mark.parametrize("shape", [dict(tree_topk=3, tree_depth=4, tree_nodes=6),
                                   dict(tree_topk=2, tree_depth=5, tree_nodes=16)], ids=["ranking", "expansion"])
def test_exact_score_ties_resolve_as_the_drafter_does(model, plain, stored, shape, monkeypatch):
    """Twin tokens: the LM head's row of each frequent answer token copied onto another token, so siblings tie
    exactly (same logit, same log-prob, same cumulative score). Then topk's order among equals, the level's
    expansion order (a stable sort: ties keep level order) and the final ranking (score, then shallower, then older)
    decide which twin is drafted, expanded and kept; lockstep must decide as the drafter does. A small tree cuts the
    final ranking inside ties; a deep narrow one keeps the nodes below the expansions that ties decided."""
    refs, eos = stored
    hot = copy.deepcopy(plain)
    counts = torch.bincount(torch.tensor([t for r in refs for t in r.answer[:NEW]]), minlength=hot.vocab_size)
    frequent = counts.argsort(descending=True)[:12].tolist()
    unused = (counts == 0).nonzero().flatten()[3:15].tolist()  # never in an answer: a twin is never accepted
    with torch.no_grad():
        for src, twin in zip(frequent, unused):
            hot.lm_head.weight[twin] = hot.lm_head.weight[src]
    drafter = Eagle3Drafter(hot.eval(), mode="tree", **shape)
    ties, original = [], drafter._top

    def spy(out, k):
        vals, toks = original(out, k)
        ties.append(int((vals[:, :-1] == vals[:, 1:]).sum()))
        return vals, toks

    drafter._top = spy
    want = _assert_same(model, drafter, refs, eos, monkeypatch, widths=(3,))
    assert sum(ties) >= 20, ties  # the twins tie in many rows, so the tie rules are exercised
    _accepting(want)


def test_run_field_rows_lockstep_equal_per_prompt_and_resume(model, plain, stored, tmp_path):
    """run_field writes the same SimRow rows with lockstep on (an EAGLE-3 drafter, width 3) as with it off; a rerun
    after a kill (rows file cut to two prompts) simulates only the missing prompts, each id once."""
    refs, eos = stored
    base = SimpleNamespace(model=model, fingerprint="tiny-lockstep", tokenizer=SimpleNamespace(eos_token_id=eos[0]))
    drafter = Eagle3Drafter(plain, mode="tree", tree_topk=3, tree_depth=4, tree_nodes=10)
    kw = dict(backend_name="hf", cache_root=tmp_path / "cache", progress=False)
    slow = run_field(drafter, refs, base, out_dir=tmp_path / "slow", lockstep=0, **kw)
    fast = run_field(drafter, refs, base, out_dir=tmp_path / "fast", lockstep=3, **kw)

    def simulated(rows):  # a batched prompt that met a near tie was redone on the exact path and says so
        return [{k: v for k, v in r.items() if k != "exact_redo"} for r in rows]  # (whether one does: the CPU's)

    assert simulated(fast) == slow  # in refs order, every field (tf_differs and new_tokens included)
    path = Path(tmp_path / "fast" / "rows-0.jsonl")
    lines = path.read_text().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == sorted(r.id for r in refs)
    path.write_text("\n".join(lines[:2]) + "\n")
    again = run_field(drafter, refs, base, out_dir=tmp_path / "fast", lockstep=3, **kw)
    assert simulated(again) == slow
    ids = [json.loads(x)["id"] for x in path.read_text().splitlines()]
    assert sorted(ids) == sorted(r.id for r in refs) and ids[:2] == [json.loads(x)["id"] for x in lines[:2]]


def test_a_batched_run_records_its_measured_agreement_and_a_defect_shows(model, plain, stored, tmp_path,
                                                                         monkeypatch):
    """After a batched run, a sample of its prompts re-decoded one at a time (measure_agreement): every step and row
    identical here, and the report's path says so in numbers. With a defect put into lockstep's chain (depth 2's
    draft replaced), the same check counts the differing steps and rows: it cannot pass by accident."""
    from eval.field.report import path_label
    from eval.field.simulation import measure_agreement

    refs, eos = stored
    base = SimpleNamespace(model=model, fingerprint="tiny-agree", tokenizer=SimpleNamespace(eos_token_id=eos[0]))
    drafter = Eagle3Drafter(plain, mode="chain", num_speculative_tokens=4)
    kw = dict(backend_name="hf", cache_root=tmp_path / "cache")
    rows = run_field(drafter, refs, base, out_dir=tmp_path / "good", lockstep=3, progress=False, **kw)
    good = measure_agreement(drafter, rows, refs, base, sample=6, **kw)
    assert good["rows"] == 6 and good["identical_rows"] == 6 and good["identical_steps"] == good["steps"] > 6
    assert good["max_set_al_diff"] == 0.0
    label = path_label({"lockstep": 3, "path": "batched", "agreement": good})
    assert f"measured agreement: {good['steps']} of {good['steps']} steps identical, 6 of 6" in label

    real = LockstepEagle3._chain

    def broken(self, slots, o_root):
        proposals = real(self, slots, o_root)
        for p in proposals:
            if len(p.tokens) > 2:
                p.tokens[2] = (p.tokens[2] + 1) % model.config.vocab_size  # depth 2 never matches now
        return proposals

    monkeypatch.setattr(LockstepEagle3, "_chain", broken)
    bad_rows = run_field(drafter, refs, base, out_dir=tmp_path / "bad", lockstep=3, progress=False, **kw)
    bad = measure_agreement(drafter, bad_rows, refs, base, sample=6, **kw)
    assert bad["identical_steps"] < bad["steps"] and bad["identical_rows"] < 6 and bad["max_set_al_diff"] > 0
