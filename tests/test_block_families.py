"""What the block draft families (models/block_draft.py: BlockDraft) have in common, checked on each of them: on DFlash,
DSpark and Domino, training blocks equal inference blocks, the chunked loss equals the reference, the block rules of
the recipe and the specdraft export round trip; on the chain families (DSpark, Domino), greedy losslessness (random
and trained drafts, both backends, a draft vocabulary), rejection sampling, the builder and the recipe's smoke train
-> CLI eval. The drafts come from one factory per family (tests/helpers/block_families.py); what only one family
does is in its own module (tests/test_dflash.py, test_dspark.py, test_domino.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import assert_chunked_matches_reference
from helpers.block_families import CHAIN_FAMILIES, D2T, FAMILIES, context_cache
from helpers.cli import smoke_cli_eval, smoke_cli_train
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import random_batch_with_aux

from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
from eval.harness.config import EvalConfig
from models.draft import BaseView
from models.export.specdraft import export_specdraft, load_draft, read_export_config
from train.config import load_train_config

ALL = list(FAMILIES)


# -- the model ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_training_blocks_equal_inference_with_the_context_cache(model, view, name):
    """The block of anchor t in training = the block drafted after committing positions 0..t (in two pieces, the
    cache growing), rooted at x_{t+1}: the block-sparse mask is exactly what inference sees. The drafted slots are
    1..G-1 where slot 0 only holds the root (DFlash), all G where the root's slot drafts too (DSpark, Domino); the
    mask slots' input is trained only where the family trains it."""
    family = FAMILIES[name]
    draft = family.draft(view, block_size=5, std=0.1)  # activations of a few units: float error well below 1e-5
    assert draft.first_slot == (0 if family.root_drafts else 1) and draft.num_heads == 5 - draft.first_slot
    assert draft.mask_embedding.requires_grad == family.learned_mask
    batch = random_batch_with_aux(model, draft, b=1, t=16)
    ids, aux = batch.input_ids, batch.aux_hidden
    anchors = torch.tensor([[0, 5, 6, 9, 11, 13]])
    with torch.no_grad():
        outs = draft.block_outputs(aux, ids, anchors)[0, :, draft.first_slot:]  # [A, K, d]
        for i, t in enumerate(anchors[0].tolist()):
            cache = draft.new_cache(2, "cpu", torch.float32)  # small: grows
            cut = (t + 1) // 2
            draft.commit_context(cache, aux[0, :cut])
            draft.commit_context(cache, aux[0, cut:t + 1])
            assert cache.length == t + 1
            root = int(ids[0, t + 1])
            torch.testing.assert_close(draft.draft_block_outputs(cache, root), outs[i], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(draft.draft_block(cache, root), draft.logits(outs[i]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("teacher_weight, position_weights", [(0.0, "decay"), (0.5, "dpace"), (1.0, "dpace")])
@pytest.mark.parametrize("name", ALL)
def test_chunked_loss_matches_reference(model, view, name, teacher_weight, position_weights):
    """The fused chunked loss (chunks of 7 rows: a ragged last one) = the plain reference: loss, gradients of
    everything trained (a family's own heads included), per-depth counts and top-1 hits. num_anchors 64 >= every
    valid anchor: both paths see the same blocks."""
    family = FAMILIES[name]
    draft = family.draft(view).train()
    batch = random_batch_with_aux(model, draft, b=2, t=20)
    fused, reference = assert_chunked_matches_reference(draft, batch, view, **family.loss_kw(
        chunk_size=7, teacher_weight=teacher_weight, position_weights=position_weights))
    assert [d.top1 for d in fused] == [d.top1 for d in reference]


# -- decoding (the chain families; DFlash's trees: tests/test_dflash_decoding.py) ------------------------------

@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
@pytest.mark.parametrize("name", CHAIN_FAMILIES)
def test_lossless_with_a_random_draft(model, view, prompts, ar_outputs, name, backend_kind):
    family = FAMILIES[name]
    drafter = family.drafter_cls(family.draft(view, block_size=4, std=0.5))
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        assert got.tree_nodes == 5 * got.base_steps  # the root + 4 drafts every step


@pytest.mark.parametrize("name", CHAIN_FAMILIES)
def test_lossless_and_accepting_with_a_trained_draft(model, view, prompts, ar_outputs, name):
    """Also the field benchmark's simulated acceptance equals the decoded run (assert_simulation_exact)."""
    family = FAMILIES[name]
    drafter = family.drafter_cls(family.trained(model, view, prompts))
    assert_lossless_and_accepting(HFBackend(model), drafter, prompts, ar_outputs)


@pytest.mark.parametrize("name", CHAIN_FAMILIES)
def test_draft_vocabulary_decodes_losslessly_with_base_ids(model, view, prompts, ar_outputs, name):
    family = FAMILIES[name]
    d2t = torch.tensor(sorted({t for out in ar_outputs for t in out} | {3, 9, 11}))
    drafter = family.drafter_cls(family.draft(view, d2t=d2t, std=0.5))
    for prompt, want in zip(prompts, ar_outputs):
        assert speculative_generate(HFBackend(model), drafter, prompt, max_new_tokens=NEW).tokens == want


@pytest.mark.usefixtures("one_thread")  # thousands of tiny calls: one thread is much faster on a busy 2-core box
@pytest.mark.parametrize("name", CHAIN_FAMILIES)
def test_rejection_sampling_with_chains_matches_the_base(name):
    """Sampling: 3 tokens through the family's chains (deterministic drafts, point masses) with rejection sampling
    on a bigram base; the pair (t2, t3) follows the base's exact distribution."""
    from helpers.bigram_base import rejection_sampling_tv

    family = FAMILIES[name]
    tv = rejection_sampling_tv(lambda v: family.drafter_cls(family.draft(v, seed=3, block_size=3, std=0.5)), 1500,
                               seed=0)
    assert tv < 0.06  # 16 cells: E[TV] of an exact sampler <= 0.042


@pytest.mark.parametrize("name", CHAIN_FAMILIES)
def test_builder_chain_serving_depth_and_no_static_trees(view, name):
    """A slot's logits depend on the drafts before it: the builder drafts chains of 1..block_size and refuses a
    static tree; the serving depth is the chain's."""
    draft = FAMILIES[name].draft(view, block_size=6)
    drafter, info = build_drafter(draft, {"family": name}, EvalConfig())
    spec = drafter_family(name)
    assert drafter.num_speculative_tokens == 6 and drafter.max_nodes == 7
    assert spec.num_speculative_tokens(info, drafter) == 6 and info["num_speculative_tokens"] == 6
    assert spec.shape(info) == "chain of 6" and spec.max_speculative_tokens(draft) == 6
    assert spec.tune_shapes(draft) == []
    drafter, info = build_drafter(draft, {"family": name}, EvalConfig(**chain_overrides(name, 3)))
    assert drafter.num_speculative_tokens == 3 and spec.num_speculative_tokens(info, drafter) == 3
    with pytest.raises(ValueError, match="drafts a chain"):
        build_drafter(draft, {"family": name}, EvalConfig(tree="wide2"))
    with pytest.raises(ValueError, match="1..6"):
        build_drafter(draft, {"family": name}, EvalConfig(extra={"num_speculative_tokens": 7}))


# -- configs and exports --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_recipe_loads_and_checks_the_block_rules(name):
    """configs/<name>.yaml trains the family's default block with one reported depth per drafted slot; the rules
    every block family has (BlockDraft.check_config) refuse a block its draft.num_heads disagrees with, a block of
    one slot and unknown position weights; the family's own options are refused in another family's run."""
    family = FAMILIES[name]
    recipe = [f"configs/{name}.yaml"]
    cfg = load_train_config(recipe)
    block = getattr(cfg.draft, name).block_size
    assert cfg.draft.family == name and block == family.draft_cls.facts.draft_options().block_size
    assert cfg.draft.num_heads == block - (0 if family.root_drafts else 1)
    with pytest.raises(ValueError, match=r"draft\.num_heads"):
        load_train_config(recipe, [f"draft.{name}.block_size={block - 2}"])
    with pytest.raises(ValueError, match=rf"draft\.{name}\.block_size"):
        load_train_config(recipe, [f"draft.{name}.block_size=1", "draft.num_heads=1"])
    with pytest.raises(ValueError, match=rf"loss\.{name}\.position_weights"):
        load_train_config(recipe, [f"loss.{name}.position_weights=linear"])
    option = family.draft_cls.own_args[0]  # its first own option, set off its default
    default = getattr(family.draft_cls.facts.draft_options(), option)
    value = str(not default).lower() if isinstance(default, bool) else default // 2
    for other in ("medusa", *(n for n in FAMILIES if n != name)):
        with pytest.raises(ValueError, match=family.draft_cls.facts.title):
            load_train_config([f"configs/{other}.yaml"], [f"draft.{name}.{option}={value}"])


@pytest.mark.parametrize("d2t", [None, D2T])
@pytest.mark.parametrize("name", ALL)
def test_specdraft_export_round_trip(model, view, tmp_path, name, d2t):
    """export_specdraft -> load_draft gives the same draft back: the config's shared keys and the family's own
    constructor arguments (its own keys pass the schema through FamilyFacts.export_key_types), every tensor, the
    draft vocabulary and its inverse, and the same blocks (and chains) from the same context."""
    family = FAMILIES[name]
    draft = family.draft(view, d2t=d2t)
    out = export_specdraft(draft, tmp_path / "exp", "tiny", "fp")
    cfg = read_export_config(out)
    for key in ("family", "aux_layers", "num_layers", "block_size", "mask_token_id", *draft.own_args):
        assert cfg[key] == getattr(draft, key), key
    loaded, _ = load_draft(out, BaseView.from_model(model))
    assert type(loaded) is type(draft) and all(getattr(loaded, a) == getattr(draft, a) for a in draft.own_args)
    for key, value in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    if d2t is not None:
        assert torch.equal(loaded.d2t, d2t) and loaded.t2d[d2t].tolist() == list(range(len(d2t)))
    caches = [context_cache(model, m, t=12) for m in (draft, loaded)]
    for root in (5, 100, 250):
        torch.testing.assert_close(loaded.draft_block_outputs(caches[1], root),
                                   draft.draft_block_outputs(caches[0], root))
        if family.drafter_cls is not None:
            assert loaded.draft_chain(caches[1], root)[0].tolist() == draft.draft_chain(caches[0], root)[0].tolist()


@pytest.mark.parametrize("name", CHAIN_FAMILIES)
def test_recipe_smoke_train_then_cli_eval_is_lossless(tmp_path, clean_env, name):
    """`specdraft train` of configs/<name>.yaml at smoke size (blocks of 4), then `specdraft eval` of its chain: a
    finite loss at the last depth, the export names the family, the held-out report has depths 1..4, lossless."""
    run_dir = tmp_path / name
    own = [f"draft.{name}.{key}={value}" for key, value in FAMILIES[name].memorise.items()]
    rows = smoke_cli_train(run_dir, f"configs/{name}.yaml", ["train.max_steps=4", "draft.num_layers=2",
                                                              f"draft.{name}.block_size=4", "draft.num_heads=4",
                                                              f"draft.{name}.num_anchors=32", *own], clean_env())
    assert any(math.isfinite(r.get("loss/head4", math.nan)) for r in rows)
    assert json.loads((run_dir / "export" / "config.json").read_text())["family"] == name
    heldout = json.loads((run_dir / "heldout.json").read_text())
    assert [d["depth"] for d in heldout["depths"]] == [1, 2, 3, 4]
    report = smoke_cli_eval(run_dir, "chain", [], clean_env())
    assert report["method"] == name and report["lossless"] is True and report["acceptance_length"] >= 1.0
