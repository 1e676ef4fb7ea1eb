"""The field benchmark's batched path for the block families (DFlash, DSpark, Domino: their lockstep.py, on
eval/engine/drafters/block_lockstep.py and static.run_static_lockstep) against its slow twin, the per-prompt path
(eval/field/simulation.py: simulate = the unchanged decoder loop against a ReplayBackend), on the tiny base: per
prompt and step the same accepted lengths, accept / proposed counts per depth, tree nodes, tokens and drafted trees,
for every shape the families draft (DFlash's chain and static trees, DSpark's and Domino's full and shorter chains,
DSpark's confidence cut), with a draft vocabulary; run_field writes the same rows either way, and a near tie (twin
LM-head rows: exact ties) hands its prompt to the exact path. Drafts are fitted briefly on the base's greedy
continuations, so steps accept several tokens (equal 1s would prove nothing).

Lockstep is not bitwise by construction (a row of a batched product may differ from the one-block product in the
last bits; near ties are redone exactly); on the tiny base the two paths agree exactly, which is what these tests
assert."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import fit_draft
from helpers.block_families import FAMILIES
from helpers.drafts import greedy_continuation_batch
from helpers.stored_answers import exact_rows_with_trees, lockstep_refs, static_lockstep_rows

from eval.engine.backends.hf import HFBackend
from eval.engine.drafters import static
from eval.engine.tree import STATIC_TREES, StaticTree, chain_choices
from eval.field.simulation import run_field, teacher_forced
from models.families.dflash.drafter import DFlashDrafter
from models.families.dflash.lockstep import run_lockstep as dflash_lockstep
from models.families.domino.lockstep import run_lockstep as domino_lockstep
from models.families.dspark.drafter import DSparkDrafter
from models.families.dspark.lockstep import run_lockstep as dspark_lockstep

NEW = 24  # answer tokens per stored prompt
PROMPTS = 8
BLOCK = 5  # slots per block: DFlash drafts 4 (tree16 fits), DSpark and Domino 5
FIELDS = ("accepted_lengths", "accept_counts", "proposed_counts", "tree_nodes", "tokens")
RUN = {"dflash": dflash_lockstep, "dspark": dspark_lockstep, "domino": domino_lockstep}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, busy CPU


@pytest.fixture(scope="module")
def stored(model):
    """(refs, eos): PROMPTS prompts with the base's greedy answers, some ending early at a declared end-of-turn."""
    return lockstep_refs(model, PROMPTS, NEW)


def _fit(model, view, refs, name):
    """A block draft (2 layers, blocks of BLOCK) that memorised the stored answers of the first half of the prompts
    (the rest are unseen)."""
    family = FAMILIES[name]
    torch.manual_seed(0)
    draft = family.draft_cls(view, num_layers=2, block_size=BLOCK, num_anchors=64, **family.memorise)
    prompts = [torch.tensor(r.prompt) for r in refs[: PROMPTS // 2]]
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    fit_draft(draft, [batch], view, family.loss(position_weights="decay"), steps=30, lr=2e-2)
    return draft.eval()


@pytest.fixture(scope="module")
def drafts(model, view, stored):
    """name -> its fitted draft, built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _fit(model, view, stored[0], name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def aux(model, stored):
    """Each prompt's teacher-forced (hidden, aux states) over prompt + stored answer (the field cache's content), per
    aux layers."""
    backend, out = HFBackend(model), {}

    def get(layers):
        key = tuple(layers)
        if key not in out:
            with torch.inference_mode():
                out[key] = {r.id: teacher_forced(backend, torch.tensor(r.prompt + r.answer), key)[:2]
                            for r in stored[0]}
        return out[key]

    return get


def _drafter(draft, shape: dict):
    """The family's drafter of `shape` (DFlash: tree=<static tree name> or num_speculative_tokens; the chain
    families: their options)."""
    if draft.facts.name == "dflash":
        tree = STATIC_TREES[shape["tree"]] if "tree" in shape else chain_choices(shape.get("num_speculative_tokens",
                                                                                           BLOCK - 1))
        return DFlashDrafter(draft, StaticTree(tree))
    return FAMILIES[draft.facts.name].drafter_cls(draft, **shape)


def _per_prompt(drafter, refs, tf, eos, vocab) -> dict:
    return exact_rows_with_trees(drafter, refs, lambda r: (*tf[r.id], tuple(drafter.aux_layers)), eos, vocab, FIELDS)


def _lockstep(drafter, refs, tf, eos, width, monkeypatch) -> tuple[dict, list[str]]:
    """(id -> the batched path's row and drafted trees, the ids it handed to the exact path: near ties)."""
    redone = []
    rows = static_lockstep_rows(RUN[drafter.name], drafter, refs, lambda r: (tf[r.id][1], []), eos, width,
                                monkeypatch, FIELDS, redo=lambda r: redone.append(r.id))
    return rows, redone


def _assert_same(model, drafter, refs, tf, eos, monkeypatch, widths=(1, 3, 16), ties: bool = False) -> dict:
    """Per prompt: the same rows (accepted lengths, counts, tree nodes, tokens) and, step by step, the same drafted
    trees as the drafter's propose() in the per-prompt path. ties: a random draft's rows may meet near ties: one the
    stored token is in hands its prompt to the exact path (not compared here: a minority), one between tokens the
    answer does not hold stays batched and may order them otherwise (block_lockstep.stored_ties), so only the rows
    are compared, not the trees; else neither may happen."""
    want = _per_prompt(drafter, refs, tf, eos, model.config.vocab_size)
    for width in widths:  # one at a time; 3 (slots refilled as prompts end); wider than the queue
        got, redone = _lockstep(drafter, refs, tf, eos, width, monkeypatch)
        assert sorted([*got, *redone]) == sorted(want)
        assert len(redone) <= len(want) // 4 if ties else not redone, redone
        for rid in got:
            fields = FIELDS if ties else (*FIELDS, "trees")
            assert [got[rid][f] for f in fields] == [want[rid][f] for f in fields], (width, rid, got[rid], want[rid])
    return want


def _accepting(result: dict) -> None:
    lengths = [x for v in result.values() for x in v["accepted_lengths"]]
    assert max(lengths) >= 3 and sum(lengths) / len(lengths) > 1.3, lengths  # steps accept several drafts


SHAPES = [("dflash", {}), ("dflash", {"num_speculative_tokens": 2}), ("dflash", {"tree": "tree16"}),
          ("dflash", {"tree": "wide2"}), ("dspark", {}), ("dspark", {"num_speculative_tokens": 2}),
          ("domino", {}), ("domino", {"num_speculative_tokens": 3})]


@pytest.mark.parametrize("name, shape", SHAPES, ids=[f"{n}-{'-'.join(map(str, s.values())) or 'full'}"
                                                     for n, s in SHAPES])
def test_lockstep_equals_per_prompt(model, stored, drafts, aux, name, shape, monkeypatch):
    refs, eos = stored
    draft = drafts(name)
    want = _assert_same(model, _drafter(draft, shape), refs, aux(draft.aux_layers), eos, monkeypatch)
    _accepting(want)
    assert want["p5"]["accepted_lengths"] == [] and len(want["p2"]["tokens"]) == 7  # the two truncations ran


@pytest.fixture(scope="module")
def products(model, stored, drafts, aux):
    """The fitted DSpark's products of confidences c_1..c_k at every depth of every step of the exact path (no cut),
    sorted, distinct: where a cut decides chain lengths."""
    refs, eos = stored
    draft = drafts("dspark")
    plain, out = DSparkDrafter(draft), []
    original = plain.propose

    def spy(state):
        tree = original(state)
        out.append(torch.cumprod(plain.last_confidence.float(), dim=0))
        return tree

    plain.propose = spy
    full = _per_prompt(plain, refs, aux(draft.aux_layers), eos, model.config.vocab_size)
    assert all(len(t) == BLOCK + 1 for v in full.values() for t in v["trees"])
    return torch.cat(out).unique()


def test_lockstep_equals_per_prompt_under_a_confidence_cut(model, stored, drafts, aux, products, monkeypatch):
    """DSpark's confidence cut: each step's chain as long as the product of its confidences stays above the cut, in
    both paths. The cut lies halfway across the widest gap between two adjacent products in their middle half: chains
    of several lengths occur (so it decides something) and no product lies within the near-tie margin of it."""
    refs, eos = stored
    draft = drafts("dspark")
    lo, hi = len(products) // 4, 3 * len(products) // 4
    gaps = products[lo + 1:hi + 1] - products[lo:hi]
    i = lo + int(gaps.argmax())
    assert float(gaps.max()) > 4 * static.TIE_EPS
    drafter = DSparkDrafter(draft, confidence_cut=float(products[i] + products[i + 1]) / 2)
    want = _assert_same(model, drafter, refs, aux(draft.aux_layers), eos, monkeypatch, widths=(3,))
    lengths = {len(t) for v in want.values() for t in v["trees"]}
    assert len(lengths) >= 3, lengths


def test_a_cut_at_a_product_hands_the_prompt_to_the_exact_path(model, stored, drafts, aux, products, monkeypatch):
    """A cut equal to a product of confidences some step meets (the median one): whether that chain keeps the depth is
    a comparison of equals, a near tie, so that prompt is handed to the exact path; the others stay batched and equal
    the exact path's rows."""
    refs, eos = stored
    draft = drafts("dspark")
    drafter = DSparkDrafter(draft, confidence_cut=float(products[len(products) // 2]))
    tf = aux(draft.aux_layers)
    want = _per_prompt(drafter, refs, tf, eos, model.config.vocab_size)
    got, redone = _lockstep(drafter, refs, tf, eos, 3, monkeypatch)
    assert 0 < len(redone) < len(refs) and sorted([*got, *redone]) == sorted(want), redone
    assert all(got[rid] == want[rid] for rid in got)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lockstep_with_a_draft_vocabulary(model, view, stored, aux, name, monkeypatch):
    """Draft ids map to base ids (d2t) before they enter the tree or the next slot's Markov / GRU input, in both
    paths (a random draft over the answers' tokens)."""
    refs, eos = stored
    d2t = torch.tensor(sorted({t for r in refs for t in r.answer} | {3, 9, 11}))
    draft = FAMILIES[name].draft(view, seed=2, d2t=d2t, block_size=BLOCK, std=0.1)
    drafter = _drafter(draft, {"tree": "tree16"} if name == "dflash" else {})
    _assert_same(model, drafter, refs, aux(draft.aux_layers), eos, monkeypatch, widths=(3,), ties=True)


def _base(model, eos, name):
    return SimpleNamespace(model=model, fingerprint=name, tokenizer=SimpleNamespace(eos_token_id=eos[0]))


def _simulated(rows):  # a batched prompt that met a near tie was redone on the exact path and says so
    return [{k: v for k, v in r.items() if k != "exact_redo"} for r in rows]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_run_field_rows_lockstep_equal_per_prompt(model, stored, drafts, name, tmp_path):
    """run_field finds the family's batched path (its lockstep role module) and writes the same SimRow rows with
    lockstep on (width 3) as with it off."""
    from eval.field.simulation import uses_lockstep

    refs, eos = stored
    drafter = _drafter(drafts(name), {})
    assert uses_lockstep(drafter, 3) and not uses_lockstep(drafter, 0)
    kw = dict(backend_name="hf", cache_root=tmp_path / "cache", progress=False)
    base = _base(model, eos, f"tiny-{name}-lockstep")
    slow = run_field(drafter, refs, base, out_dir=tmp_path / "slow", lockstep=0, **kw)
    fast = run_field(drafter, refs, base, out_dir=tmp_path / "fast", lockstep=3, **kw)
    assert not any(r.get("exact_redo") for r in fast)
    assert _simulated(fast) == slow


def _twin(draft, refs, scale: float = 1.0, twins: int = 1):
    """A copy of `draft` in which `twins` unused tokens' rows of every head that scores a token (the LM head;
    DSpark's Markov W2, Domino's W_out) are the most frequent answer token's times `scale` (its logit times scale):
    scale 1, where it is among the ranks a row gives, it and its twin tie exactly; scale 2 and two twins, the twins
    tie with each other, above it wherever its logit is positive."""
    twin = copy.deepcopy(draft)
    counts = torch.bincount(torch.tensor([t for r in refs for t in r.answer[:NEW]]), minlength=twin.vocab_size)
    src, unused = int(counts.argmax()), (counts == 0).nonzero().flatten()[3:3 + twins].tolist()
    heads = [twin.lm_head.weight]
    if hasattr(twin, "markov_head"):
        heads.append(twin.markov_head.markov_w2.weight)
    if hasattr(twin, "correction"):
        heads.append(twin.correction.embed_proj[2].weight)
    with torch.no_grad():
        for w in heads:
            for dst in unused:
                w[dst] = w[src] * scale
    return twin.eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_near_tie_hands_the_prompt_to_the_exact_path(model, stored, drafts, name, tmp_path):
    """Twin tokens (exact ties): the prompts whose drafts met them are flagged and redone one at a time (marked
    exact_redo), the others stay batched; every row equals the exact path's."""
    refs, eos = stored
    drafter = _drafter(_twin(drafts(name), refs), {"tree": "tree16"} if name == "dflash" else {})
    kw = dict(backend_name="hf", cache_root=tmp_path / "cache", progress=False)
    base = _base(model, eos, f"tiny-{name}-ties")
    slow = run_field(drafter, refs, base, out_dir=tmp_path / "slow", lockstep=0, **kw)
    fast = run_field(drafter, refs, base, out_dir=tmp_path / "fast", lockstep=3, **kw)
    redone = [r["id"] for r in fast if r.get("exact_redo")]
    assert 0 < len(redone) < len(fast), redone  # some prompts met the twins, the others stayed batched
    assert _simulated(fast) == slow


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_tie_the_answer_is_not_in_stays_batched(model, stored, drafts, name, tmp_path):
    """Two twin tokens no answer holds, tied exactly above the most frequent answer token: where they lead a row,
    which of them is drafted is the order of equals, but either misses, so what is booked cannot change
    (block_lockstep.stored_ties): no prompt is redone and every row equals the exact path's. The twins are drafted
    (the acceptance drops), so the ties were met."""
    refs, eos = stored
    shape = {"tree": "tree16"} if name == "dflash" else {}
    kw = dict(backend_name="hf", cache_root=tmp_path / "cache", progress=False)
    base = _base(model, eos, f"tiny-{name}-unheld-ties")
    plain = run_field(_drafter(drafts(name), shape), refs, base, out_dir=tmp_path / "plain", lockstep=0, **kw)
    drafter = _drafter(_twin(drafts(name), refs, scale=2.0, twins=2), shape)
    slow = run_field(drafter, refs, base, out_dir=tmp_path / "slow", lockstep=0, **kw)
    fast = run_field(drafter, refs, base, out_dir=tmp_path / "fast", lockstep=3, **kw)
    assert sum(map(sum, (r["accept_lengths"] for r in slow))) < sum(map(sum, (r["accept_lengths"] for r in plain)))
    assert not any(r.get("exact_redo") for r in fast) and fast == slow


def test_stored_ties_only_count_ties_the_stored_token_is_in():
    """Per row: flagged when another logit lies within TIE_EPS of the stored token's and either is among the ranks
    the row gives (width); not for a tie between two other tokens, one below the ranks taken, or no stored token."""
    from eval.engine.drafters.block_lockstep import stored_ties

    logits = torch.tensor([[5.0, 5.0, 1.0, 0.0]] * 2 + [[5.0, 4.0, 3.0, 3.0]] * 2)[:, None]  # [4, 1, 4]
    stored = torch.tensor([[0], [2], [3], [-1]])
    assert stored_ties(logits, stored, torch.tensor([1])).tolist() == [True, False, False, False]
    assert stored_ties(logits, stored, torch.tensor([3])).tolist() == [True, False, True, False]


def test_stored_drafts_are_the_tokens_after_the_root_in_draft_ids():
    """Depth k of a step after L committed positions is verified against seq[L + k] (the root is seq[L]): as a draft
    id through t2d (-1 outside the draft vocabulary), -1 past the stored sequence."""
    from eval.engine.drafters.block_lockstep import stored_drafts

    seq = [10, 11, 12, 13, 14, 15]
    slots = [SimpleNamespace(seq=seq, length=2), SimpleNamespace(seq=seq, length=4)]
    full = SimpleNamespace(draft=SimpleNamespace(t2d=None), _device="cpu")
    assert stored_drafts(full, slots, 3).tolist() == [[13, 14, 15], [15, -1, -1]]
    t2d = torch.full((20,), -1)
    t2d[[13, 15]] = torch.tensor([0, 1])
    mapped = SimpleNamespace(draft=SimpleNamespace(t2d=t2d), _device="cpu")
    assert stored_drafts(mapped, slots, 3).tolist() == [[0, -1, 1], [1, -1, -1]]
