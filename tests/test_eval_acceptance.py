"""Acceptance rules: greedy / typical against slow twins and the formula, rejection sampling against
the base distribution (statistical, with a negative control that must fail)."""

from __future__ import annotations

import math

import pytest
import torch

import eval.engine.acceptance as acc
from eval.engine.acceptance import (
    greedy_accept,
    greedy_accept_reference,
    rejection_chain,
    rejection_tree,
    typical_accept,
    typical_accept_reference,
    typical_threshold,
)
from eval.engine.sampling import warp, warped_probs
from eval.engine.tree import StaticTree, Tree, chain_tree, tree_from_paths

# ---------------------------------------------------------------------------------------------------
# sampling.warp
# ---------------------------------------------------------------------------------------------------


def test_warp_temperature_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = warped_probs(logits, 0.5, 1.0)
    assert torch.allclose(p, (logits / 0.5).softmax(-1))
    full = logits.softmax(-1)  # [0.64, 0.24, 0.09, 0.03]
    kept = warped_probs(logits, 1.0, 0.7)  # 0.64 < 0.7 so the second token is needed, not the third
    assert (kept > 0).tolist() == [True, True, False, False]
    assert torch.allclose(kept[:2], full[:2] / full[:2].sum())
    assert (warped_probs(logits, 1.0, 0.01) > 0).tolist() == [True, False, False, False]
    assert warped_probs(logits, 0.0).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.isinf(warp(logits, 1.0, 0.7)[2:]).all()
    with pytest.raises(ValueError, match="top_p"):
        warp(logits, 1.0, 0.0)


# ---------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------


def _logits_with_argmax(top: list[int], vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(len(top), vocab, generator=gen)
    logits[torch.arange(len(top)), torch.tensor(top)] = 10.0
    return logits


def test_greedy_hand_example():
    tree = StaticTree(((0,), (1,), (0, 0), (1, 0))).fill(5, torch.tensor([[1, 2], [3, 4]]))
    # nodes: 0=5, 1=1, 2=2, 3=3 (child of 1), 4=3 (child of 2)
    gen = torch.Generator().manual_seed(0)
    logits = _logits_with_argmax([2, 0, 3, 0, 7], 10, gen)  # base: after 5 -> 2, after 2 -> 3, after 3 -> 7
    out = greedy_accept(tree, logits)
    assert out.path.tolist() == [0, 2, 4] and out.bonus == 7
    logits = _logits_with_argmax([9, 0, 0, 0, 0], 10, gen)  # root's argmax is no draft
    out = greedy_accept(tree, logits)
    assert out.path.tolist() == [0] and out.bonus == 9 and out.num_accepted == 0


def test_greedy_matches_reference_on_random_trees():
    gen = torch.Generator().manual_seed(1)
    vocab = 5  # small vocab: many drafts match, paths of every length occur
    lengths = set()
    for _ in range(200):
        paths = torch.randint(0, vocab, (4, 4), generator=gen)
        tree = tree_from_paths(0, paths)
        logits = torch.randn(tree.num_nodes, vocab, generator=gen)
        fast, slow = greedy_accept(tree, logits), greedy_accept_reference(tree, logits)
        assert tree.tokens[fast.path].tolist() == tree.tokens[slow.path].tolist()
        assert fast.bonus == slow.bonus
        lengths.add(fast.num_accepted)
    assert lengths == {0, 1, 2, 3, 4}


# ---------------------------------------------------------------------------------------------------
# typical
# ---------------------------------------------------------------------------------------------------


def test_typical_threshold_formula():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    h = -sum(x * math.log(x) for x in p.tolist())
    assert float(typical_threshold(p, 0.09, 0.3)) == pytest.approx(min(0.09, 0.3 * math.exp(-h)))
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01])  # low entropy: eps is the binding bound
    assert float(typical_threshold(peaked, 0.09, 0.3)) == pytest.approx(0.09)


def test_typical_accepts_exactly_by_formula():
    # Root distribution p = softmax(log probs) with T = 1: threshold = min(0.09, 0.3 e^{-H}) ~ 0.0878.
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    thr = float(typical_threshold(probs, 0.09, 0.3))
    assert 0.05 < thr < 0.12
    logits = probs.log().expand(2, 5).clone()
    for tok, accepted in [(0, True), (1, True), (2, True), (3, False), (4, False)]:
        out = typical_accept(chain_tree(0, [tok]), logits, temperature=1.0)
        assert out.num_accepted == int(accepted), tok
    # Raising eps/delta makes token 2 fail: 0.12 < min(0.2, 2.0 e^{-H}).
    out = typical_accept(chain_tree(0, [2]), logits, temperature=1.0, eps=0.2, delta=2.0)
    assert out.num_accepted == 0


def test_typical_matches_reference_and_greedy_at_t0():
    gen = torch.Generator().manual_seed(2)
    vocab = 6
    for trial in range(60):
        tree = tree_from_paths(0, torch.randint(0, vocab, (4, 3), generator=gen))
        logits = torch.randn(tree.num_nodes, vocab, generator=gen) * 2
        temp = [0.0, 0.7, 1.0, 1.5][trial % 4]
        kw = dict(temperature=temp, eps=0.09, delta=0.3)
        fast = typical_accept(tree, logits, **kw, generator=torch.Generator().manual_seed(trial))
        slow = typical_accept_reference(tree, logits, **kw, generator=torch.Generator().manual_seed(trial))
        assert fast.path.tolist() == slow.path.tolist() and fast.bonus == slow.bonus
        if temp == 0:
            g = greedy_accept(tree, logits)
            assert tree.tokens[fast.path].tolist() == tree.tokens[g.path].tolist() and fast.bonus == g.bonus


# ---------------------------------------------------------------------------------------------------
# rejection sampling: the emitted tokens must follow the base distribution
# ---------------------------------------------------------------------------------------------------

V = 4
# A toy bigram "base" P[a] = p(next | a) and a deliberately different "draft" Q[a].
P = torch.tensor([[0.1, 0.2, 0.3, 0.4],
                  [0.5, 0.1, 0.1, 0.3],
                  [0.25, 0.25, 0.25, 0.25],
                  [0.05, 0.6, 0.3, 0.05]])
Q = torch.tensor([[0.6, 0.1, 0.2, 0.1],
                  [0.1, 0.1, 0.7, 0.1],
                  [0.1, 0.6, 0.1, 0.2],
                  [0.4, 0.1, 0.1, 0.4]])
ROOT = 0
SAMPLES = 4000


def _exact_joint() -> torch.Tensor:
    """p(x1, x2 | root) of the toy base, [V, V]."""
    return P[ROOT][:, None] * P


def _draw(n: int, gen: torch.Generator, dist: torch.Tensor) -> list[int]:
    return torch.multinomial(dist, n, replacement=True, generator=gen).tolist()


def _chain_sampled(gen):
    """Depth-2 chain drafted by sampling Q; q rows recorded for rejection."""
    x1 = _draw(1, gen, Q[ROOT])[0]
    x2 = _draw(1, gen, Q[x1])[0]
    tree = Tree(torch.tensor([ROOT, x1, x2]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2]),
                draft_probs=torch.stack([Q[ROOT], Q[ROOT], Q[x1]]))
    return tree


def _tree_sampled(gen):
    """Two i.i.d. samples from Q at the root (duplicates allowed), one sampled child under each."""
    a, b = _draw(2, gen, Q[ROOT])
    ca, cb = _draw(1, gen, Q[a])[0], _draw(1, gen, Q[b])[0]
    q = torch.stack([Q[ROOT], Q[ROOT], Q[ROOT], Q[a], Q[b]])  # siblings a, b share q = Q[ROOT]
    return Tree(torch.tensor([ROOT, a, b, ca, cb]), torch.tensor([-1, 0, 0, 1, 2]),
                torch.tensor([0, 1, 1, 2, 2]), draft_probs=q)


def _tree_topk(gen):
    """Deterministic picks: top-3 of Q at the root, top-1 of Q under each (point masses, no q rows)."""
    kids = Q[ROOT].topk(3).indices.tolist()
    grand = [int(Q[k].argmax()) for k in kids]
    return Tree(torch.tensor([ROOT, *kids, *grand]), torch.tensor([-1, 0, 0, 0, 1, 2, 3]),
                torch.tensor([0, 1, 1, 1, 2, 2, 2]))


def _emit_two(make_tree, gen) -> tuple[int, int]:
    """Run speculative steps on the toy model until two tokens after ROOT are out."""
    out: list[int] = []
    root = ROOT
    while len(out) < 2:
        tree = make_tree(gen) if root == ROOT else chain_tree(root)  # later steps: plain sampling
        res = rejection_tree(tree, P[tree.tokens], gen)
        out += tree.tokens[res.path[1:]].tolist() + [res.bonus]
        root = out[-1]
    return out[0], out[1]


def _tv_to_base(make_tree, seed: int, samples: int = SAMPLES) -> float:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(samples):
        a, b = _emit_two(make_tree, gen)
        counts[a, b] += 1
    return 0.5 * float((counts / samples - _exact_joint()).abs().sum())


# E[TV] of an exact sampler is <= 0.5 * sqrt(cells / n) = 0.032 here; the wrong rules below sit far above.
TV_BOUND = 0.045


@pytest.mark.parametrize("make_tree", [_chain_sampled, _tree_sampled, _tree_topk])
def test_rejection_sampling_reproduces_base_distribution(make_tree):
    assert _tv_to_base(make_tree, seed=0) < TV_BOUND


def _wrong_accept_one(r, x, q, generator):
    """A classic bug: on rejection resample from the target itself instead of the residual."""
    u = acc.uniform(generator, r.device)
    ratio = float(r[x]) if q is None else float(r[x]) / float(q[x])
    return u < ratio, r


@pytest.mark.parametrize("make_tree", [_chain_sampled, _tree_sampled, _tree_topk])
def test_wrong_residual_fails_the_same_check(make_tree, monkeypatch):
    monkeypatch.setattr(acc, "_accept_one", _wrong_accept_one)
    # The bias (TV ~0.12-0.18) is large, so fewer samples suffice; sampling noise only adds to TV.
    assert _tv_to_base(make_tree, seed=0, samples=1500) > TV_BOUND


def test_rejection_chain_reference_reproduces_base_distribution():
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(V, V)
    for _ in range(SAMPLES):
        tree = _chain_sampled(gen)
        n, bonus = rejection_chain(tree.tokens[1:], P[tree.tokens], tree.draft_probs[1:], gen)
        out = tree.tokens[1 : 1 + n].tolist() + [bonus]
        if len(out) < 2:
            out.append(_draw(1, gen, P[out[0]])[0])
        counts[out[0], out[1]] += 1
    assert 0.5 * float((counts / SAMPLES - _exact_joint()).abs().sum()) < TV_BOUND


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_tree_equals_chain_twin_on_chains(with_q):
    vocab = 7
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        k = int(torch.randint(0, 4, (1,), generator=g))
        drafts = torch.randint(0, vocab, (k,), generator=g)
        p = torch.rand(k + 1, vocab, generator=g).softmax(-1)
        q = torch.rand(k, vocab, generator=g).softmax(-1) if with_q else None
        tree = chain_tree(1, drafts)
        if with_q:
            tree.draft_probs = torch.cat([torch.zeros(1, vocab), q])
        a = rejection_tree(tree, p, torch.Generator().manual_seed(100 + seed))
        n, bonus = rejection_chain(drafts, p, q, torch.Generator().manual_seed(100 + seed))
        assert (a.num_accepted, a.bonus) == (n, bonus)


def test_rejection_rejects_impossible_draft():
    tree = chain_tree(0, [2])
    tree.draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    with pytest.raises(ValueError, match="q\\(x\\) = 0"):
        rejection_tree(tree, torch.full((2, 3), 1 / 3), torch.Generator().manual_seed(0))
