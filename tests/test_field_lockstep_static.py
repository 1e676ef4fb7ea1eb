"""The field benchmark's batched path for the static-tree families (Hydra / Hydra++ and Medusa: their lockstep.py,
on eval/engine/drafters/static.py's run_static_lockstep) against its slow twin, the per-prompt path
(eval/field/simulation.py: simulate = the unchanged decoder loop against a ReplayBackend), on the tiny base: per
prompt and step the same accepted lengths, accept / proposed counts per depth, tree nodes, tokens and drafted trees,
for the chain of 4 and the 16-node tree, Hydra, Hydra++ (the prefix layer) and Medusa, and with a draft vocabulary;
run_field writes the same rows either way, and a near tie (twin LM-head rows: exact ties among the ranks a tree
takes) hands its prompt to the exact path. Drafts are fitted briefly on the base's greedy continuations, so steps
accept several tokens (equal 1s would prove nothing).

Lockstep is not bitwise by construction (a row of a batched product may differ from the few-row product in the last
bits; near ties are redone exactly); on the tiny base the two paths agree exactly, which is what these tests assert.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import fit_draft
from helpers.drafts import greedy_continuation_batch, perturb, with_draft_vocab
from helpers.stored_answers import exact_rows_with_trees, lockstep_refs, static_lockstep_rows

from eval.engine.backends.hf import HFBackend
from eval.engine.drafters import static
from eval.engine.tree import STATIC_TREES, StaticTree
from eval.field.simulation import run_field, teacher_forced
from models.families.hydra.drafter import HydraDrafter
from models.families.hydra.lockstep import run_lockstep as hydra_lockstep
from models.families.hydra.model import HydraDraft
from models.families.medusa.drafter import MedusaDrafter
from models.families.medusa.lockstep import run_lockstep as medusa_lockstep
from models.families.medusa.model import MedusaDraft
from train.config import LossSection

NEW = 24  # answer tokens per stored prompt
PROMPTS = 8
FIELDS = ("accepted_lengths", "accept_counts", "proposed_counts", "tree_nodes", "tokens")
SHAPES = ("chain4", "tree16")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, busy CPU


@pytest.fixture(scope="module")
def stored(model):
    """(refs, eos): PROMPTS prompts with the base's greedy answers, some ending early at a declared end-of-turn."""
    return lockstep_refs(model, PROMPTS, NEW)


@pytest.fixture(scope="module")
def hidden(model, stored):
    """Each prompt's teacher-forced hidden states over prompt + stored answer (the field cache's content)."""
    backend = HFBackend(model)
    with torch.inference_mode():
        return {r.id: teacher_forced(backend, torch.tensor(r.prompt + r.answer), ())[0] for r in stored[0]}


def _fit(model, view, refs, cls=HydraDraft, **kw):
    """A draft (Hydra, Medusa) that memorised the stored answers of the first half of the prompts (the rest are
    unseen)."""
    torch.manual_seed(0)
    draft = perturb(cls(4, base=view, **kw), 0.02)
    prompts = [torch.tensor(r.prompt) for r in refs[: PROMPTS // 2]]
    batch = greedy_continuation_batch(model, prompts, (1,), NEW + 6)  # its aux rows go unread
    fit_draft(draft, [batch], view, LossSection(chunk_size=64, teacher_weight=0.0), steps=40, lr=1e-2)
    return draft.eval()


@pytest.fixture(scope="module")
def hydra(model, view, stored):
    return _fit(model, view, stored[0], num_layers=1)


@pytest.fixture(scope="module")
def hydra_pp(model, view, stored):
    return _fit(model, view, stored[0], num_layers=2, prefix_layer=True)


@pytest.fixture(scope="module")
def medusa(model, view, stored):
    return _fit(model, view, stored[0], MedusaDraft, num_layers=1)


# family -> (its drafter class, its batched path)
FAMILY = {"hydra": (HydraDrafter, hydra_lockstep), "hydra_pp": (HydraDrafter, hydra_lockstep),
          "medusa": (MedusaDrafter, medusa_lockstep)}


def _per_prompt(drafter, refs, hidden, eos, vocab) -> dict:
    return exact_rows_with_trees(drafter, refs, lambda r: (hidden[r.id], None, ()), eos, vocab, FIELDS)


def _lockstep(run, drafter, refs, hidden, eos, width, monkeypatch) -> dict:
    return static_lockstep_rows(run, drafter, refs, lambda r: (hidden[r.id], []), eos, width, monkeypatch, FIELDS)


def _assert_same(run, model, drafter, refs, hidden, eos, monkeypatch, widths=(1, 3, 16)) -> dict:
    """Per prompt: the same rows (accepted lengths, counts, tree nodes, tokens) and, step by step, the same drafted
    trees as the drafter's propose() in the per-prompt path."""
    want = _per_prompt(drafter, refs, hidden, eos, model.config.vocab_size)
    for width in widths:  # one at a time; 3 (slots refilled as prompts end); wider than the queue
        got = _lockstep(run, drafter, refs, hidden, eos, width, monkeypatch)
        assert sorted(got) == sorted(want)
        for rid in want:
            assert got[rid] == want[rid], (width, rid, got[rid], want[rid])
    return want


def _accepting(result: dict) -> None:
    lengths = [x for v in result.values() for x in v["accepted_lengths"]]
    assert max(lengths) >= 3 and sum(lengths) / len(lengths) > 1.5, lengths  # steps accept several drafts


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("which", ["hydra", "hydra_pp", "medusa"])
def test_lockstep_equals_per_prompt(model, stored, hidden, shape, which, request, monkeypatch):
    refs, eos = stored
    cls, run = FAMILY[which]
    drafter = cls(request.getfixturevalue(which), StaticTree(STATIC_TREES[shape]))
    want = _assert_same(run, model, drafter, refs, hidden, eos, monkeypatch)
    _accepting(want)
    assert want["p5"]["accepted_lengths"] == [] and len(want["p2"]["tokens"]) == 7  # the two truncations ran


@pytest.mark.parametrize("which", ["hydra", "medusa"])
def test_lockstep_with_a_draft_vocabulary(model, view, stored, hidden, which, monkeypatch):
    """Draft ids map to base ids (d2t) before they enter the tree (or, Hydra, a child's path), in both paths."""
    refs, eos = stored
    d2t = torch.tensor(sorted({t for r in refs for t in r.answer} | {3, 9, 11}))
    torch.manual_seed(2)
    cls, run = FAMILY[which]
    draft = perturb((HydraDraft if which == "hydra" else MedusaDraft)(4, 1, with_draft_vocab(view, d2t)), 0.1).eval()
    _assert_same(run, model, cls(draft, StaticTree(STATIC_TREES["tree16"])), refs, hidden, eos, monkeypatch,
                 widths=(3,))


def _base(model, eos, name):
    return SimpleNamespace(model=model, fingerprint=name, tokenizer=SimpleNamespace(eos_token_id=eos[0]))


@pytest.mark.parametrize("which", ["hydra_pp", "medusa"])
def test_run_field_rows_lockstep_equal_per_prompt(model, stored, which, request, tmp_path):
    """run_field writes the same SimRow rows with lockstep on (width 3) as with it off."""
    refs, eos = stored
    drafter = FAMILY[which][0](request.getfixturevalue(which), StaticTree(STATIC_TREES["tree16"]))
    kw = dict(backend_name="hf", cache_root=tmp_path / "cache", progress=False)
    base = _base(model, eos, f"tiny-{which}-lockstep")
    slow = run_field(drafter, refs, base, out_dir=tmp_path / "slow", lockstep=0, **kw)
    fast = run_field(drafter, refs, base, out_dir=tmp_path / "fast", lockstep=3, **kw)
    assert [{k: v for k, v in r.items() if k != "exact_redo"} for r in fast] == slow


@pytest.mark.parametrize("which", ["hydra", "medusa"])
def test_a_near_tie_hands_the_prompt_to_the_exact_path(model, stored, which, request, tmp_path):
    """A twin token: the LM-head row of the most frequent answer token copied onto an unused one in every head, so
    where both are among the ranks a row gives they tie exactly and which twin a node gets is the order of equals
    (topk's, which may differ between a 1-row and a B-row call). Those prompts are flagged (near_ties) and redone one
    at a time (marked exact_redo), the others stay batched: every row equals the exact path's."""
    refs, eos = stored
    twin = copy.deepcopy(request.getfixturevalue(which))
    counts = torch.bincount(torch.tensor([t for r in refs for t in r.answer[:NEW]]), minlength=twin.vocab_size)
    src, dst = int(counts.argmax()), int((counts == 0).nonzero().flatten()[3])
    with torch.no_grad():
        for k in range(1, twin.num_heads + 1):
            twin.head_weight(k)[dst] = twin.head_weight(k)[src]
    drafter = FAMILY[which][0](twin.eval(), StaticTree(STATIC_TREES["tree16"]))
    kw = dict(backend_name="hf", cache_root=tmp_path / "cache", progress=False)
    base = _base(model, eos, f"tiny-{which}-ties")
    slow = run_field(drafter, refs, base, out_dir=tmp_path / "slow", lockstep=0, **kw)
    fast = run_field(drafter, refs, base, out_dir=tmp_path / "fast", lockstep=3, **kw)
    redone = [r["id"] for r in fast if r.get("exact_redo")]
    assert 0 < len(redone) < len(fast), redone  # some prompts met the twins, the others stayed batched
    assert [{k: v for k, v in r.items() if k != "exact_redo"} for r in fast] == slow


def test_near_ties_only_counts_the_ranks_a_row_gives():
    logits = torch.tensor([[5.0, 5.0, 1.0, 0.0], [5.0, 4.0, 3.0, 3.0], [5.0, 4.0, 3.0, 3.0]])
    got = static.near_ties(logits, torch.tensor([1, 2, 3]))
    assert got.tolist() == [True, False, True]  # row 1 takes ranks 0-1: the tie at ranks 2-3 decides nothing
