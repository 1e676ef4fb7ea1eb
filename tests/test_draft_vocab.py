"""Draft vocabulary (data/draft_vocab.py, models/vocab_map.py) across every family: the map (counts, ties,
determinism, cache), losses (permutation invariance, out-of-map targets as misses, chunked == reference,
the restricted teacher), drafting (ids mapped back to base ids, greedy losslessness), exports (round
trip, fits error, refused formats) and one training run with a map."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_chunked_matches_reference
from helpers.drafts import with_draft_vocab

from core.config_loader import ConfigError
from data.draft_vocab import build_draft_vocab, count_targets, coverage, top_n_map, vocab_cache_key
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import autoregressive_generate, speculative_generate
from eval.engine.drafters.drafter import DecodeState
from eval.engine.tree import STATIC_TREES, StaticTree
from losses.fused_linear_ce import fused_linear_cross_entropy, linear_cross_entropy_reference
from models.draft import DraftBatch
from models.export.specdraft import export_medusa, export_specdraft, load_draft, read_tensors
from models.families.ctc.drafter import CTCDrafter
from models.families.ctc.model import CTCDraft, CTCLossOptions
from models.families.hydra.drafter import HydraDrafter
from models.families.hydra.model import HydraDraft
from models.families.medusa.drafter import MedusaDrafter
from models.families.medusa.model import MedusaDraft
from models.families.redrafter.drafter import ReDrafterDrafter
from models.families.redrafter.export_trtllm import export_redrafter_trtllm
from models.families.redrafter.model import ReDrafterDraft
from models.vocab_map import inverse_map
from train.config import LossSection, load_train_config

V, D = 320, 64
TREE3 = [c for c in STATIC_TREES["tree16"] if len(c) <= 3]  # the 3-head drafts below


# ---------------------------------------------------------------------------------------------------
# the map
# ---------------------------------------------------------------------------------------------------


def _rows():
    # Supervised tokens: 5 x3, 7 x3, 2 x2, 9 x1; token 1 appears often but only unsupervised.
    return [{"input_ids": [1, 1, 5, 7, 5, 2], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [1, 1, 1, 7, 7, 5, 2, 9], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1]}]


def test_counts_only_supervised_tokens_and_ties_break_by_smaller_id():
    counts = count_targets(_rows(), 12)
    assert counts.tolist() == [0, 0, 2, 0, 0, 3, 0, 3, 0, 1, 0, 0]
    assert top_n_map(counts, 4).tolist() == [5, 7, 2, 9]  # 5 and 7 tie at 3: smaller id first
    assert top_n_map(counts, 6).tolist() == [5, 7, 2, 9, 0, 1]  # zero counts: ascending ids
    assert top_n_map(counts, 4).dtype == torch.int64
    # Deterministic: shuffled rows give the same map.
    assert torch.equal(top_n_map(count_targets(_rows()[::-1], 12), 4), top_n_map(counts, 4))
    assert coverage(_rows(), torch.tensor([5, 7]), 12) == pytest.approx(6 / 9)
    with pytest.raises(ValueError, match="draft.vocab_size=13"):
        top_n_map(counts, 13)
    with pytest.raises(ValueError, match="another base"):
        count_targets([{"input_ids": [50], "loss_mask": [1]}], 12)


def test_map_cache_key_and_hit(tmp_path):
    rows = _rows()
    k = vocab_cache_key("fp", rows, 4)
    assert k == vocab_cache_key("fp", [dict(r) for r in rows], 4)
    assert len({k, vocab_cache_key("fp2", rows, 4), vocab_cache_key("fp", rows, 3),
                vocab_cache_key("fp", rows[:1], 4)}) == 4
    d2t, hit = build_draft_vocab(rows, 4, 12, base_fingerprint="fp", cache_dir=tmp_path)
    assert not hit and (tmp_path / f"{k}.safetensors").is_file()
    again, hit = build_draft_vocab(rows, 4, 12, base_fingerprint="fp", cache_dir=tmp_path)
    assert hit and torch.equal(again, d2t) and d2t.tolist() == [5, 7, 2, 9]


def test_config_rejects_a_negative_vocab_size():
    with pytest.raises(ConfigError, match="draft.vocab_size"):
        load_train_config(["configs/medusa.yaml", "configs/smoke.yaml"], ["draft.vocab_size=-1"])


# ---------------------------------------------------------------------------------------------------
# families: losses
# ---------------------------------------------------------------------------------------------------


def _build(family, view, d2t=None, seed=0, noise=0.05):
    """A draft of `family` with perturbed parameters; the same seed gives the same trunk weights for any map
    (own LM heads are W[d2t] either way)."""
    torch.manual_seed(seed)
    v = with_draft_vocab(view, d2t)
    draft = {
        "medusa": lambda: MedusaDraft(3, 1, v),
        "medusa_shared": lambda: MedusaDraft(3, 1, v, share_lm_head=True),
        "hydra": lambda: HydraDraft(3, 1, v),
        "hydra_pp": lambda: HydraDraft(3, 2, v, prefix_layer=True),
        "redrafter": lambda: ReDrafterDraft(3, 1, v),
        "redrafter_shared": lambda: ReDrafterDraft(3, 1, v, share_lm_head=True),
        "ctc": lambda: CTCDraft(4, 2, 1, v),
        "ctc_shared": lambda: CTCDraft(4, 2, 1, v, share_lm_head=True),
    }[family]()
    rows = draft.base_rows().shape[0]
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # perturb every parameter but the LM-head rows (those stay W[d2t], map-dependent)
        for p in draft.parameters():
            if not (p.dim() == 2 and p.shape[0] in (V, V + 1, rows, rows + 1)):
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    return draft


def _batch(model, seed=0, b=2, t=24):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (b, t), generator=gen)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    return DraftBatch(hidden, ids, mask)


FAMILIES = ["medusa", "medusa_shared", "hydra", "hydra_pp", "redrafter", "redrafter_shared", "ctc", "ctc_shared"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_permutation_map_changes_nothing(model, view, family):
    """N = V with d2t a permutation: the same draft over relabelled classes; loss, accuracy and per-depth
    counts must equal the full-vocabulary draft's (any mix-up of draft and base ids would break this)."""
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(3))
    batch = _batch(model)
    cfg = LossSection(chunk_size=16, teacher_weight=0.5 if not family.startswith("ctc") else 0.0,
                      ctc=CTCLossOptions(token_weight=0.1))
    full = _build(family, view)
    mapped = _build(family, view, perm)
    assert mapped.d2t.tolist() == perm.tolist() and mapped.draft_vocab_size == V
    a = full.loss(batch, view, cfg)
    b = mapped.loss(batch, with_draft_vocab(view, perm), cfg)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-5)
    for x, y in zip(a.per_depth, b.per_depth):
        assert (x.count, x.top1, x.topk, x.oov, y.oov) == (y.count, y.top1, y.topk, 0, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_small_map_out_of_map_targets_are_misses_and_chunked_matches_reference(model, view, family):
    """N = 40 of 320: the LM heads have N (+ blank) rows initialised from W[d2t]; out-of-map targets carry no
    loss but are scored (count is the full-vocabulary count) as misses (oov); fused == reference."""
    d2t = torch.randperm(V, generator=torch.Generator().manual_seed(4))[:40]
    batch = _batch(model, seed=1)
    draft = _build(family, view, d2t)
    rows = draft.base_rows()
    assert rows.shape == (40, D) and torch.equal(rows, view.lm_head_weight[d2t])
    if hasattr(draft, "head_weight"):
        w = draft.head_weight(1) if family.startswith(("medusa", "hydra")) else draft.head_weight()
        assert w.shape[0] == 40
        if family in ("medusa", "hydra"):
            assert torch.equal(w, view.lm_head_weight[d2t])  # own heads start from the base rows of the map
    if family.startswith("ctc"):
        assert draft.blank == 40 and sum(b.shape[0] for b in draft.projection_blocks()) == 41
    teacher = 0.5 if not family.startswith("ctc") else 0.0
    fused, ref = assert_chunked_matches_reference(draft, batch, with_draft_vocab(view, d2t), chunk_size=16,
                                                  teacher_weight=teacher, ctc=CTCLossOptions(token_weight=0.1))
    full_counts = [s.count for s in _build(family, view).loss(batch, view, LossSection()).per_depth]
    t2d = inverse_map(d2t, V)
    for k, (f, r) in enumerate(zip(fused, ref)):
        assert (f.top1, f.topk, f.oov) == (r.top1, r.topk, r.oov)
        assert f.count == full_counts[k] and f.oov > 0 and f.top1 <= f.count - f.oov
    if family.startswith(("medusa", "hydra", "redrafter")):
        from data.targets import offset_labels
        labels = offset_labels(batch.input_ids, batch.loss_mask, 2)
        labels = labels[labels != -100]
        assert fused[0].oov == int((t2d[labels] < 0).sum())


def test_restricted_teacher_is_the_renormalised_base_distribution():
    """Analytic: soft CE with teacher rows W[d2t] = -sum_v p_v log q_v, p = the base distribution restricted
    to the map and renormalised (computed here from the full softmax), fused and reference alike."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(30, 8, generator=g, dtype=torch.float64)
    h = torch.randn(5, 8, generator=g, dtype=torch.float64)
    th = torch.randn(5, 8, generator=g, dtype=torch.float64)
    d2t = torch.tensor([4, 17, 2, 9, 25, 11])
    labels = torch.tensor([0, 3, 5, -100, 1])
    full = torch.softmax(th @ W.T, dim=-1)[:, d2t]
    p = full / full.sum(-1, keepdim=True)
    logq = torch.log_softmax(h @ W[d2t].T, dim=-1)
    valid = labels != -100
    want = -(p * logq).sum(-1)[valid].sum()
    for fn in (fused_linear_cross_entropy, linear_cross_entropy_reference):
        got, stats = fn(h, W[d2t], labels, chunk_size=2, teacher_hidden=th, teacher_weight=W[d2t], soft_weight=1.0)
        torch.testing.assert_close(got, want)
        assert int(stats.count) == 4


# ---------------------------------------------------------------------------------------------------
# drafting
# ---------------------------------------------------------------------------------------------------


def _drafter(family, draft):
    if family.startswith("medusa"):
        return MedusaDrafter(draft, StaticTree(STATIC_TREES["tree16"][:10]))
    if family.startswith("hydra"):
        return HydraDrafter(draft, StaticTree(STATIC_TREES["tree16"][:10]))
    if family.startswith("redrafter"):
        return ReDrafterDrafter(draft, 3, 4)
    return CTCDrafter(draft, search="joint", num_paths=6, topk=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_are_mapped_back_to_base_ids(model, view, family):
    """With a permutation map the proposed tree (base ids) equals the full-vocabulary draft's tree."""
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, V, (9,), generator=gen)
    with torch.no_grad():
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
    trees = []
    for d2t in (None, perm):
        drafter = _drafter(family, _build(family, view, d2t).eval())
        drafter.reset()
        trees.append(drafter.propose(DecodeState(ids, 7, hidden, ids)))
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist() and trees[0].tokens.numel() > 3
    assert torch.equal(trees[0].parents, trees[1].parents)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_lossless_with_a_small_map(model, view, prompts, family):
    d2t = torch.randperm(V, generator=torch.Generator().manual_seed(6))[:48]
    draft = _build(family, view, d2t, noise=0.1).eval()
    be = HFBackend(model)
    for prompt in prompts:
        want = autoregressive_generate(be, prompt, max_new_tokens=14, eos_ids=None).tokens
        drafter = _drafter(family, draft)
        res = speculative_generate(be, drafter, prompt, max_new_tokens=14, eos_ids=None)
        assert res.tokens == want
        assert res.tree_nodes > res.base_steps  # real trees were verified, not just roots


def test_trained_medusa_with_a_map_is_accepted(model, view, prompts):
    """Heads trained on the base's own continuations with a map that holds their tokens: drafts (mapped to
    base ids) are accepted, so the mapping is right end to end, and the output stays exact."""
    seqs = []
    for p in prompts:
        with torch.inference_mode():
            g = model.generate(p[None], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
            h = model.model(g).last_hidden_state
        m = torch.ones_like(g)
        m[:, : p.numel()] = 0
        seqs.append((g, h, m))
    targets = torch.unique(torch.cat([g[m.bool()] for g, _, m in seqs]))
    fill = torch.tensor([i for i in range(V) if i not in set(targets.tolist())][: 64 - targets.numel()])
    d2t = torch.cat([targets, fill])
    v = with_draft_vocab(view, d2t)
    torch.manual_seed(0)
    draft = MedusaDraft(3, 1, v)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-2)
    for _ in range(40):
        for g, h, m in seqs:
            out = draft.loss(DraftBatch(h.clone(), g, m), v, LossSection(decay=1.0))
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    be = HFBackend(model)
    lengths = []
    for prompt in prompts:
        want = autoregressive_generate(be, prompt, max_new_tokens=20, eos_ids=None).tokens
        res = speculative_generate(be, MedusaDrafter(draft.eval(), StaticTree(TREE3)), prompt, max_new_tokens=20,
                                   eos_ids=None)
        assert res.tokens == want
        lengths.append(res.acceptance_length)
    assert min(lengths) > 1.5


def test_tree_search_ranks_count_out_of_map_tokens_as_misses(model, view):
    d2t = torch.arange(3, 63)  # ids 3..62
    draft = _build("medusa", view, d2t).eval()
    ids = torch.tensor([5, 6, 100, 7, 8, 9, 200, 10, 11])
    with torch.no_grad():
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
    medusa = MedusaDrafter(draft, StaticTree(TREE3)).true_path_ranks(hidden, ids, 2, 10)
    hydra = HydraDrafter(_build("hydra", view, d2t).eval(), StaticTree(TREE3)).true_path_ranks(
        hidden, ids, 2, 10)
    for ranks in (medusa, hydra):
        for t in range(ids.numel()):
            for k in (1, 2):
                if t + 1 + k >= ids.numel():
                    assert ranks[t, k - 1] == -1
                elif int(ids[t + 1 + k]) in (100, 200):  # outside the map: never proposable, a miss
                    assert ranks[t, k - 1] == 10
        assert (ranks[ranks >= 0] < 10).any()  # in-map targets get real ranks


# ---------------------------------------------------------------------------------------------------
# exports
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_with_a_map(tmp_path, model, view, family):
    d2t = torch.randperm(V, generator=torch.Generator().manual_seed(7))[:50]
    draft = _build(family, view, d2t).eval()
    out = export_specdraft(draft, tmp_path / "export", "tiny", "fp")
    cfg = json.loads((out / "config.json").read_text())
    tensors = read_tensors(out / "model.safetensors")
    assert cfg["draft_vocab_size"] == 50 and torch.equal(tensors["d2t"], d2t)
    assert not any(t.shape[0] in (V, V + 1) for k, t in tensors.items() if t.dim() == 2), "full-V rows exported"
    loaded, _ = load_draft(out, view)
    assert torch.equal(loaded.d2t, d2t) and torch.equal(loaded.base_rows(), view.lm_head_weight[d2t])
    batch = _batch(model, seed=2)
    with torch.no_grad():
        a = draft.loss(batch, with_draft_vocab(view, d2t), LossSection())
        b = loaded.loss(batch, view, LossSection())
    torch.testing.assert_close(a.loss, b.loss)


def test_placeholder_map_is_replaced_on_load(view):
    """from_export_config before load_state_dict (the other loaders' path): the shared rows and t2d follow
    the loaded d2t (load_state_dict post-hook)."""
    d2t = torch.randperm(V, generator=torch.Generator().manual_seed(8))[:30]
    src = MedusaDraft(2, 1, with_draft_vocab(view, d2t), share_lm_head=True)
    dst = MedusaDraft.from_export_config(src.export_config(), view)
    assert dst.d2t.tolist() == list(range(30))
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.shared_lm_head, view.lm_head_weight[d2t]) and int(dst.t2d[d2t[3]]) == 3


def test_a_map_that_does_not_fit_the_base_is_a_clear_error(tmp_path, view):
    from safetensors.torch import save_file

    d2t = torch.arange(40)
    out = export_specdraft(MedusaDraft(2, 1, with_draft_vocab(view, d2t)), tmp_path / "e", "tiny", "fp")
    tensors = read_tensors(out / "model.safetensors")
    tensors["d2t"] = torch.arange(V - 20, V + 20)  # ids past the base's 320 tokens
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["model_sha256"]  # an export whose map was written for another base, not a damaged file
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="320 tokens.*another base"):
        load_draft(out, view)


def test_formats_without_a_token_map_refuse_a_draft_vocabulary(tmp_path, view):
    d2t = torch.arange(40)
    with pytest.raises(ValueError, match="no token map"):
        export_medusa(MedusaDraft(2, 1, with_draft_vocab(view, d2t)), tmp_path / "m", {"base_model": "tiny"}, view)
    with pytest.raises(ValueError, match="no\\s+token map"):
        export_redrafter_trtllm(ReDrafterDraft(2, 1, with_draft_vocab(view, d2t)), tmp_path / "r",
                                {"base_model": "tiny"}, view)
    export_medusa(MedusaDraft(2, 1, view), tmp_path / "m", {"base_model": "tiny"}, view)  # full vocabulary: still fine


# ---------------------------------------------------------------------------------------------------
# one training run with a map
# ---------------------------------------------------------------------------------------------------


def test_training_with_a_map_logs_coverage_and_oov(tmp_path):
    from train.loop import train

    run = tmp_path / "run"
    cfg = load_train_config(["configs/hydra.yaml", "configs/smoke.yaml"],
                            [f"run_dir={run}", "draft.vocab_size=24", "train.max_steps=2", f"data.cache_dir={tmp_path}",
                             "draft.num_heads=2"])
    train(cfg)
    export = json.loads((run / "export" / "config.json").read_text())
    assert export["draft_vocab_size"] == 24
    assert 0.5 < export["draft_vocab_coverage_train"] < 1 and 0.5 < export["draft_vocab_coverage_heldout"] < 1
    assert read_tensors(run / "export" / "model.safetensors")["d2t"].shape == (24,)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["draft_vocab_size"] == 24
    assert any("oov/head1" in m for m in metrics)
    heldout = json.loads((run / "heldout.json").read_text())
    assert heldout["depths"][0]["oov"] > 0
    assert list((tmp_path / "draft_vocab").glob("*.safetensors"))


def test_ctc_labels_are_cut_before_the_first_out_of_map_token(model, view):
    """CTC with a map: y = (a, b, X, c) with X outside -> target (a, b), depths 3-4 are misses (oov counts
    the starts whose prefix left the map); a start whose first label is outside carries no loss."""
    d2t = torch.tensor([10, 11, 12, 13, 14])
    draft = CTCDraft(4, 4, 1, with_draft_vocab(view, d2t))
    labels = torch.tensor([[10, 11, 99, 12], [99, 10, 11, 12], [13, 14, 10, 11], [12, 12, 12, 77]])
    mapped, max_lengths, oov = draft._map_labels(labels)
    assert max_lengths.tolist() == [2, 0, 4, 3]
    assert oov == [1, 1, 2, 3]
    assert mapped[0, :2].tolist() == [0, 1] and mapped[2].tolist() == [3, 4, 0, 1]


def test_ctc_loss_with_a_large_map_cuts_labels_and_matches_reference(model, view):
    """A 300-token map of 320: most starts keep their label, some are cut at depth 2; fused == reference
    and the loss equals the reference CTC over each start's cut label (max_lengths), computed here."""
    from losses.ctc import feasible_label_lengths, linear_ctc_reference

    d2t = torch.randperm(V, generator=torch.Generator().manual_seed(9))[:300]
    draft = _build("ctc", view, d2t)
    batch = _batch(model, seed=3, b=3, t=40)
    v = with_draft_vocab(view, d2t)
    fused, ref = assert_chunked_matches_reference(draft, batch, v, chunk_size=16, ctc=CTCLossOptions(token_weight=0.1))
    assert 0 < fused[0].oov < fused[-1].oov < fused[-1].count  # some starts cut, more at deeper depths
    # The reference at the cut lengths (a plain per-row loop over ctc_loss on the truncated labels).
    from models.families.ctc.model import distilled_labels
    lab = distilled_labels(batch.hidden, view.lm_head_weight, batch.input_ids, batch.loss_mask, draft.num_heads)
    valid = lab[:, :, 0] != -100
    mapped, max_lengths, _ = draft._map_labels(lab[valid])
    keep = max_lengths > 0
    with torch.no_grad():
        z = draft.attn(batch.hidden)
        frames = draft.frame_features(z[valid][keep])
        total = 0.0
        for i in range(frames.shape[0]):
            n = int(max_lengths[keep][i])
            y = mapped[keep][i, :n][None]
            loss, _ = linear_ctc_reference(frames[i:i + 1], draft.projection_blocks(), y, blank=draft.blank,
                                           token_weight=0.0)
            assert int(feasible_label_lengths(y, 4)[0]) <= n
            total += float(loss)
        out = draft.loss(batch, v, LossSection(ctc=CTCLossOptions(token_weight=0.0)))
    assert out.loss.item() == pytest.approx(total / int(keep.sum()), rel=1e-5)
