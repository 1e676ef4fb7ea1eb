"""DFlash draft: block attention (fast == dense-mask twin, what each slot sees), the mask embedding, the loss (hand-
computed targets, teachers and weights; D-PACE and decay weights by hand; the fast row losses == reference), more
row heads, anchors, the draft vocabulary and memorising a batch. What every block family does (training blocks ==
inference blocks, chunked == reference, the recipe's block rules, the specdraft export round trip) is checked on
DFlash too in tests/test_block_families.py."""

import math

import pytest
import torch
from conftest import fit_draft
from helpers.drafts import four_layer_tiny_llama, random_batch_in_draft_vocab, random_batch_with_aux, with_draft_vocab
from torch.nn import functional as F

from data.targets import offset_labels
from losses.dflash import (
    block_weighted_loss,
    decay_weights,
    dpace_weights,
    linear_row_losses,
    linear_row_losses_reference,
)
from models.draft import BaseView
from models.families.dflash.model import (
    DFlashDraft,
    DFlashLossOptions,
    block_attention,
    block_attention_reference,
    default_mask_token_id,
)
from train.config import LossSection


@pytest.fixture(scope="module")
def base():
    return four_layer_tiny_llama()


@pytest.fixture(scope="module")
def view(base):
    return BaseView.from_model(base)


def _draft(view, **kw):
    torch.manual_seed(kw.pop("seed", 0))
    kw = {"num_layers": 2, "block_size": 4, "num_anchors": 64, **kw}
    return DFlashDraft(view, **kw)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 8, 11), (1, 2, 1, 16, 4, 7)])
def test_block_attention_matches_dense_mask_twin(shape):
    b, h, a, g, hd, t = shape
    gen = torch.Generator().manual_seed(a)
    q, kb, vb = (torch.randn(b, h, a, g, hd, generator=gen) for _ in range(3))
    kc, vc = (torch.randn(b, h, t, hd, generator=gen) for _ in range(2))
    anchors = torch.randint(0, t, (b, a), generator=gen)
    torch.testing.assert_close(block_attention(q, kc, vc, kb, vb, anchors),
                               block_attention_reference(q, kc, vc, kb, vb, anchors), rtol=1e-5, atol=1e-5)


def test_block_sees_context_up_to_its_anchor_and_its_whole_block_only():
    gen = torch.Generator().manual_seed(0)
    q, kb, vb = (torch.randn(1, 1, 2, 3, 4, generator=gen) for _ in range(3))
    kc, vc = (torch.randn(1, 1, 6, 4, generator=gen) for _ in range(2))
    anchors = torch.tensor([[2, 4]])
    out = block_attention(q, kc, vc, kb, vb, anchors)
    kc2, vb2 = kc.clone(), vb.clone()
    kc2[..., 3:, :] += 5.0  # positions 3..5: invisible to block 0 (anchor 2), 3 and 4 visible to block 1
    vb2[:, :, 1, 2] += 5.0  # block 1's last slot: every slot of block 1 sees it (bidirectional), block 0 none
    out2 = block_attention(q, kc2, vc, kb, vb2, anchors)
    torch.testing.assert_close(out2[:, :, 0], out[:, :, 0])
    assert all(not torch.allclose(out2[:, :, 1, s], out[:, :, 1, s]) for s in range(3))


def test_mask_slots_use_the_mask_embedding(view):
    draft = _draft(view, mask_token_id=7)
    with torch.no_grad():
        draft.mask_embedding.fill_(3.0)
    emb = draft.embed_block(torch.tensor([[5, 7, 7]]))
    torch.testing.assert_close(emb[0, 0], view.embed_weight[5])
    assert torch.all(emb[0, 1:] == 3.0)
    assert default_mask_token_id(view.model.config) == 0  # the tiny base's pad token
    frozen = _draft(view, learned_mask=False)
    assert not frozen.mask_embedding.requires_grad
    torch.testing.assert_close(frozen.mask_embedding, view.embed_weight[0])


def test_decay_and_dpace_weights_by_hand():
    torch.testing.assert_close(decay_weights(3), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)],
                                                              dtype=torch.float64))
    # One block of 3 slots, losses l: confidence q = e^-l, s = (q + 1) / 2 (alpha 0.5); slot 3 invalid.
    loss = torch.tensor([[math.log(2.0), math.log(4.0), 1.0]])
    valid = torch.tensor([[True, True, False]])
    s1, s2 = 0.75, 0.625
    want = torch.tensor([[s1 + s1 * s2, s1 * s2, 0.0]])
    torch.testing.assert_close(dpace_weights(loss, valid, 0.5), want)
    # alpha = 1: no confidence at all, w_k = number of valid slots from k on.
    torch.testing.assert_close(dpace_weights(torch.rand(2, 4), torch.ones(2, 4, dtype=torch.bool), 1.0),
                               torch.tensor([[4.0, 3, 2, 1]] * 2))
    rows = torch.tensor([[2.0, 4.0, 9.0]], requires_grad=True)
    out = block_weighted_loss(rows, torch.tensor([[1.0, 0.5, 7.0]]), valid)
    assert float(out.detach()) == pytest.approx((2.0 + 0.5 * 4.0) / 2)


@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_row_losses_fast_path_matches_reference(alpha):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(13, 8, generator=gen, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (13,), generator=gen)
    labels[[2, 7]] = -100
    teacher = {"teacher_hidden": torch.randn(13, 6, generator=gen), "teacher_weight": torch.randn(11, 6, generator=gen),
               "soft_weight": alpha}
    results = []
    for fn in (linear_row_losses, linear_row_losses_reference):
        hidden.grad = weight.grad = None
        rows, top1, topk = fn(hidden, weight, labels, chunk_size=4, topk=3, **teacher)
        (rows * torch.arange(13.0)).sum().backward()  # distinct row weights: each row's gradient is checked
        results.append((rows.detach(), top1, topk, hidden.grad.clone(), weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert float(results[0][0][2]) == 0.0 and not results[0][1][2]
    want = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="none")
    if alpha == 0:
        torch.testing.assert_close(results[0][0], want.detach())


def test_loss_targets_teachers_and_weights_by_hand(base, view):
    """Recompute the loss densely: every valid anchor t (depth-1 target valid), slot k targets x_{t+1+k}, soft
    CE to softmax(h_{t+k} W^T), decay weights, mean over valid rows."""
    draft = _draft(view)
    batch = random_batch_with_aux(base, draft)
    cfg = LossSection(teacher_weight=1.0, dflash=DFlashLossOptions(position_weights="decay"), lambda0=1.0, decay=0.5)
    out = draft.loss(batch, view, cfg)
    ids, mask = batch.input_ids, batch.loss_mask
    num, n = 0.0, 0
    for b in range(2):
        anchors = (offset_labels(ids, mask, 2)[b] != -100).nonzero().flatten()
        logits = draft.logits(draft.block_outputs(batch.aux_hidden[b:b + 1], ids[b:b + 1], anchors[None]))[0]
        for i, t in enumerate(anchors.tolist()):
            assert mask[b, t + 1] and mask[b, t + 2]
            for k in range(1, 4):
                if t + 1 + k >= ids.shape[1] or not bool(mask[b, t + 1:t + 2 + k].all()):
                    continue
                p = torch.softmax(batch.hidden[b, t + k] @ view.lm_head_weight.T, -1)
                num = num + 0.5 ** (k - 1) * -(p * torch.log_softmax(logits[i, k], -1)).sum()
                n += 1
    assert sum(s.count for s in out.per_depth) == n
    torch.testing.assert_close(out.loss, (num / n).detach(), rtol=1e-5, atol=1e-5)


def test_more_row_heads_add_their_weighted_loss(base, view):
    """BlockDraft.more_row_features: a head scored on the same rows, labels and position weights adds scale times
    its loss (here the block's own logits again: the loss grows by exactly that factor), statistics unchanged."""
    class TwoHeads(DFlashDraft):
        def more_row_features(self, out, prev, loss_cfg):
            return [(0.5, self.row_features(out, prev))]

    draft = _draft(view).eval()
    twice = TwoHeads(view, num_layers=2, block_size=4, num_anchors=64).eval()
    twice.load_state_dict(draft.state_dict())
    batch = random_batch_with_aux(base, draft)
    cfg = LossSection(teacher_weight=0.5, dflash=DFlashLossOptions(position_weights="dpace"))
    one, both = draft.loss(batch, view, cfg), twice.loss(batch, view, cfg)
    torch.testing.assert_close(both.loss, 1.5 * one.loss)
    assert [d.top1 for d in both.per_depth] == [d.top1 for d in one.per_depth]


def test_anchor_sampling(view):
    draft = _draft(view, num_anchors=3)
    valid = torch.zeros(2, 10, dtype=torch.bool)
    valid[0, [1, 4, 5, 6, 8]] = True
    valid[1, 2] = True
    anchors, ok = draft.sample_anchors(valid, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3) and ok.tolist() == [[True] * 3, [True, False, False]]
    assert set(anchors[0].tolist()) <= {1, 4, 5, 6, 8} and anchors[0].tolist() == sorted(anchors[0].tolist())
    assert anchors[1, 0] == 2
    every, ok = draft.sample_anchors(valid, all_anchors=True)
    assert every[0].tolist() == [1, 4, 5, 6, 8] and int(ok.sum()) == 6


def test_eval_mode_scores_every_anchor_in_chunks(base, view):
    draft = _draft(view, num_anchors=5).eval()
    batch = random_batch_with_aux(base, draft)
    out = draft.loss(batch, view, LossSection())
    for k in range(1, 4):
        assert out.per_depth[k - 1].count == int((offset_labels(batch.input_ids, batch.loss_mask, 1 + k) != -100)
                                                 .sum())


def test_draft_vocabulary_rows_labels_and_misses(base, view):
    d2t = torch.tensor([5, 17, 3, 250, 64, 99, 120, 7])
    small = with_draft_vocab(view, d2t)
    draft = _draft(small, num_layers=1)
    assert draft.lm_head.weight.shape == (8, view.hidden_size)
    torch.testing.assert_close(draft.lm_head.weight, view.lm_head_weight[d2t])
    batch = random_batch_in_draft_vocab(base, draft, d2t)
    for alpha in (0.0, 1.0):
        out = draft.loss(batch, small, LossSection(teacher_weight=alpha))
        assert out.per_depth[0].count == 2 * 14 and out.per_depth[0].oov == 1  # counted, as a miss
        assert torch.isfinite(out.loss)


def test_memorises_a_batch(base, view):
    draft = _draft(view, block_size=3)
    batch = random_batch_with_aux(base, draft)
    first, last = fit_draft(draft, [batch], view, LossSection(teacher_weight=0.0), steps=40, lr=1e-2)
    assert float(last.loss.detach()) < 0.3 * first
    assert last.per_depth[0].top1 >= 0.9 * last.per_depth[0].count
