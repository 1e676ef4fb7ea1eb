"""EAGLE-3 decoding: aux capture (fast == hf), greedy losslessness (chain and tree, random and trained drafts,
both backends, a draft vocabulary), the tree's shape rules, the draft's own KV cache, rejection sampling
against the base distribution, and the builder's options."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_draft
from helpers.bigram_base import rejection_sampling_tv
from helpers.cli import smoke_cli_eval, smoke_cli_train
from helpers.compiled import assert_ran_compiled
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import greedy_continuation_batch, perturb, with_draft_vocab

from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter
from eval.harness.config import EvalConfig
from models.base import last_hidden_and_aux
from models.families.eagle3.drafter import Eagle3Drafter
from models.families.eagle3.model import Eagle3Draft
from train.config import LossSection


def _random_draft(view, seed=0, d2t=None):
    if d2t is not None:
        view = with_draft_vocab(view, d2t)
    torch.manual_seed(seed)
    return perturb(Eagle3Draft(view), 0.1).eval()


def _trained_draft(model, view, prompts, steps=40):
    """A draft that memorised the base's own greedy continuations of the test prompts (TTT, hard CE)."""
    torch.manual_seed(0)
    draft = Eagle3Draft(view, ttt_steps=3)
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    fit_draft(draft, [batch], view, LossSection(chunk_size=64), steps=steps, lr=1e-2)
    return draft.eval()


@pytest.fixture(scope="module")
def trained(model, view, prompts):
    return _trained_draft(model, view, prompts)


def test_fast_backend_aux_states_match_hf(model, prompts):
    hf, fast = HFBackend(model), FastBackend(model, max_len=64)
    for be in (hf, fast):
        be.reset(64)
        be.set_aux_layers([1, 0])  # any order: the draft's order is kept
    hf.prefill(prompts[0])
    fast.prefill(prompts[0])
    torch.testing.assert_close(fast.last_aux, hf.last_aux, rtol=1e-4, atol=1e-4)
    _, want = last_hidden_and_aux(model, prompts[0][None], None, [1, 0])
    torch.testing.assert_close(hf.last_aux, want[0], rtol=1e-5, atol=1e-5)
    tokens, depths = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    hf.forward_tree(tokens, depths, mask)
    fast.forward_tree(tokens, depths, mask)
    assert hf.last_aux.shape == (3, 2 * model.config.hidden_size)
    torch.testing.assert_close(fast.last_aux, hf.last_aux, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="aux layer ids"):
        hf.set_aux_layers([2])


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_compiled_fast_backend_keeps_compiling_with_aux(model, view, prompts, trained, mode):
    """The aux states are outputs of the compiled step (inductor, fullgraph=True), so EAGLE-3 decodes compiled:
    every tree step ran through the compiled graph, and tokens and acceptance equal the eager backend's."""
    compiled = FastBackend(model, max_len=128, compile=True)
    eager = FastBackend(model, max_len=128, compile=False, static=True)  # same padding, no compile
    drafter = Eagle3Drafter(trained, mode=mode, num_speculative_tokens=3, tree_topk=2, tree_depth=2, tree_nodes=4)
    for prompt in prompts[:2]:
        got = speculative_generate(compiled, drafter, prompt, max_new_tokens=12, eos_ids=None)
        want = speculative_generate(eager, drafter, prompt, max_new_tokens=12, eos_ids=None)
        assert got.tokens == want.tokens
        assert got.accepted_lengths == want.accepted_lengths  # the aux states the draft read were the same
        assert got.acceptance_length > 1.0  # a trained draft: aux states reached it intact, paths were accepted
    assert compiled.compile and compiled.aux_layers == tuple(trained.aux_layers)
    assert_ran_compiled(compiled)  # counted inside the compiled graphs, not from the compile flag
    assert eager.compiled_graphs == 0 and not eager.compile_report()["ran_compiled"]
    # The drafter switches the capture on and off between runs; compile never goes off.
    compiled.set_aux_layers([])
    assert compiled.compile and compiled.last_aux is None


@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_with_random_drafts(model, view, prompts, ar_outputs, mode, backend_kind):
    drafter = Eagle3Drafter(_random_draft(view), mode=mode, num_speculative_tokens=3, tree_topk=3, tree_depth=3,
                            tree_nodes=10)
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        if mode == "chain":
            assert got.proposed_counts[:3] == [got.base_steps] * 3  # every step drafted 3 deep
        else:  # the best 9 nodes by cumulative probability: deep where the draft is confident
            assert got.proposed_counts[:2] == [got.base_steps] * 2 and got.tree_nodes == 10 * got.base_steps


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_and_accepting_with_a_trained_draft(model, trained, prompts, ar_outputs, mode):
    drafter = Eagle3Drafter(trained, mode=mode, num_speculative_tokens=4, tree_topk=3, tree_depth=4, tree_nodes=16)
    assert_lossless_and_accepting(HFBackend(model), drafter, prompts, ar_outputs)


def test_draft_vocabulary_decodes_losslessly_with_base_ids(model, view, prompts, ar_outputs):
    d2t = torch.tensor(sorted({t for out in ar_outputs for t in out} | {3, 9, 11}))  # base ids, hand-made
    draft = _random_draft(view, d2t=d2t)
    drafter = Eagle3Drafter(draft, mode="tree", tree_topk=3, tree_depth=3, tree_nodes=12)
    seen = []
    original = drafter.propose

    def spy(state):
        tree = original(state)
        seen.append(tree.tokens[1:])
        return tree

    drafter.propose = spy
    for prompt, want in zip(prompts, ar_outputs):
        assert speculative_generate(HFBackend(model), drafter, prompt, max_new_tokens=NEW).tokens == want
    drafted = torch.cat(seen)
    assert drafted.numel() and bool(torch.isin(drafted, d2t).all())  # only base ids of the map reach the tree


def test_tree_with_top1_is_the_chain_and_trees_keep_their_ancestors(model, view, prompts):
    draft = _random_draft(view, seed=2)
    chain = Eagle3Drafter(draft, mode="chain", num_speculative_tokens=4)
    tree1 = Eagle3Drafter(draft, mode="tree", tree_topk=1, tree_depth=4, tree_nodes=5)
    wide = Eagle3Drafter(draft, mode="tree", tree_topk=3, tree_depth=4, tree_nodes=12)
    hf = HFBackend(model)
    hf.reset(64)
    hf.set_aux_layers(draft.aux_layers)
    logits, hidden = hf.prefill(prompts[1])
    from eval.engine.drafters.drafter import DecodeState

    state = DecodeState(ids=prompts[1], root=int(logits[-1].argmax()), new_hidden=hidden, new_ids=prompts[1],
                        new_aux=hf.last_aux)
    trees = []
    for d in (chain, tree1, wide):
        d.reset()
        trees.append(d.propose(state))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)
    t = trees[2]
    assert t.num_nodes == 12 and t.max_depth >= 2
    assert int((t.depths == 1).sum()) <= 3  # top-3 children of the root at most
    # The root's depth-1 children are the draft's top-3 from o_root, best first.
    with torch.inference_mode():
        o_root = draft.commit_rows(draft.new_cache(8, "cpu", torch.float32), hf.last_aux,
                                   torch.cat([prompts[1][1:], torch.tensor([state.root])]))[-1:]
        top3 = draft.logits(o_root)[0].topk(3).indices.tolist()
    kids = t.tokens[t.depths == 1].tolist()
    assert kids == top3[: len(kids)]


def test_builder_options(view):
    draft = _random_draft(view)
    d, info = build_drafter(draft, {"family": "eagle3"}, EvalConfig())
    assert isinstance(d, Eagle3Drafter) and info["eagle3_mode"] == "tree" and d.max_nodes == 16
    chain5 = EvalConfig(extra={"eagle3_mode": "chain", "num_speculative_tokens": 5})
    d, info = build_drafter(draft, {"family": "eagle3"}, chain5)
    assert d.mode == "chain" and d.max_nodes == 6 and info["num_speculative_tokens"] == 5
    with pytest.raises(ValueError, match="eagle3_mode"):
        build_drafter(draft, {"family": "eagle3"}, EvalConfig(extra={"eagle3_mode": "beam"}))


# ---------------------------------------------------------------------------------------------------
# rejection sampling with EAGLE-3 trees reproduces the base distribution (toy Markov base, see
# tests/test_redrafter_decoding.py for the bound)
# ---------------------------------------------------------------------------------------------------


def _tv_of_eagle3_sampling(samples: int, seed: int) -> float:
    return rejection_sampling_tv(
        lambda view: Eagle3Drafter(_random_draft(view, seed=3), mode="tree", tree_topk=2, tree_depth=2, tree_nodes=5),
        samples, seed)


def test_rejection_sampling_with_eagle3_trees_matches_the_base():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny calls: one thread is ~25x faster on a busy 2-core box
    try:
        assert _tv_of_eagle3_sampling(1500, seed=0) < 0.06  # 16 cells: E[TV] of an exact sampler <= 0.042
    finally:
        torch.set_num_threads(threads)


def test_recipe_smoke_train_then_cli_eval_is_lossless(tmp_path, clean_env):
    """`specdraft train --config configs/eagle3.yaml --config configs/smoke.yaml`, then `specdraft eval` (chain
    and tree) on the export: lossless, with the EAGLE-3 settings in the report."""
    import json
    import math

    run_dir = tmp_path / "eagle3"
    rows = smoke_cli_train(run_dir, "configs/eagle3.yaml", ["train.max_steps=4"], clean_env())
    assert any(math.isfinite(r.get("loss/head3", math.nan)) for r in rows)
    assert json.loads((run_dir / "export" / "config.json").read_text())["family"] == "eagle3"
    for mode, extra in (("chain", ["extra.eagle3_mode=chain", "extra.num_speculative_tokens=3"]), ("tree", [])):
        report = smoke_cli_eval(run_dir, mode, extra, clean_env())
        assert report["method"] == "eagle3" and report["lossless"] is True
        assert report["acceptance_length"] >= 1.0
