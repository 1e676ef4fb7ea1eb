"""DFlash decoding: greedy losslessness (chain and static tree, random and trained drafts, both backends, a
draft vocabulary), the draft's context cache, rejection sampling against the base distribution, the builder,
and the recipe's smoke train -> CLI eval."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_draft

from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.dflash import DFlashDrafter
from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
from eval.engine.tree import STATIC_TREES, StaticTree, chain_choices
from eval.harness.config import EvalConfig
from models.base import last_hidden_and_aux
from models.dflash import DFlashDraft
from models.draft import BaseView, DraftBatch
from train.config import LossSection

NEW = 20


@pytest.fixture(scope="module")
def view(model):
    return BaseView.from_model(model)


@pytest.fixture(scope="module")
def ar_outputs(model, prompts):
    backend = HFBackend(model)
    return [autoregressive_generate(backend, p, max_new_tokens=NEW).tokens for p in prompts]


def _random_draft(view, seed=0, d2t=None, block_size=5):
    if d2t is not None:
        view = BaseView(view.lm_head_weight, view.embed_weight, view.hidden_size, view.vocab_size, view.model, d2t)
    torch.manual_seed(seed)
    draft = DFlashDraft(view, num_layers=2, block_size=block_size)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return draft.eval()


def _trained_draft(model, view, prompts, steps=30):
    """A draft that memorised the base's own greedy continuations of the test prompts (hard CE)."""
    torch.manual_seed(0)
    draft = DFlashDraft(view, num_layers=2, block_size=5, num_anchors=64)
    with torch.inference_mode():
        seqs = [model.generate(p[None], max_new_tokens=NEW + 6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0] for p in prompts]
    width = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
    h, aux = last_hidden_and_aux(model, ids, None, draft.aux_layers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: one thread is far faster on a busy 2-core box
    try:
        fit_draft(draft, [DraftBatch(h, ids, mask, aux)], view, LossSection(chunk_size=64, position_weights="decay"),
                  steps=steps, lr=2e-2)
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
    backend = HFBackend(model)
    lengths = []
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        lengths.append(got.acceptance_length)
        # the draft's cache holds exactly the positions committed before the last propose()
        assert drafter._cache.length == prompt.numel() + sum(got.accepted_lengths[:-1])
    assert min(lengths) > 2.0  # memorised continuations: most steps accept several drafts


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
    assert spec.chain_depth(info, drafter) == 5
    drafter, info = build_drafter(draft, {"family": "dflash"}, EvalConfig(tree="wide2"))
    assert drafter.tree.num_nodes == 7 and info["tree"] == "wide2"
    drafter, info = build_drafter(draft, {"family": "dflash"}, EvalConfig(**chain_overrides("dflash", 3)))
    assert drafter.tree.depth == 3 and spec.chain_depth(info, drafter) == 3
    with pytest.raises(ValueError, match="drafts 5 tokens"):
        build_drafter(draft, {"family": "dflash"}, EvalConfig(tree_choices=chain_choices(6)))


def _tv_of_dflash_sampling(samples: int, seed: int) -> float:
    """Sample 3 tokens with rejection sampling through DFlash trees on a bigram base; TV distance of the pair
    (t2, t3) from the exact base distribution."""
    from test_eagle3_decoding import BOS, BigramAuxBackend, V
    from transformers import LlamaForCausalLM

    from models.tiny import tiny_llama_config

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(V, V, generator=gen) * 1.2
    logits[:, BOS] = -1e9
    logits[BOS] = -1e9
    logits[BOS, 0] = 0.0  # after the prompt: t1 = 0 surely
    torch.manual_seed(1)
    toy = LlamaForCausalLM(tiny_llama_config(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1)).eval()
    draft = _random_draft(BaseView.from_model(toy), seed=3, block_size=3)
    be = BigramAuxBackend(logits, torch.randn(V, 16, generator=gen), torch.randn(V, 32, generator=gen))
    drafter = DFlashDrafter(draft, StaticTree(STATIC_TREES["wide2"]))
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    nodes = 0
    for _ in range(samples):
        out = speculative_generate(be, drafter, [BOS], max_new_tokens=3, eos_ids=None, acceptance="rejection",
                                   temperature=1.0, generator=gen)
        assert out.tokens[0] == 0
        counts[out.tokens[1], out.tokens[2]] += 1
        nodes += out.tree_nodes
    assert nodes > 2 * samples  # real trees were verified, not just roots
    p = logits.softmax(-1)
    exact = p[0][:, None] * p
    return 0.5 * float((counts / samples - exact).abs().sum())


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
    import subprocess
    import sys

    run_dir = tmp_path / "dflash"
    proc = subprocess.run([sys.executable, "-m", "cli.main", "train", "--config", "configs/dflash.yaml", "--config",
                           "configs/smoke.yaml", f"run_dir={run_dir}", "train.max_steps=4", "draft.num_layers=2",
                           "draft.block_size=8", "draft.num_heads=7", "draft.num_anchors=32"],
                          capture_output=True, text=True, timeout=900, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]
    assert any(math.isfinite(r.get("loss/head7", math.nan)) for r in rows)
    assert json.loads((run_dir / "export" / "config.json").read_text())["family"] == "dflash"
    heldout = json.loads((run_dir / "heldout.json").read_text())
    assert [d["depth"] for d in heldout["depths"]] == list(range(1, 8))
    for name, extra in (("chain", []), ("tree", ["tree=tree16"])):
        proc = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--draft", str(run_dir / "export"),
                               "--config", "configs/eval/smoke.yaml", f"name={name}", *extra],
                              capture_output=True, text=True, timeout=900, env=clean_env())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        report = json.loads((run_dir / "eval" / name / "report.json").read_text())
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
