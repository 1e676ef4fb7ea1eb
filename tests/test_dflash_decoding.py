"""DFlash decoding: greedy losslessness (chain and static tree, random and trained drafts, both backends, a
draft vocabulary), the draft's context cache, rejection sampling against the base distribution, the builder,
and the recipe's smoke train -> CLI eval."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_draft
from helpers.bigram_base import rejection_sampling_tv
from helpers.cli import smoke_cli_eval, smoke_cli_train
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import greedy_continuation_batch, perturb, with_draft_vocab

from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
from eval.engine.tree import STATIC_TREES, StaticTree, chain_choices
from eval.harness.config import EvalConfig
from models.base import last_hidden_and_aux
from models.draft import BaseView, DraftBatch
from models.families.dflash.drafter import DFlashDrafter
from models.families.dflash.model import DFlashDraft, DFlashLossOptions
from train.config import LossSection


def _random_draft(view, seed=0, d2t=None, block_size=5):
    if d2t is not None:
        view = with_draft_vocab(view, d2t)
    torch.manual_seed(seed)
    return perturb(DFlashDraft(view, num_layers=2, block_size=block_size), 0.1).eval()


def _trained_draft(model, view, prompts, steps=30):
    """A draft that memorised the base's own greedy continuations of the test prompts (hard CE)."""
    torch.manual_seed(0)
    draft = DFlashDraft(view, num_layers=2, block_size=5, num_anchors=64)
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: one thread is far faster on a busy 2-core box
    try:
        loss_cfg = LossSection(chunk_size=64, dflash=DFlashLossOptions(position_weights="decay"))
        fit_draft(draft, [batch], view, loss_cfg, steps=steps, lr=2e-2)
    finally:
        torch.set_num_threads(threads)
    return draft.eval()


@pytest.fixture(scope="module")
def trained(model, view, prompts):
    return _trained_draft(model, view, prompts)


@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
@pytest.mark.parametrize("tree", ["chain", "wide2"])
def test_lossless_with_random_drafts(model, view, prompts, ar_outputs, tree, backend_kind):
    shape = StaticTree(chain_choices(4) if tree == "chain" else STATIC_TREES["wide2"])
    drafter = DFlashDrafter(_random_draft(view), shape)
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        assert got.tree_nodes == shape.num_nodes * got.base_steps  # every step verified the whole tree


def test_lossless_and_accepting_with_a_trained_draft(model, trained, prompts, ar_outputs):
    drafter = DFlashDrafter(trained, StaticTree(chain_choices(4)))
    assert_lossless_and_accepting(HFBackend(model), drafter, prompts, ar_outputs)


def test_draft_vocabulary_decodes_losslessly_with_base_ids(model, view, prompts, ar_outputs):
    d2t = torch.tensor(sorted({t for out in ar_outputs for t in out} | {3, 9, 11}))  # base ids, hand-made
    drafter = DFlashDrafter(_random_draft(view, d2t=d2t), StaticTree(STATIC_TREES["wide2"]))
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(HFBackend(model), drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want


def test_builder_default_chain_trees_and_serving_chain(view):
    draft = _random_draft(view, block_size=6)
    drafter, info = build_drafter(draft, {"family": "dflash"}, EvalConfig())
    assert info["tree"] == "chain5" and drafter.tree.depth == 5 and drafter.max_nodes == 6
    spec = drafter_family("dflash")
    assert spec.shape(info) == "chain5, 6 nodes"
    assert spec.num_speculative_tokens(info, drafter) == 5
    drafter, info = build_drafter(draft, {"family": "dflash"}, EvalConfig(tree="wide2"))
    assert drafter.tree.num_nodes == 7 and info["tree"] == "wide2"
    drafter, info = build_drafter(draft, {"family": "dflash"}, EvalConfig(**chain_overrides("dflash", 3)))
    assert drafter.tree.depth == 3 and spec.num_speculative_tokens(info, drafter) == 3
    with pytest.raises(ValueError, match="drafts 5 tokens"):
        build_drafter(draft, {"family": "dflash"}, EvalConfig(tree_choices=chain_choices(6)))


def _tv_of_dflash_sampling(samples: int, seed: int) -> float:
    """Sample 3 tokens with rejection sampling through DFlash trees on a bigram base; TV distance of the pair
    (t2, t3) from the exact base distribution."""
    return rejection_sampling_tv(
        lambda view: DFlashDrafter(_random_draft(view, seed=3, block_size=3), StaticTree(STATIC_TREES["wide2"])),
        samples, seed)


def test_rejection_sampling_with_dflash_trees_matches_the_base():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny calls: one thread is much faster on a busy 2-core box
    try:
        assert _tv_of_dflash_sampling(1500, seed=0) < 0.06  # 16 cells: E[TV] of an exact sampler <= 0.042
    finally:
        torch.set_num_threads(threads)


def test_recipe_smoke_train_then_cli_eval_is_lossless(tmp_path, clean_env):
    """`specdraft train --config configs/dflash.yaml --config configs/smoke.yaml`, then `specdraft eval` (the
    default chain and a static tree) on the export: lossless, per-position metrics for every slot."""
    import json
    import math

    run_dir = tmp_path / "dflash"
    rows = smoke_cli_train(run_dir, "configs/dflash.yaml", ["train.max_steps=4", "draft.num_layers=2",
                                                            "draft.dflash.block_size=8", "draft.num_heads=7",
                                                            "draft.dflash.num_anchors=32"], clean_env())
    assert any(math.isfinite(r.get("loss/head7", math.nan)) for r in rows)
    assert json.loads((run_dir / "export" / "config.json").read_text())["family"] == "dflash"
    heldout = json.loads((run_dir / "heldout.json").read_text())
    assert [d["depth"] for d in heldout["depths"]] == list(range(1, 8))
    for name, extra in (("chain", []), ("tree", ["tree=tree16"])):
        report = smoke_cli_eval(run_dir, name, extra, clean_env())
        assert report["method"] == "dflash" and report["lossless"] is True
        assert report["acceptance_length"] >= 1.0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "gemma3"])
def test_other_base_architectures_train_and_decode_losslessly(arch):
    """The draft builds on other HF bases (Gemma 3: its full-attention RoPE), trains, and decodes losslessly on
    both backends where the fast one supports the base."""
    from test_arch_decoding import greedy_reference, make_model

    from eval.engine.backends.fast import supports

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors; a busy shared CPU punishes thread handshakes
    try:
        model = make_model(arch, None)
        view = BaseView.from_model(model)
        torch.manual_seed(0)
        draft = DFlashDraft(view, num_layers=2, block_size=5, num_anchors=16)
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(3, 320, (2, 40), generator=gen)
        h, aux = last_hidden_and_aux(model, ids, None, draft.aux_layers)
        first, out = fit_draft(draft, [DraftBatch(h, ids, torch.ones_like(ids), aux)], view, LossSection(), steps=4,
                               lr=3e-3)
        assert torch.isfinite(out.loss) and float(out.loss.detach()) < first
        drafter, _ = build_drafter(draft.eval(), {"family": "dflash", **draft.export_config()}, EvalConfig())
        backends = [HFBackend(model)] + ([FastBackend(model, max_len=128)] if supports(model.config)[0] else [])
        for backend in backends:
            for n in (9, 14):
                prompt = torch.randint(3, 320, (n,), generator=gen)
                ref = greedy_reference(model, prompt)
                got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
                assert got.tokens == ref[n: n + NEW], (arch, type(backend).__name__)
    finally:
        torch.set_num_threads(threads)
