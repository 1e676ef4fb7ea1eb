"""DSpark: training blocks equal inference blocks, every slot drafting; the loss against a hand computation (Markov
bias from the true previous token, decay weights, confidence BCE), chunked == reference; the Markov chain decoded
left to right as vLLM does; greedy losslessness (random and trained drafts, both backends, a draft vocabulary, the
confidence cut); the builder; the speculators / vLLM export and its round trip; the recipe's smoke train -> CLI
eval."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import fit_draft
from helpers.cli import smoke_cli_eval, smoke_cli_train
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import greedy_continuation_batch, perturb, random_batch_with_aux, with_draft_vocab
from safetensors.torch import load_file
from test_serve_check import _have_vllm
from torch.nn import functional as F

from data.targets import offset_labels
from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
from eval.harness.config import EvalConfig
from losses.block import acceptance_bce, acceptance_bce_reference
from models.draft import BaseView
from models.export.formats import export_vllm
from models.export.specdraft import export_specdraft, load_draft
from models.export.vllm import SPECULATIVE_CONFIG_FILE
from models.families.dspark.drafter import DSparkDrafter
from models.families.dspark.export_speculators import load_dspark_speculators
from models.families.dspark.model import DSparkDraft, DSparkLossOptions
from train.config import LossSection, load_train_config

D2T = torch.tensor([7, 3, 100, 250, 64, 9, 11, 12, 13, 200, 201, 5])  # hand-made base ids, not sorted


def _draft(view, seed=0, d2t=None, block_size=4, rank=8, std=0.2, **kw):
    torch.manual_seed(seed)
    draft = DSparkDraft(with_draft_vocab(view, d2t), num_layers=2, block_size=block_size, markov_rank=rank,
                        num_anchors=64, **kw)
    perturb(draft, std, seed=seed)  # W2 and the confidence head off zero too
    with torch.no_grad():  # the mask slots' input stays the base's row (frozen; vLLM reads no other)
        draft.mask_embedding.copy_(view.embed_weight[draft.mask_token_id])
    return draft.eval()


def _loss_cfg(**kw):
    return LossSection(chunk_size=64, dspark=DSparkLossOptions(**kw))


# -- the model ------------------------------------------------------------------------------------------------

def test_every_slot_drafts_and_training_blocks_equal_inference(model, view):
    """Slot 0 (the root) drafts depth 1, so num_heads = block_size; the block of anchor t in training equals the
    block the context cache gives after committing 0..t."""
    draft = _draft(view, block_size=5)
    assert draft.num_heads == 5 and draft.first_slot == 0 and not draft.mask_embedding.requires_grad
    batch = random_batch_with_aux(model, draft, b=1, t=16)
    ids, aux = batch.input_ids, batch.aux_hidden
    anchors = torch.tensor([[0, 6, 11]])
    with torch.no_grad():
        outs = draft.block_outputs(aux, ids, anchors)[0]  # [A, G, d]
        for i, t in enumerate(anchors[0].tolist()):
            cache = draft.new_cache(2, "cpu", torch.float32)
            draft.commit_context(cache, aux[0, :t + 1])
            torch.testing.assert_close(draft.draft_block_outputs(cache, int(ids[0, t + 1])), outs[i], rtol=1e-5,
                                       atol=1e-5)


def test_chain_is_decoded_left_to_right_with_the_markov_bias(model, view):
    """draft_chain = the hand loop of vLLM's DSparkSpeculator (greedy): z_k = lm_head(norm h_k) + W2 W1[prev],
    prev = the root, then each draft; confidences = σ(proj([norm h_k ; W1[prev_k]]))."""
    draft = _draft(view, block_size=5, std=0.5)
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.mul_(30.0)  # a bias that matters next to the slots' own logits
    aux = random_batch_with_aux(model, draft, b=1, t=10).aux_hidden[0]
    cache = draft.new_cache(16, "cpu", torch.float32)
    draft.commit_context(cache, aux)
    root = 17
    drafts, conf = draft.draft_chain(cache, root)
    with torch.no_grad():
        h = draft.norm(draft.draft_block_outputs(cache, root))
        prev, want, want_conf = root, [], []
        for k in range(5):
            e = draft.markov_head.markov_w1.weight[prev]
            z = h[k] @ draft.lm_head.weight.T + draft.markov_head.markov_w2.weight @ e
            want_conf.append(torch.sigmoid(draft.confidence_head.proj.weight[0] @ torch.cat([h[k], e])
                                           + draft.confidence_head.proj.bias[0]))
            prev = int(z.argmax())
            want.append(prev)
    assert drafts.tolist() == want
    torch.testing.assert_close(conf, torch.stack(want_conf), rtol=1e-5, atol=1e-6)
    # A shorter chain runs a shorter block (vLLM's num_speculative_tokens slots), whose slots see only each other.
    short = draft.draft_block_outputs(cache, root, 3)
    assert short.shape == (3, view.hidden_size)
    assert not torch.allclose(short, draft.draft_block_outputs(cache, root)[:3])
    with torch.no_grad():
        h3, prev, want3 = draft.norm(short), root, []
        for k in range(3):
            e = draft.markov_head.markov_w1.weight[prev]
            z = h3[k] @ draft.lm_head.weight.T + draft.markov_head.markov_w2.weight @ e
            prev = int(z.argmax())
            want3.append(prev)
    assert draft.draft_chain(cache, root, 3)[0].tolist() == want3
    # The bias depends on the previous token: with W2 = 0 the chain is each slot's own argmax.
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.zero_()
    plain, _ = draft.draft_chain(cache, root)
    assert plain.tolist() == (h @ draft.lm_head.weight.T).argmax(-1).tolist()
    assert plain.tolist() != want  # the perturbed W2 changed some draft


def test_loss_matches_a_hand_computation(model, view):
    """Eval mode scores every anchor: row (t, k) = CE(lm_head(norm h) + W2 W1[x_{t+k}], x_{t+1+k}), weights
    lambda0·decay^(k-1), Σ w·ℓ / n; plus confidence_weight · mean BCE(confidence, top-1 hit)."""
    draft = _draft(view, block_size=3, rank=4, std=0.3)
    batch = random_batch_with_aux(model, draft, b=2, t=12)
    cfg = LossSection(teacher_weight=0.0, lambda0=1.0, decay=0.5, dspark=DSparkLossOptions(
        position_weights="decay", confidence_weight=0.7))
    got = draft.loss(batch, view, cfg).loss
    ids, mask = batch.input_ids, batch.loss_mask
    total, n, bce, n_conf = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for b in range(2):
            labels = torch.stack([offset_labels(ids[b:b + 1], mask[b:b + 1], 1 + k)[0] for k in (1, 2, 3)], -1)
            anchors = (labels[:, 0] != -100).nonzero().flatten()
            out = draft.block_outputs(batch.aux_hidden[b:b + 1], ids[b:b + 1], anchors[None])[0]  # [A, 3, d]
            for a, t in enumerate(anchors.tolist()):
                for k in (1, 2, 3):
                    y = int(labels[t, k - 1])
                    if y == -100:
                        continue
                    h = draft.norm(out[a, k - 1])
                    e = draft.markov_head.markov_w1.weight[int(ids[b, t + k])]
                    z = draft.lm_head(h) + draft.markov_head.markov_w2(e)
                    total += 0.5 ** (k - 1) * float(F.cross_entropy(z[None], torch.tensor([y])))
                    n += 1
                    c = float(draft.confidence_head.proj(torch.cat([h, e])))
                    hit = float(int(z.argmax()) == y)
                    bce += -(hit * math.log(1 / (1 + math.exp(-c))) + (1 - hit) * math.log(1 - 1 / (1 + math.exp(-c))))
                    n_conf += 1
    assert n > 20
    assert float(got.detach()) == pytest.approx(total / n + 0.7 * bce / n_conf, rel=1e-5)


def test_chunked_loss_equals_reference_and_trains_both_heads(model, view):
    draft = _draft(view, block_size=4).train()
    batch = random_batch_with_aux(model, draft, b=2, t=20)
    params = [p for p in draft.parameters() if p.requires_grad]  # the mask embedding is the base's row, frozen
    results = []
    for chunked in (True, False):
        draft.zero_grad()
        out = draft.loss(batch, view, LossSection(chunked=chunked, chunk_size=16, teacher_weight=0.5,
                                                  dspark=DSparkLossOptions(position_weights="dpace")))
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in params], [d.top1 for d in out.per_depth]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert results[0][2] == results[1][2]
    draft.zero_grad()
    draft.loss(batch, view, _loss_cfg()).loss.backward()
    for p in (draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight,
              draft.confidence_head.proj.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0
    draft.zero_grad()
    draft.loss(batch, view, _loss_cfg(confidence_weight=0.0)).loss.backward()
    grad = draft.confidence_head.proj.weight.grad
    assert grad is None or float(grad.abs().sum()) == 0  # confidence_weight 0: the head gets no gradient


def test_acceptance_bce_matches_its_twin():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, 4, generator=gen)
    hits, valid = torch.rand(5, 4, generator=gen) > 0.5, torch.rand(5, 4, generator=gen) > 0.3
    torch.testing.assert_close(acceptance_bce(z, hits, valid), acceptance_bce_reference(z, hits, valid))
    assert float(acceptance_bce(z, hits, torch.zeros_like(valid))) == 0.0


# -- decoding -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(model, view, prompts):
    """A draft that memorised the base's own greedy continuations of the test prompts."""
    torch.manual_seed(0)
    draft = DSparkDraft(view, num_layers=2, block_size=4, markov_rank=16, num_anchors=64)
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_draft(draft, [batch], view, _loss_cfg(position_weights="decay"), steps=30, lr=2e-2)
    finally:
        torch.set_num_threads(threads)
    return draft.eval()


@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
def test_lossless_with_a_random_draft(model, view, prompts, ar_outputs, backend_kind):
    drafter = DSparkDrafter(_draft(view, block_size=4))
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        assert got.tree_nodes == 5 * got.base_steps  # the root + 4 drafts every step


def test_lossless_and_accepting_with_a_trained_draft(model, trained, prompts, ar_outputs):
    assert_lossless_and_accepting(HFBackend(model), DSparkDrafter(trained), prompts, ar_outputs)


def test_confidence_head_learns_acceptance_and_the_cut_shortens_chains(model, view, trained, prompts, ar_outputs):
    """The memorised draft's drafts are accepted and its confidences say so; an untrained head (c = 0.5 at every
    slot: survival 0.5, 0.25, ...) cut at 0.3 drafts one token per step, still lossless."""
    drafter = DSparkDrafter(trained, confidence_cut=0.5)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(HFBackend(model), drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        assert float(drafter.last_confidence.mean()) > 0.8
    torch.manual_seed(0)
    fresh = DSparkDrafter(DSparkDraft(view, num_layers=2, block_size=4, markov_rank=8).eval(), confidence_cut=0.3)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(HFBackend(model), fresh, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        assert torch.all(fresh.last_confidence == 0.5) and got.tree_nodes == 2 * got.base_steps


def test_rejection_sampling_with_dspark_chains_matches_the_base():
    """Sampling: 3 tokens through DSpark chains (deterministic drafts, point masses) with rejection sampling on a
    bigram base; the pair (t2, t3) follows the base's exact distribution."""
    from helpers.bigram_base import rejection_sampling_tv

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tv = rejection_sampling_tv(lambda v: DSparkDrafter(_draft(v, seed=3, block_size=3, rank=4, std=0.5)), 1500,
                                   seed=0)
    finally:
        torch.set_num_threads(threads)
    assert tv < 0.06  # 16 cells: E[TV] of an exact sampler <= 0.042


def test_draft_vocabulary_decodes_losslessly_with_base_ids(model, view, prompts, ar_outputs):
    d2t = torch.tensor(sorted({t for out in ar_outputs for t in out} | {3, 9, 11}))
    drafter = DSparkDrafter(_draft(view, d2t=d2t))
    for prompt, want in zip(prompts, ar_outputs):
        assert speculative_generate(HFBackend(model), drafter, prompt, max_new_tokens=NEW).tokens == want


def test_builder_chain_serving_depth_and_no_static_trees(view):
    draft = _draft(view, block_size=6)
    drafter, info = build_drafter(draft, {"family": "dspark"}, EvalConfig())
    spec = drafter_family("dspark")
    assert drafter.num_speculative_tokens == 6 and drafter.max_nodes == 7
    assert spec.num_speculative_tokens(info, drafter) == 6 and info["num_speculative_tokens"] == 6
    assert spec.shape(info) == "chain of 6" and spec.max_speculative_tokens(draft) == 6
    drafter, info = build_drafter(draft, {"family": "dspark"}, EvalConfig(**chain_overrides("dspark", 3)))
    assert drafter.num_speculative_tokens == 3 and spec.num_speculative_tokens(info, drafter) == 3
    with pytest.raises(ValueError, match="drafts a chain"):
        build_drafter(draft, {"family": "dspark"}, EvalConfig(tree="wide2"))
    with pytest.raises(ValueError, match="1..6"):
        build_drafter(draft, {"family": "dspark"}, EvalConfig(extra={"num_speculative_tokens": 7}))


# -- configs and exports --------------------------------------------------------------------------------------

def test_recipe_loads_and_checks_its_options():
    cfg = load_train_config(["configs/dspark.yaml"])
    assert cfg.draft.family == "dspark" and cfg.draft.dspark.block_size == 8 and cfg.draft.num_heads == 8
    with pytest.raises(ValueError, match="draft.num_heads"):
        load_train_config(["configs/dspark.yaml"], ["draft.dspark.block_size=6"])
    with pytest.raises(ValueError, match="markov_rank"):
        load_train_config(["configs/dspark.yaml"], ["draft.dspark.markov_rank=0"])
    with pytest.raises(ValueError, match="DSpark"):
        load_train_config(["configs/medusa.yaml"], ["draft.dspark.markov_rank=16"])


@pytest.mark.parametrize("d2t", [None, D2T])
def test_specdraft_export_round_trip(model, view, tmp_path, d2t):
    draft = _draft(view, d2t=d2t)
    out = export_specdraft(draft, tmp_path / "exp", "tiny", "fp")
    loaded, _ = load_draft(out, BaseView.from_model(model))
    assert isinstance(loaded, DSparkDraft) and loaded.markov_rank == 8
    for key, value in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


@pytest.mark.parametrize("d2t", [None, D2T])
def test_vllm_export_layout_and_round_trip(model, view, tmp_path, d2t):
    draft = _draft(view, d2t=d2t, block_size=5)
    out = export_vllm(draft, tmp_path / "vllm", {"family": "dspark", "base_model": "tiny"}, view)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["Qwen3DSparkModel"]
    assert cfg["sample_from_anchor"] is True and cfg["markov_rank"] == 8 and cfg["block_size"] == 5
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["markov_head_type"] == "vanilla" and cfg["transformer_layer_config"]["model_type"] == "qwen3"
    assert json.loads((out / SPECULATIVE_CONFIG_FILE).read_text()) == {
        "method": "dspark", "model": str(out.resolve()), "num_speculative_tokens": 5}
    t = load_file(out / "model.safetensors")
    n = 320 if d2t is None else 12
    d = view.hidden_size
    assert t["markov_head.markov_w1.weight"].shape == (320, 8) and t["markov_head.markov_w2.weight"].shape == (n, 8)
    assert t["confidence_head.proj.weight"].shape == (1, d + 8) and t["confidence_head.proj.bias"].shape == (1,)
    assert "mask_embedding" not in t and not (out / "mask_embedding.pt").exists()
    if d2t is not None:  # markov_w2's rows follow the lm_head's, sorted by target id
        order = torch.argsort(d2t)
        torch.testing.assert_close(t["lm_head.weight"], draft.lm_head.weight[order])
        torch.testing.assert_close(t["markov_head.markov_w2.weight"], draft.markov_head.markov_w2.weight[order])
    loaded = load_dspark_speculators(out, view)
    aux = random_batch_with_aux(model, draft, b=1, t=12).aux_hidden[0]
    for m in (draft, loaded):
        m.cache = m.new_cache(16, "cpu", torch.float32)
        m.commit_context(m.cache, aux)
    for root in (5, 100, 250):
        a, b = draft.draft_chain(draft.cache, root), loaded.draft_chain(loaded.cache, root)
        assert a[0].tolist() == b[0].tolist()
        torch.testing.assert_close(a[1], b[1])


def test_recipe_smoke_train_then_cli_eval_is_lossless(tmp_path, clean_env):
    run_dir = tmp_path / "dspark"
    rows = smoke_cli_train(run_dir, "configs/dspark.yaml", ["train.max_steps=4", "draft.num_layers=2",
                                                            "draft.dspark.block_size=4", "draft.num_heads=4",
                                                            "draft.dspark.num_anchors=32",
                                                            "draft.dspark.markov_rank=16"], clean_env())
    assert any(math.isfinite(r.get("loss/head4", math.nan)) for r in rows)
    assert json.loads((run_dir / "export" / "config.json").read_text())["family"] == "dspark"
    heldout = json.loads((run_dir / "heldout.json").read_text())
    assert [d["depth"] for d in heldout["depths"]] == [1, 2, 3, 4]
    report = smoke_cli_eval(run_dir, "chain", [], clean_env())
    assert report["method"] == "dspark" and report["lossless"] is True and report["acceptance_length"] >= 1.0


# -- vLLM ---------------------------------------------------------------------------------------------------------

def dspark_export_on_servable_base(root, block_size: int = 4, steps: int = 40):
    """root/base (vLLM's CPU build serves it: head_dim 32) + root/run/export: a DSpark draft that memorised the
    base's own greedy answers to the smoke eval prompts."""
    from vllm_fixtures import servable_tiny_base

    from eval.harness.prompts import load_eval_prompts
    from models.base import last_hidden_and_aux, load_base
    from models.draft import DraftBatch

    base = load_base(str(servable_tiny_base(root / "base")), dtype="fp32")
    prompts = load_eval_prompts("tests/fixtures/eval_prompts.jsonl", base.tokenizer, num_prompts=3)
    with torch.inference_mode():
        seqs = [base.model.generate(torch.tensor([p.input_ids]), max_new_tokens=160, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0] for p in prompts]
    ids = torch.zeros(len(seqs), max(s.numel() for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()], mask[b, : s.numel()] = s, 1
    view = BaseView.from_model(base.model)
    torch.manual_seed(0)
    draft = DSparkDraft(view, num_layers=2, block_size=block_size, markov_rank=16, num_anchors=256)
    h, aux = last_hidden_and_aux(base.model, ids, None, draft.aux_layers)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_draft(draft, [DraftBatch(h, ids, mask, aux)], view,
                  LossSection(chunk_size=256, dspark=DSparkLossOptions(position_weights="decay")), steps=steps, lr=1e-2)
    finally:
        torch.set_num_threads(threads)
    return export_specdraft(draft.eval(), root / "run" / "export", base.name, base.fingerprint)


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_vllm_cpu_build_refuses_dspark(tmp_path, capsys):
    """vLLM 0.32's CPU build reads the export (it resolves Qwen3DSparkModel) but cannot serve it: DSpark's proposer
    exists only in Model Runner V2, which needs Triton's CPU backend this build lacks, and the V1 runner refuses the
    method (docs/families/dspark.md#vllm). When this fails, vLLM serves DSpark on a CPU: turn it into the per-position
    acceptance comparison DFlash's serving test makes."""
    from cli.main import main

    export = dspark_export_on_servable_base(tmp_path)
    rc = main(["serve-check", "--draft", str(export), "--config", "configs/eval/smoke.yaml", "max_new_tokens=150",
               "serve_enforce_eager=true"])
    err = capsys.readouterr().err
    assert rc != 0 and "Model Runner V1 does not support: dspark speculative decoding" in err, err[-3000:]
    log = (tmp_path / "run" / "serve_check" / "smoke" / "vllm" / "vllm_draft.log").read_text()
    assert "Resolved architecture: Qwen3DSparkModel" in log
