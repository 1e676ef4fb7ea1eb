"""CTC drafter at inference: the collapse (hand cases, tensor == reference), depths after collapse, trees
from collapsed candidates, raw-candidate sets, the attention KV cache, and greedy losslessness through
the common verifier (random CTC drafts, and an oracle with blanks and repeats that must be accepted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState
from eval.engine.drafters.registry import build_drafter
from eval.engine.tree import tree_from_paths
from eval.harness.config import EvalConfig
from models.draft import BaseView
from models.families.ctc.drafter import (
    CTCDrafter,
    ctc_collapse,
    ctc_collapse_reference,
    default_raw_choices,
    joint_top_paths,
    joint_top_paths_reference,
)
from models.families.ctc.model import CTCDraft

B = 99  # blank in the hand cases
VOCAB = 320
NEW = 20


def test_collapse_hand_cases():
    raw = torch.tensor([
        [1, 1, B, 2, 2, 2],  # repeats merge, blank dropped
        [B, B, B, B, B, B],  # all blank: empty candidate
        [4, B, 4, 4, B, 4],  # a real repeat separated by a blank survives: 4 4 4
        [5, 6, 5, 6, 5, 6],  # nothing to remove
        [B, 7, 7, 7, 7, 7],
    ])
    want = torch.tensor([
        [1, 2, -1, -1, -1, -1],
        [-1, -1, -1, -1, -1, -1],
        [4, 4, 4, -1, -1, -1],
        [5, 6, 5, 6, 5, 6],
        [7, -1, -1, -1, -1, -1],
    ])
    assert torch.equal(ctc_collapse(raw, B), want)
    assert torch.equal(ctc_collapse_reference(raw, B), want)


def test_collapse_matches_reference_on_random_frames():
    g = torch.Generator().manual_seed(0)
    for m in (1, 3, 6):
        raw = torch.randint(0, 4, (200, m), generator=g)  # blank = 3, tokens 0..2: many repeats
        assert torch.equal(ctc_collapse(raw, 3), ctc_collapse_reference(raw, 3))


def test_kept_tokens_get_their_depth_after_collapse_and_removed_ones_never_enter_the_tree():
    root = 40
    raw = torch.tensor([[5, 5, B, 7, B, 9]])
    tree = tree_from_paths(root, ctc_collapse(raw, B))
    assert tree.tokens.tolist() == [root, 5, 7, 9]  # no blank, no second 5
    assert tree.depths.tolist() == [0, 1, 2, 3]  # position = cache_len + index after collapse + 1: no gap
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    # The collapse is over frames only: a first frame equal to the root is a real draft of x_{t+2}.
    again = tree_from_paths(root, ctc_collapse(torch.tensor([[root, root, 3, B, B, B]]), B))
    assert again.tokens.tolist() == [root, root, 3] and again.depths.tolist() == [0, 1, 2]


def test_tree_from_collapsed_candidates_dedupes_prefixes():
    raw = torch.tensor([
        [5, 5, 7, B],  # -> 5 7
        [5, B, 7, 7],  # -> 5 7 (same path)
        [5, 7, 8, 8],  # -> 5 7 8 (extends it)
        [B, B, B, B],  # -> nothing
        [6, B, B, 7],  # -> 6 7 (new branch at depth 1)
    ])
    tree = tree_from_paths(0, ctc_collapse(raw, B))
    assert tree.tokens.tolist() == [0, 5, 7, 8, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    assert tree.depths.tolist() == [0, 1, 2, 3, 1, 2]


def test_default_raw_choices():
    choices = default_raw_choices(6, num_paths=24, topk=4)
    assert len(choices) == 24 and len(set(choices)) == 24
    assert choices[0] == (0,) * 6 and all(len(c) == 6 and max(c) < 4 for c in choices)
    costs = [sum(c) for c in choices]
    assert costs == sorted(costs)
    assert choices[1] == (1, 0, 0, 0, 0, 0)  # earlier frames deviate first


def test_joint_top_paths_match_enumeration():
    g = torch.Generator().manual_seed(3)
    log_probs = torch.log_softmax(torch.randn(4, 9, generator=g), -1)
    for paths, k in ((1, 3), (10, 3), (81, 3), (7, 9)):
        assert torch.equal(joint_top_paths(log_probs, paths, k), joint_top_paths_reference(log_probs, paths, k))


def _random_ctc_draft(model, seed: int, frames: int = 6) -> CTCDraft:
    torch.manual_seed(seed)
    draft = CTCDraft(frames, 4, 1, BaseView.from_model(model))
    with torch.no_grad():  # random, confident-ish frames, blank included, so collapses vary
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return draft.eval()


def test_attention_cache_matches_full_forward(model):
    draft = _random_ctc_draft(model, 1)
    drafter = CTCDrafter(draft, search="joint", num_paths=5, topk=3, max_len=2)  # cache must grow
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(13, 64, generator=g)
    ids = torch.randint(3, VOCAB, (13,), generator=g)
    drafter.reset()
    for lo, hi in ((0, 9), (9, 10), (10, 13)):
        tree = drafter.propose(DecodeState(ids[:hi], 7, hidden[lo:hi], ids[lo:hi]))
        with torch.no_grad():
            z = draft.attn(hidden[None, :hi])[0, -1:]
            lp = torch.log_softmax(draft.frame_logits(z)[0].float(), -1)
        want = tree_from_paths(7, ctc_collapse(joint_top_paths(lp, 5, 3), draft.blank))
        assert torch.equal(tree.tokens, want.tokens) and torch.equal(tree.parents, want.parents)


@pytest.mark.parametrize("search", ["static", "joint"])
def test_greedy_lossless_with_random_ctc_drafts(model, search):
    be = HFBackend(model)
    draft = _random_ctc_draft(model, 2)
    drafter = CTCDrafter(draft, search=search, num_paths=6, topk=2)
    g = torch.Generator().manual_seed(5)
    for n in (6, 11):
        prompt = torch.randint(3, VOCAB, (n,), generator=g)
        want = autoregressive_generate(be, prompt, max_new_tokens=12, eos_ids=None).tokens
        res = speculative_generate(be, drafter, prompt, max_new_tokens=12, eos_ids=None)
        assert res.tokens == want
        assert res.tree_nodes > 2 * res.base_steps  # real trees were verified, not just roots


class _CountingAttn:
    """Stands in for the attention module: counts committed rows, so the oracle knows where it is."""

    def new_cache(self, max_len, device, dtype):
        return {"length": 0}

    def step(self, cache, new_hidden):
        cache["length"] += new_hidden.shape[0]
        self.length = cache["length"]
        return new_hidden


class _OracleCTC(nn.Module):
    """Frames spell the true next tokens with repeats and blanks: pattern entry j > 0 = the depth-j token
    (x_{t+1+j}), 0 = blank. After collapse the candidate is exactly the true continuation."""

    def __init__(self, reference: list[int], pattern: list[int]):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))
        self.attn, self.ref, self.pattern = _CountingAttn(), reference, pattern
        self.num_frames, self.blank = len(pattern), VOCAB

    def frame_logits(self, z):
        n = self.attn.length  # committed tokens; the root is ref[n]
        logits = torch.full((1, self.num_frames, VOCAB + 1), -10.0)
        for m, depth in enumerate(self.pattern):
            logits[0, m, self.blank if depth == 0 else self.ref[n + depth]] = 10.0
        return logits


def test_oracle_frames_with_blanks_and_repeats_are_fully_accepted(model):
    """Positions after collapse are right: a collapsed 3-token oracle is accepted every step (a RoPE gap
    from frame positions would change the base's logits at the drafted nodes and reject them)."""
    be = HFBackend(model)
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = model.generate(prompt[None], max_new_tokens=NEW + 8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0].tolist()
    drafter = CTCDrafter(_OracleCTC(ref, [1, 1, 0, 2, 0, 3]), num_paths=8, topk=2)
    res = speculative_generate(be, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
    assert res.tokens == ref[prompt.numel(): prompt.numel() + NEW]
    assert set(res.accepted_lengths) == {4}


def test_registry_builds_from_eval_extra(model):
    draft = _random_ctc_draft(model, 3, frames=5)
    export_cfg = draft.export_config()
    drafter, info = build_drafter(draft, export_cfg, EvalConfig(extra={"ctc_search": "joint", "ctc_num_paths": 7}))
    assert isinstance(drafter, CTCDrafter) and drafter.search == "joint" and drafter.max_nodes == 1 + 7 * 5
    assert info["ctc_num_paths"] == 7
    choices = [[0, 0, 0, 0, 0], [0, 1, 0, 0, 0]]
    drafter, _ = build_drafter(draft, export_cfg, EvalConfig(extra={"ctc_paths": choices}))
    assert drafter.choices.tolist() == choices and drafter.topk == 2 and drafter.max_nodes == 11
    with pytest.raises(ValueError, match="one rank >= 0 per frame"):
        build_drafter(draft, export_cfg, EvalConfig(extra={"ctc_paths": [[0, 0]]}))
