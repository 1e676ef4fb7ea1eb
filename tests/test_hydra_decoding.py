"""Hydra decoding: lossless greedy output (random and briefly trained heads, with and without the prefix
layer), the level-by-level tree fill, true_path_ranks against propose(), and a Hydra++ smoke run whose
export decodes through build_drafter."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import fit_draft
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import perturb

from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState
from eval.engine.drafters.registry import build_drafter
from eval.engine.tree import STATIC_TREES, StaticTree
from eval.harness.config import EvalConfig
from models.draft import BaseView, DraftBatch
from models.families.hydra.drafter import HydraDrafter
from models.families.hydra.model import HydraDraft
from train.config import LossSection

FULL_3x3 = tuple((a,) for a in range(3)) + tuple((a, b) for a in range(3) for b in range(3)) + tuple(
    (a, b, c) for a in range(3) for b in range(3) for c in range(3))  # every path of width 3, depth 3


def _random_draft(view, prefix: bool, seed: int = 0) -> HydraDraft:
    torch.manual_seed(seed)
    return perturb(HydraDraft(num_heads=4, num_layers=2, base=view, prefix_layer=prefix), 0.1).eval()


def _sequence(model, prompt, n_new):
    """prompt + the base's greedy continuation, and its hidden states h [T, d]."""
    with torch.inference_mode():
        ids = model.generate(prompt[None], max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0]
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
    return ids, hidden


def _trained_draft(model, view, prompts, prefix: bool, steps: int = 40) -> HydraDraft:
    """Heads that memorised the base's own continuations of the test prompts (teacher forced)."""
    torch.manual_seed(0)
    draft = HydraDraft(num_heads=3, num_layers=1, base=view, prefix_layer=prefix)
    seqs = [_sequence(model, p, NEW + 4) for p in prompts]
    width = max(ids.numel() for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    hidden = torch.zeros(len(seqs), width, view.hidden_size)
    for b, (i, h) in enumerate(seqs):  # right-padded, like data.dataset.collate
        ids[b, : i.numel()], mask[b, : i.numel()], hidden[b, : i.numel()] = i, 1, h
    fit_draft(draft, [DraftBatch(hidden, ids, mask)], view, LossSection(chunk_size=64), steps=steps, lr=3e-2)
    return draft.eval()


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("tree_name", ["tree16", "wide2"])
def test_lossless_with_random_heads(model, view, prompts, ar_outputs, prefix, tree_name):
    drafter = HydraDrafter(_random_draft(view, prefix), StaticTree(STATIC_TREES[tree_name]))
    backend = HFBackend(model)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want


@pytest.mark.parametrize("prefix", [False, True])
def test_lossless_and_accepting_with_trained_heads(model, view, prompts, ar_outputs, prefix):
    draft = _trained_draft(model, view, prompts, prefix)
    drafter = HydraDrafter(draft, StaticTree(FULL_3x3))
    # only Hydra++'s prefix layer keeps a cache of the committed tokens
    assert_lossless_and_accepting(HFBackend(model), drafter, prompts, ar_outputs, context_cache=prefix)


def test_bf16_draft_proposes_and_stays_lossless(model, view, prompts, ar_outputs):
    draft = _trained_draft(model, view, prompts[:1], prefix=True, steps=20).to(torch.bfloat16)
    drafter = HydraDrafter(draft, StaticTree(STATIC_TREES["tree16"][:10]))
    got = speculative_generate(HFBackend(model), drafter, prompts[0], max_new_tokens=NEW)
    assert got.tokens == ar_outputs[0] and got.acceptance_length > 1.0


def test_each_level_is_one_batched_call_conditioned_on_the_node_path(view):
    """Children of sibling nodes differ (Hydra is path dependent) and equal a per-node head evaluation."""
    draft = _random_draft(view, prefix=False, seed=3)
    tree = StaticTree(FULL_3x3)
    drafter = HydraDrafter(draft, tree)
    calls = []
    original = draft.head_logits
    draft.head_logits = lambda k, z, e, mm=None: calls.append((k, z.shape[0])) or original(k, z, e, mm)
    h = torch.randn(4, view.hidden_size)
    state = DecodeState(ids=torch.tensor([5, 6, 7, 8]), root=9, new_hidden=h, new_ids=torch.tensor([5, 6, 7, 8]))
    out = drafter.propose(state)
    assert calls == [(1, 1), (2, 3), (3, 9)]
    with torch.no_grad():
        for node in range(tree.num_nodes):
            kids = (out.parents == node).nonzero().flatten()
            if kids.numel() == 0:
                continue
            path = out.tokens[out.path_to(node)]  # root .. node
            k = path.numel()
            logits = original(k, h[-1:], draft.embed_tokens(path[None]))[0]
            assert out.tokens[kids].tolist() == logits.topk(3).indices.tolist()
    depth1 = out.tokens[out.depths == 1]
    depth2 = out.tokens[out.depths == 2].reshape(3, 3)
    assert not (depth2 == depth2[0]).all(), "siblings' children should depend on their own path"
    assert depth1.numel() == 3


@pytest.mark.parametrize("prefix", [False, True])
def test_true_path_ranks_match_propose(model, view, prompts, prefix):
    """Slow twin: at step t, run propose() on the decode state after committing ids[..t] and read the rank of
    the true token among the children of the node whose path is the true tokens."""
    draft = _trained_draft(model, view, prompts[:1], prefix, steps=1)  # barely trained: ranks vary
    ids, hidden = _sequence(model, prompts[0], 14)
    R, D = 3, 3
    drafter = HydraDrafter(draft, StaticTree(FULL_3x3))
    ranks = drafter.true_path_ranks(hidden, ids, D, R)
    T = ids.numel()
    assert ranks.shape == (T, D) and ranks.dtype == torch.long
    checked = set()
    for t in range(0, T - 2):
        drafter.reset()
        # decode-like feeding: the prompt first, then the rest in uneven chunks (prefix cache)
        cut = min(prompts[0].numel(), t + 1)
        for a, b in ((0, cut), (cut, t + 1)):
            if b <= a:
                continue
            state = DecodeState(ids=ids[:b], root=int(ids[b]), new_hidden=hidden[a:b], new_ids=ids[a:b])
            tree = drafter.propose(state)
        node = 0
        for k in range(1, D + 1):
            if t + 1 + k >= T:
                assert ranks[t, k - 1] == -1
                break
            kids = (tree.parents == node).nonzero().flatten()
            hit = (tree.tokens[kids] == ids[t + 1 + k]).nonzero().flatten()
            want = int(hit[0]) if hit.numel() else R
            assert int(ranks[t, k - 1]) == want, (t, k)
            checked.add(want)
            if not hit.numel():
                break  # deeper true paths are not in the tree; nothing to compare against
            node = int(kids[hit[0]])
    assert ranks[T - 2:, 0].tolist() == [-1, -1]
    assert len(checked) >= 2  # both hits at some rank and misses were exercised


def test_hydra_pp_smoke_run_exports_and_decodes(tmp_path, model):
    from models.base import load_base
    from models.export.specdraft import load_draft
    from train.config import load_train_config
    from train.loop import train

    run_dir = tmp_path / "hydra_pp"
    cfg = load_train_config(["configs/hydra_pp.yaml", "configs/smoke.yaml"],
                            [f"run_dir={run_dir}", "train.max_steps=3", "train.val_batches=1"])
    assert cfg.draft.family == "hydra" and cfg.draft.hydra.prefix_layer and cfg.loss.teacher_weight == 1.0
    train(cfg)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows and all(math.isfinite(r[f"loss/head{k}"]) for r in train_rows for k in (1, 2, 3, 4))
    base = load_base("tiny")
    draft, export_cfg = load_draft(run_dir / "export", BaseView.from_model(base.model), base.fingerprint)
    assert isinstance(draft, HydraDraft) and draft.prefix is not None and export_cfg["num_layers"] == 4
    drafter, info = build_drafter(draft, export_cfg, EvalConfig())
    assert isinstance(drafter, HydraDrafter) and info["tree"] == "tree16"
    backend = HFBackend(base.model)
    prompt = torch.tensor([1, 20, 30, 40, 50])
    want = autoregressive_generate(backend, prompt, max_new_tokens=8).tokens
    assert speculative_generate(backend, drafter, prompt, max_new_tokens=8).tokens == want


def test_default_tree_is_cut_to_a_one_head_draft():
    """The demo's one-head Hydra with tree=auto and no stored tree: the family default's depth-1 level, not an
    error; a tree the user names explicitly still fails loudly when too deep."""
    from models.base import load_base

    base = load_base("tiny")
    torch.manual_seed(0)
    draft = HydraDraft(1, 1, BaseView.from_model(base.model), share_lm_head=True)
    drafter, info = build_drafter(draft, {"family": "hydra"}, EvalConfig())
    assert info["tree"] == "tree16[:1]" and info["tree_nodes"] == 5 and drafter.tree.depth == 1
    backend = HFBackend(base.model)
    prompt = torch.tensor([1, 20, 30, 40, 50])
    want = autoregressive_generate(backend, prompt, max_new_tokens=8).tokens
    assert speculative_generate(backend, drafter, prompt, max_new_tokens=8).tokens == want
    with pytest.raises(ValueError, match="deep"):
        build_drafter(draft, {"family": "hydra"}, EvalConfig(tree="tree16"))


@pytest.mark.parametrize("layout", ["xw", "wx"])
def test_fp32_head_product_layouts_propose_the_same_tree(view, monkeypatch, layout):
    """The drafter's fast fp32 LM-head product ("wx": (W @ x^T)^T, padded to 2 rows for 1) is the twin of the
    model's own x @ W.T: same logits within fp32 rounding, same proposed tokens, on 1-row and wider levels."""
    from eval.engine.backends.fast_matmul import FP32_LAYOUT_ENV

    monkeypatch.setenv(FP32_LAYOUT_ENV, layout)
    draft = _random_draft(view, prefix=False, seed=5)
    drafter = HydraDrafter(draft, StaticTree(FULL_3x3))
    assert (drafter._matmul is not None) == (layout == "wx")
    h = torch.randn(4, view.hidden_size)
    state = DecodeState(ids=torch.tensor([5, 6, 7, 8]), root=9, new_hidden=h, new_ids=torch.tensor([5, 6, 7, 8]))
    reference = HydraDrafter(draft, StaticTree(FULL_3x3))
    reference._matmul = None  # the model's plain product
    assert drafter.propose(state).tokens.tolist() == reference.propose(state).tokens.tolist()
    with torch.no_grad():
        for n in (1, 3, 9):  # the widths the 3x3 tree's levels run
            z = torch.randn(n, view.hidden_size)
            emb = draft.embed_tokens(torch.randint(0, 50, (n, 2)))
            fast = draft.head_logits(2, z, emb, drafter._matmul)
            torch.testing.assert_close(fast, draft.head_logits(2, z, emb), rtol=1e-5, atol=1e-5)
            assert fast.shape == (n, draft.head_weight(2).shape[0])
