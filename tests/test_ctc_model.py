"""CTC draft model: distilled labels (== reference, never across a user turn), module layout, loss
parity chunked vs reference with batch > 1, memorisation, config checks, export round trip, and a
smoke training run whose loss goes down."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_chunked_matches_reference, fit_draft

from core.config_loader import ConfigError
from models.draft import BaseView, DraftBatch
from models.export.specdraft import export_specdraft, load_draft, read_tensors
from models.families.ctc.model import (
    CTCDraft,
    CTCLossOptions,
    distilled_labels,
    distilled_labels_reference,
    valid_starts,
)
from models.tiny import tiny_llama
from train.config import LossSection, load_train_config


@pytest.fixture(scope="module")
def view():
    return BaseView.from_model(tiny_llama(0))


def _batch(seed=0, b=3, t=30, d=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[:, :4] = 0  # system / user prompt
    if b > 2:
        mask[1, 12:17] = 0  # a user turn in the middle of row 1
        mask[2, 20:] = 0  # row 2 is right-padded: far fewer valid starts
    return DraftBatch(torch.randn(b, t, d, generator=g), ids, mask)


def test_distilled_labels_match_reference_and_never_cross_a_user_turn(view):
    batch = _batch()
    n = 4
    for chunk in (1, 7, 1000):
        got = distilled_labels(batch.hidden, view.lm_head_weight, batch.input_ids, batch.loss_mask, n, chunk)
        want = distilled_labels_reference(batch.hidden, view.lm_head_weight, batch.input_ids, batch.loss_mask, n)
        assert torch.equal(got, want)
    valid = got[:, :, 0] != -100
    assert torch.equal(valid, valid_starts(batch.input_ids, batch.loss_mask, n))
    assert torch.equal(valid, (got != -100).all(-1))  # a start has all N labels or none
    for b, t in valid.nonzero().tolist():
        assert batch.loss_mask[b, t + 1: t + 2 + n].sum() == n + 1  # x_{t+1}..x_{t+1+N} all supervised
    # Row 1: starts whose window touches the user turn 12..16 are invalid; 17 onward are fine again.
    assert not valid[1, 7:16].any() and valid[1, 16]
    # Label j is the base's greedy token at t+j (its prediction of x_{t+1+j}), not the data token.
    b, t = valid.nonzero()[0].tolist()
    greedy = (batch.hidden[b] @ view.lm_head_weight.T).argmax(-1)
    assert got[b, t].tolist() == greedy[t + 1: t + 1 + n].tolist()


def test_modules_are_distinct_and_projection_starts_from_the_base_head(view):
    d, v = view.hidden_size, view.vocab_size
    draft = CTCDraft(6, 4, 2, view)
    params = list(draft.parameters())
    assert len({id(p) for p in params}) == len(params)
    assert len(draft.frames) == 6 and draft.frames[0] is not draft.frames[1]
    assert draft.frames[0][0].linear.weight.data_ptr() != draft.frames[1][0].linear.weight.data_ptr()
    w = draft.proj.weight
    assert w.shape == (v + 1, d) and draft.blank == v
    assert torch.equal(w[:v], view.lm_head_weight) and not w[v].any()
    attn = sum(p.numel() for p in draft.attn.parameters())
    assert sum(p.numel() for p in params) == attn + 6 * 2 * (d * d + d) + (v + 1) * d


def test_share_lm_head_trains_only_the_blank_row(view):
    draft = CTCDraft(5, 3, 1, view, share_lm_head=True)
    assert draft.proj is None and draft.blank_row.shape == (1, view.hidden_size)
    assert not any("shared_lm_head" in k for k in draft.state_dict())
    z = torch.randn(2, view.hidden_size)
    logits = draft.frame_logits(z)
    assert logits.shape == (2, 5, view.vocab_size + 1)
    own = CTCDraft(5, 3, 1, view)
    own.load_state_dict({k: v for k, v in draft.state_dict().items() if k != "blank_row"}, strict=False)
    torch.testing.assert_close(logits, own.frame_logits(z))  # same rows, blank row zero in both


@pytest.mark.parametrize("share", [False, True])
def test_chunked_and_reference_loss_agree_with_batch_gt_1(view, share):
    batch = _batch(1)
    torch.manual_seed(0)
    draft = CTCDraft(5, 3, 1, view, share_lm_head=share)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    fused, reference = assert_chunked_matches_reference(draft, batch, view, chunk_size=11,
                                                          ctc=CTCLossOptions(token_weight=0.2))
    expected = int(valid_starts(batch.input_ids, batch.loss_mask, 3).sum())
    per_row = valid_starts(batch.input_ids, batch.loss_mask, 3).sum(1).tolist()
    assert len(set(per_row)) == 3  # rows have different numbers of valid starts
    assert len(fused) == 3
    for a, b in zip(fused, reference):
        assert a.count == b.count == expected and (a.top1, a.topk) == (b.top1, b.topk)
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-5)


def test_memorises_distilled_labels_and_greedy_collapse_reads_them(view):
    """On a fixed batch the CTC loss goes to ~0 and every valid start's greedy collapse spells its label
    (prefix accuracy 1 at every depth): the blank phase of CTC training is left behind."""
    torch.manual_seed(0)
    batch = _batch(2, b=1, t=24)
    draft = CTCDraft(6, 3, 1, view)
    first, out = fit_draft(draft, [batch], view, LossSection(chunk_size=32), steps=30, lr=1e-2)
    assert float(out.loss.detach()) < 0.01 * first
    assert all(s.top1 == s.count > 0 for s in out.per_depth)


def test_config_checks_label_length_against_frames():
    with pytest.raises(ConfigError, match=r"draft\.ctc\.num_frames"):
        load_train_config(["configs/ctc.yaml"], ["draft.num_heads=7"])
    with pytest.raises(ConfigError, match=r"loss\.ctc\.token_weight"):
        load_train_config(["configs/ctc.yaml"], ["loss.ctc.token_weight=-1"])
    cfg = load_train_config(["configs/ctc.yaml", "configs/smoke.yaml"])
    assert cfg.draft.family == "ctc" and cfg.draft.ctc.num_frames == 6 and cfg.draft.num_heads == 4


def test_export_round_trip(view, tmp_path):
    torch.manual_seed(1)
    draft = CTCDraft(4, 2, 1, view, share_lm_head=True)
    with torch.no_grad():
        draft.blank_row.normal_()
    export_specdraft(draft, tmp_path / "export", "tiny", "fp")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["family"] == "ctc" and config["num_frames"] == 4 and config["blank"] == view.vocab_size
    tensors = read_tensors(tmp_path / "export" / "model.safetensors")
    assert "blank_row" in tensors and not any("lm_head" in k for k in tensors)
    loaded, _ = load_draft(tmp_path / "export", view, "fp")
    assert isinstance(loaded, CTCDraft)
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    z = torch.randn(3, view.hidden_size)
    torch.testing.assert_close(loaded.frame_logits(loaded.attn(z[None])[0]), draft.frame_logits(draft.attn(z[None])[0]))


def test_smoke_training_loss_decreases(tmp_path):
    from train.loop import train

    run_dir = tmp_path / "ctc"
    cfg = load_train_config(["configs/ctc.yaml", "configs/smoke.yaml"],
                            [f"run_dir={run_dir}", "train.max_steps=16", "train.lr=5e-3", "train.log_every=4",
                             "train.val_batches=1"])
    train(cfg)
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert "top1/head4" in rows[0] and "top5/head4" in rows[0]
    assert json.loads((run_dir / "export" / "config.json").read_text())["family"] == "ctc"


def test_short_sequences_have_no_valid_start(view):
    for t in (1, 2, 4, 5):
        batch = _batch(3, b=1, t=t)
        batch.loss_mask[:] = 1
        labels = distilled_labels(batch.hidden, view.lm_head_weight, batch.input_ids, batch.loss_mask, 4)
        assert torch.equal(labels, distilled_labels_reference(batch.hidden, view.lm_head_weight, batch.input_ids,
                                                              batch.loss_mask, 4))
        assert int((labels[0, :, 0] != -100).sum()) == max(0, t - 5)  # needs x_{t+1}..x_{t+5} in the sequence
    draft = CTCDraft(6, 4, 1, view)
    out = draft.loss(_batch(3, b=1, t=4), view, LossSection())
    out.loss.backward()  # no valid start: a zero loss that still reaches every parameter (DeepSpeed wants grads)
    assert float(out.loss.detach()) == 0.0 and all(s.count == 0 for s in out.per_depth)
    assert all(p.grad is not None and not p.grad.any() for p in draft.parameters())
