"""Domino: training blocks equal inference blocks, every slot drafting; the GRU correction decoded left to right equals
a hand loop with PyTorch's GRU equations; the loss against a hand computation (correction from the true earlier
tokens, the uncorrected prefix, the backbone's own CE at base_weight, decay weights), chunked == reference; greedy
losslessness (random and trained drafts, both backends, a draft vocabulary, rejection sampling); the builder; the
specdraft export round trip and the engines that refuse it; the recipe's smoke train -> CLI eval."""

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
from torch.nn import functional as F

from data.targets import offset_labels
from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import build_drafter, chain_overrides, drafter_family
from eval.harness.config import EvalConfig
from models.draft import BaseView
from models.export.formats import export_vllm
from models.export.schema import ExportError
from models.export.specdraft import export_specdraft, load_draft, read_export_config
from models.families.domino.drafter import DominoDrafter
from models.families.domino.model import DominoDraft, DominoLossOptions
from train.config import LossSection, load_train_config

D2T = torch.tensor([7, 3, 100, 250, 64, 9, 11, 12, 13, 200, 201, 5])  # hand-made base ids, not sorted


def _draft(view, seed=0, d2t=None, block_size=4, gru=6, width=5, prefix_len=1, std=0.2, **kw):
    torch.manual_seed(seed)
    draft = DominoDraft(with_draft_vocab(view, d2t), num_layers=2, block_size=block_size, gru_hidden=gru,
                        correction_dim=width, prefix_len=prefix_len, num_anchors=64, **kw)
    perturb(draft, std, seed=seed)  # W_out off zero too
    with torch.no_grad():  # the mask slots' input stays the base's row (frozen)
        draft.mask_embedding.copy_(view.embed_weight[draft.mask_token_id])
    return draft.eval()


def _loss_cfg(**kw):
    return LossSection(chunk_size=64, domino=DominoLossOptions(**kw))


def _gru_step(gru, x, h):
    """PyTorch's GRU cell without biases, written out (gates r, z, n in weight_ih / weight_hh row order)."""
    wi, wh = gru.weight_ih_l0, gru.weight_hh_l0
    gi, gh = wi @ x, wh @ h
    n_ = h.numel()
    r = torch.sigmoid(gi[:n_] + gh[:n_])
    z = torch.sigmoid(gi[n_:2 * n_] + gh[n_:2 * n_])
    n = torch.tanh(gi[2 * n_:] + r * gh[2 * n_:])
    return (1 - z) * n + z * h


def _hand_logits(draft, h, prev):
    """Slot logits by hand: h [K, d] normed outputs, prev [K] the token before each slot -> [K, N]."""
    gru, proj = draft.correction.prefix_gru, draft.correction.embed_proj
    g = torch.zeros(draft.gru_hidden)
    rows = []
    for k in range(h.shape[0]):
        g = _gru_step(gru, draft.embed[int(prev[k])], g)
        z = h[k] @ draft.lm_head.weight.T
        if k >= draft.prefix_len:
            z = z + proj[2].weight @ F.silu(proj[0].weight @ torch.cat([h[k], g]))
        rows.append(z)
    return torch.stack(rows)


# -- the model ------------------------------------------------------------------------------------------------

def test_every_slot_drafts_and_training_blocks_equal_inference(model, view):
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


@pytest.mark.parametrize("prefix_len", [0, 1, 2])
def test_chain_is_decoded_left_to_right_with_the_gru_correction(model, view, prefix_len):
    """draft_chain = the hand loop: g after the root and the drafts so far, z_k = lm_head(h_k) + W_out SiLU(W_in
    [h_k; g_k]) from slot prefix_len on, d_k = argmax z_k."""
    draft = _draft(view, block_size=5, std=0.5, prefix_len=prefix_len)
    with torch.no_grad():
        draft.correction.embed_proj[2].weight.mul_(30.0)  # a correction that matters next to the slots' logits
    aux = random_batch_with_aux(model, draft, b=1, t=10).aux_hidden[0]
    cache = draft.new_cache(16, "cpu", torch.float32)
    draft.commit_context(cache, aux)
    root = 17
    drafts, logits = draft.draft_chain(cache, root)
    with torch.no_grad():
        h = draft.norm(draft.draft_block_outputs(cache, root))
        want_logits = _hand_logits(draft, h, [root, *drafts.tolist()[:-1]])  # from the drafts before each slot
        plain = (h @ draft.lm_head.weight.T).argmax(-1).tolist()
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    want = want_logits.argmax(-1).tolist()
    assert drafts.tolist() == want
    assert want[:prefix_len] == plain[:prefix_len]  # the uncorrected prefix is the backbone's own argmax
    assert want != plain  # the correction changed some draft
    # a shorter chain runs a shorter block (the slots see each other), decoded the same way
    short, short_logits = draft.draft_chain(cache, root, 3)
    with torch.no_grad():
        h3 = draft.norm(draft.draft_block_outputs(cache, root, 3))
        torch.testing.assert_close(short_logits, _hand_logits(draft, h3, [root, *short.tolist()[:-1]]), rtol=1e-5,
                                   atol=1e-5)
    assert short.tolist() == short_logits.argmax(-1).tolist()


def test_a_fresh_draft_drafts_like_its_backbone(view, model):
    """W_out starts at zero: no correction until training moves it (a fresh Domino is a DFlash whose root slot
    drafts too)."""
    torch.manual_seed(0)
    draft = DominoDraft(view, num_layers=2, block_size=4, gru_hidden=8, correction_dim=4).eval()
    assert float(draft.correction.embed_proj[2].weight.detach().abs().sum()) == 0
    cache = draft.new_cache(16, "cpu", torch.float32)
    draft.commit_context(cache, random_batch_with_aux(model, draft, b=1, t=9).aux_hidden[0])
    with torch.no_grad():
        h = draft.norm(draft.draft_block_outputs(cache, 5))
    assert draft.draft_chain(cache, 5)[0].tolist() == (h @ draft.lm_head.weight.T).argmax(-1).tolist()


def test_loss_matches_a_hand_computation(model, view):
    """Eval mode scores every anchor: row (t, k) = CE(z, x_{t+1+k}) with z the hand logits of slot k-1 from the
    true tokens x_{t+1} .. x_{t+k}, plus base_weight · CE(lm_head(h), x_{t+1+k}); weights lambda0·decay^(k-1);
    Σ w·ℓ / n."""
    draft = _draft(view, block_size=3, gru=4, width=3, std=0.3)
    batch = random_batch_with_aux(model, draft, b=2, t=12)
    cfg = LossSection(teacher_weight=0.0, lambda0=1.0, decay=0.5, domino=DominoLossOptions(
        position_weights="decay", base_weight=0.4))
    got = draft.loss(batch, view, cfg).loss
    ids, mask = batch.input_ids, batch.loss_mask
    total, n = 0.0, 0
    with torch.no_grad():
        for b in range(2):
            labels = torch.stack([offset_labels(ids[b:b + 1], mask[b:b + 1], 1 + k)[0] for k in (1, 2, 3)], -1)
            anchors = (labels[:, 0] != -100).nonzero().flatten()
            out = draft.block_outputs(batch.aux_hidden[b:b + 1], ids[b:b + 1], anchors[None])[0]  # [A, 3, d]
            for a, t in enumerate(anchors.tolist()):
                h = draft.norm(out[a])
                prev = [int(ids[b, min(t + k, ids.shape[1] - 1)]) for k in (1, 2, 3)]
                z = _hand_logits(draft, h, prev)
                base = h @ draft.lm_head.weight.T
                for k in (1, 2, 3):
                    y = int(labels[t, k - 1])
                    if y == -100:
                        continue
                    w = 0.5 ** (k - 1)
                    total += w * float(F.cross_entropy(z[k - 1][None], torch.tensor([y])))
                    total += 0.4 * w * float(F.cross_entropy(base[k - 1][None], torch.tensor([y])))
                    n += 1
    assert n > 20
    assert float(got.detach()) == pytest.approx(total / n, rel=1e-5)


def test_chunked_loss_equals_reference_and_trains_the_correction(model, view):
    draft = _draft(view, block_size=4).train()
    batch = random_batch_with_aux(model, draft, b=2, t=20)
    params = [p for p in draft.parameters() if p.requires_grad]
    results = []
    for chunked in (True, False):
        draft.zero_grad()
        out = draft.loss(batch, view, LossSection(chunked=chunked, chunk_size=16, teacher_weight=0.5,
                                                  domino=DominoLossOptions(position_weights="dpace")))
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in params], [d.top1 for d in out.per_depth]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert results[0][2] == results[1][2]
    draft.zero_grad()
    draft.loss(batch, view, _loss_cfg(base_weight=0.0)).loss.backward()
    corr = draft.correction
    for p in (corr.prefix_gru.weight_ih_l0, corr.prefix_gru.weight_hh_l0, corr.embed_proj[0].weight,
              corr.embed_proj[2].weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0


# -- decoding -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(model, view, prompts):
    """A draft that memorised the base's own greedy continuations of the test prompts."""
    torch.manual_seed(0)
    draft = DominoDraft(view, num_layers=2, block_size=4, gru_hidden=16, correction_dim=16, num_anchors=64)
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
    drafter = DominoDrafter(_draft(view, block_size=4, std=0.5))
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    for prompt, want in zip(prompts, ar_outputs):
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
        assert got.tokens == want
        assert got.tree_nodes == 5 * got.base_steps  # the root + 4 drafts every step


def test_lossless_and_accepting_with_a_trained_draft(model, trained, prompts, ar_outputs):
    """Also the field benchmark's simulated acceptance equals the decoded run (assert_simulation_exact)."""
    assert_lossless_and_accepting(HFBackend(model), DominoDrafter(trained), prompts, ar_outputs)


def test_draft_vocabulary_decodes_losslessly_with_base_ids(model, view, prompts, ar_outputs):
    d2t = torch.tensor(sorted({t for out in ar_outputs for t in out} | {3, 9, 11}))
    drafter = DominoDrafter(_draft(view, d2t=d2t, std=0.5))
    for prompt, want in zip(prompts, ar_outputs):
        assert speculative_generate(HFBackend(model), drafter, prompt, max_new_tokens=NEW).tokens == want


def test_rejection_sampling_with_domino_chains_matches_the_base():
    """Sampling: 3 tokens through Domino chains (deterministic drafts, point masses) with rejection sampling on a
    bigram base; the pair (t2, t3) follows the base's exact distribution."""
    from helpers.bigram_base import rejection_sampling_tv

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tv = rejection_sampling_tv(lambda v: DominoDrafter(_draft(v, seed=3, block_size=3, gru=4, width=3, std=0.5)),
                                   1500, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert tv < 0.06  # 16 cells: E[TV] of an exact sampler <= 0.042


def test_builder_chain_serving_depth_and_no_static_trees(view):
    draft = _draft(view, block_size=6)
    drafter, info = build_drafter(draft, {"family": "domino"}, EvalConfig())
    spec = drafter_family("domino")
    assert drafter.num_speculative_tokens == 6 and drafter.max_nodes == 7
    assert spec.num_speculative_tokens(info, drafter) == 6 and info["num_speculative_tokens"] == 6
    assert spec.shape(info) == "chain of 6" and spec.max_speculative_tokens(draft) == 6
    assert spec.tune_shapes(draft) == []
    drafter, info = build_drafter(draft, {"family": "domino"}, EvalConfig(**chain_overrides("domino", 3)))
    assert drafter.num_speculative_tokens == 3 and spec.num_speculative_tokens(info, drafter) == 3
    with pytest.raises(ValueError, match="drafts a chain"):
        build_drafter(draft, {"family": "domino"}, EvalConfig(tree="wide2"))
    with pytest.raises(ValueError, match="1..6"):
        build_drafter(draft, {"family": "domino"}, EvalConfig(extra={"num_speculative_tokens": 7}))


# -- configs and exports --------------------------------------------------------------------------------------

def test_recipe_loads_and_checks_its_options():
    cfg = load_train_config(["configs/domino.yaml"])
    assert cfg.draft.family == "domino" and cfg.draft.domino.block_size == 8 and cfg.draft.num_heads == 8
    with pytest.raises(ValueError, match="draft.num_heads"):
        load_train_config(["configs/domino.yaml"], ["draft.domino.block_size=6"])
    with pytest.raises(ValueError, match="prefix_len"):
        load_train_config(["configs/domino.yaml"], ["draft.domino.prefix_len=8"])
    with pytest.raises(ValueError, match="base_weight"):
        load_train_config(["configs/domino.yaml"], ["loss.domino.base_weight=-1"])
    with pytest.raises(ValueError, match="Domino"):
        load_train_config(["configs/dspark.yaml"], ["draft.domino.gru_hidden=16"])


@pytest.mark.parametrize("d2t", [None, D2T])
def test_specdraft_export_round_trip(model, view, tmp_path, d2t):
    draft = _draft(view, d2t=d2t, prefix_len=2)
    out = export_specdraft(draft, tmp_path / "exp", "tiny", "fp")
    cfg = read_export_config(out)  # its own keys pass the schema through FamilyFacts.export_key_types
    assert (cfg["gru_hidden"], cfg["correction_dim"], cfg["prefix_len"]) == (6, 5, 2)
    loaded, _ = load_draft(out, BaseView.from_model(model))
    assert isinstance(loaded, DominoDraft) and loaded.prefix_len == 2
    for key, value in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    aux = random_batch_with_aux(model, draft, b=1, t=12).aux_hidden[0]
    for m in (draft, loaded):
        m.cache = m.new_cache(16, "cpu", torch.float32)
        m.commit_context(m.cache, aux)
    for root in (5, 100, 250):
        assert draft.draft_chain(draft.cache, root)[0].tolist() == loaded.draft_chain(loaded.cache, root)[0].tolist()
    bad = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**bad, "gru_hidden": "six"}))
    with pytest.raises(ExportError, match="gru_hidden"):
        read_export_config(out)


def test_serving_engines_refuse_with_the_formats_it_has(view, tmp_path):
    """vLLM 0.32 and llama.cpp have no Domino method: the export names what does run it."""
    from eval.serving.llamacpp_gguf import draft_gguf

    draft = _draft(view)
    with pytest.raises(ValueError, match=r"vLLM cannot serve a 'domino' draft.*formats for domino: specdraft"):
        export_vllm(draft, tmp_path / "vllm", {"family": "domino", "base_model": "tiny"}, view)
    with pytest.raises(ValueError, match="llama.cpp serves .* drafts; this draft is 'domino'"):
        draft_gguf(draft, {"family": "domino"}, tmp_path, tmp_path / "d.gguf", "f32")
    assert not (tmp_path / "vllm").exists()


def test_recipe_smoke_train_then_cli_eval_is_lossless(tmp_path, clean_env, capsys):
    from cli.main import main

    run_dir = tmp_path / "domino"
    rows = smoke_cli_train(run_dir, "configs/domino.yaml", ["train.max_steps=4", "draft.num_layers=2",
                                                            "draft.domino.block_size=4", "draft.num_heads=4",
                                                            "draft.domino.num_anchors=32", "draft.domino.gru_hidden=16",
                                                            "draft.domino.correction_dim=8"], clean_env())
    assert any(math.isfinite(r.get("loss/head4", math.nan)) for r in rows)
    assert json.loads((run_dir / "export" / "config.json").read_text())["family"] == "domino"
    heldout = json.loads((run_dir / "heldout.json").read_text())
    assert [d["depth"] for d in heldout["depths"]] == [1, 2, 3, 4]
    report = smoke_cli_eval(run_dir, "chain", [], clean_env())
    assert report["method"] == "domino" and report["lossless"] is True and report["acceptance_length"] >= 1.0
    capsys.readouterr()
    for fmt in ("vllm", "gguf"):  # one line naming the format it has (vLLM / llama.cpp have no Domino method)
        assert main(["export", "--run", str(run_dir), "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err
        assert f"--format {fmt}: " in err and "domino draft exports as specdraft" in err.lower(), err
        assert not (tmp_path / fmt).exists()
