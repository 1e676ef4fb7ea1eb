"""Medusa heads: distinct modules, offsets (head k learns x_{t+1+k}), share_lm_head."""

import pytest
import torch
from conftest import assert_chunked_matches_reference, fit_draft
from helpers.drafts import random_ids_and_hidden, teacher_loss_sum_by_hand, tiny_view

from data.targets import offset_labels
from models.draft import DraftBatch
from models.families.medusa.model import MedusaDraft
from train.config import LossSection


def test_parameters_are_distinct_modules():
    view = tiny_view()
    d, v = view.hidden_size, view.vocab_size
    draft = MedusaDraft(num_heads=3, num_layers=2, base=view)
    unique = {id(p) for p in draft.parameters()}
    assert len(unique) == len(list(draft.parameters()))
    expected = 3 * (2 * (d * d + d) + v * d)  # per head: 2 ResBlocks (W, b) + own LM head
    assert sum(p.numel() for p in draft.parameters()) == expected
    # Own LM heads start as copies of the base lm_head but are separate tensors.
    w0, w1 = draft.head_weight(1), draft.head_weight(2)
    assert torch.equal(w0, view.lm_head_weight) and w0.data_ptr() != w1.data_ptr()


def test_share_lm_head_trains_only_resblocks_and_exports_no_lm_head():
    view = tiny_view()
    draft = MedusaDraft(num_heads=2, num_layers=1, base=view, share_lm_head=True)
    d = view.hidden_size
    assert sum(p.numel() for p in draft.parameters()) == 2 * (d * d + d)
    assert all("shared_lm_head" not in k for k in draft.state_dict())
    assert draft.head_weight(1) is view.lm_head_weight


def test_fresh_head_predicts_what_the_base_predicts():
    # Zero-initialised ResBlock weights: a new head = base lm_head on h_t plus a constant SiLU(b) shift.
    view = tiny_view()
    draft = MedusaDraft(num_heads=2, num_layers=1, base=view)
    for blk in [draft.heads[0][0], draft.heads[1][0]]:
        torch.nn.init.zeros_(blk.linear.bias)
    h = torch.randn(5, view.hidden_size)
    logits = draft(h)
    assert logits.shape == (2, 5, view.vocab_size)
    torch.testing.assert_close(logits[0], h @ view.lm_head_weight.T)


def test_head_k_learns_the_token_at_offset_1_plus_k():
    """Memorisation: with h_t carrying the identity of position t, head k can fit x_{t+1+k}."""
    torch.manual_seed(0)
    view = tiny_view()
    T, K = 24, 3
    ids, mask, hidden = random_ids_and_hidden(view, 1, T)  # hidden: a distinct random state per position
    draft = MedusaDraft(num_heads=K, num_layers=1, base=view)
    _, out = fit_draft(draft, [DraftBatch(hidden, ids, mask)], view, LossSection(chunk_size=7), steps=150, lr=3e-2)
    assert out.loss.item() < 0.05
    with torch.no_grad():
        logits = draft(hidden[0])  # [K, T, V]
    for k in range(1, K + 1):
        labels = offset_labels(ids, mask, 1 + k)[0]
        valid = labels != -100
        assert valid.sum() == T - 1 - k
        assert torch.equal(logits[k - 1][valid].argmax(-1), labels[valid])
        # ... and not the token one position earlier (the offset rule is exact, not off by one).
        earlier = ids[0, k:T - 1][: int(valid.sum())]  # x_{t+k} for the same positions t
        assert (logits[k - 1][valid].argmax(-1) == earlier).float().mean() < 0.5


def test_chunked_and_plain_loss_agree_on_medusa():
    torch.manual_seed(1)
    view = tiny_view()
    ids, mask, hidden = random_ids_and_hidden(view, 2, 16)
    mask[:, :4] = 0  # a user turn
    draft = MedusaDraft(num_heads=3, num_layers=1, base=view)
    batch = DraftBatch(hidden, ids, mask)
    per_depth, _ = assert_chunked_matches_reference(draft, batch, view, chunk_size=5, teacher_weight=0.3)
    # 2 rows x (13 - (1+k)) valid targets per head
    assert [s.count for s in per_depth] == [22, 20, 18]


def test_inference_forward_equals_per_head_logits():
    """The batched shared-head forward (decode fast path) against its per-head twin."""
    view = tiny_view()
    for share in (True, False):
        draft = MedusaDraft(num_heads=3, num_layers=2, base=view, share_lm_head=share)
        for p in draft.parameters():
            torch.nn.init.normal_(p, std=0.05)
        h = torch.randn(4, view.hidden_size)
        expected = torch.stack([draft.head_trunk(k, h) @ draft.head_weight(k).T for k in (1, 2, 3)])
        torch.testing.assert_close(draft(h), expected)


def test_teacher_loss_targets_the_base_distribution_at_t_plus_k():
    """alpha=1: head k's loss is the soft CE to softmax(lm_head(h_{t+k})), the base's own prediction of
    x_{t+1+k}, summed over positions with a valid depth-k target (computed here by hand)."""
    torch.manual_seed(3)
    view = tiny_view()
    ids, mask, hidden = random_ids_and_hidden(view, 2, 12)
    mask[1, :3] = 0
    draft = MedusaDraft(num_heads=2, num_layers=1, base=view)
    out = draft.loss(DraftBatch(hidden, ids, mask), view, LossSection(teacher_weight=1.0, chunk_size=4))

    def head_logits(k, b, t):  # head k on h_t alone
        return draft.head_trunk(k, hidden[b, t][None])[0] @ draft.head_weight(k).T

    for k in (1, 2):
        total = teacher_loss_sum_by_hand(hidden, ids, mask, view.lm_head_weight, k, head_logits)
        assert out.per_depth[k - 1].loss_sum == pytest.approx(total, rel=1e-5)
