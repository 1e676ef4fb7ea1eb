"""ReDrafter model and training: one shared parameter set, the RNN recursion, the no-RNN ablation, the fast
loss against its materialised twin, teacher loss, and a smoke training run whose loss goes down."""

import json

import pytest
import torch
from helpers.drafts import random_ids_and_hidden, teacher_loss_sum_by_hand, tiny_view
from torch.nn import functional as F

from core.config_loader import ConfigError
from data.targets import offset_labels
from models.draft import BaseView, DraftBatch
from models.families.redrafter.model import ReDrafterDraft
from train.config import LossSection, load_train_config


def _randomise(draft, std=0.1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return draft


def test_one_parameter_set_shared_across_depths():
    view = tiny_view()
    d, v = view.hidden_size, view.vocab_size
    counts = {k: sum(p.numel() for p in ReDrafterDraft(k, 2, view).parameters()) for k in (1, 5)}
    # rnn_w (d*d) + rnn_u (d*d + d) + 2 ResBlocks of width 2d + lm_head (2d -> V): independent of K.
    expected = (d * d) + (d * d + d) + 2 * (4 * d * d + 2 * d) + 2 * d * v
    assert counts == {1: expected, 5: expected}
    draft = ReDrafterDraft(5, 2, view)
    assert len({id(p) for p in draft.parameters()}) == len(list(draft.parameters()))  # distinct blocks
    assert draft.layers[0].linear.weight.data_ptr() != draft.layers[1].linear.weight.data_ptr()
    # Tensor names map 1:1 onto the TensorRT-LLM drafter; frozen base tensors are never exported.
    assert set(draft.state_dict()) == {"rnn_w.weight", "rnn_u.weight", "rnn_u.bias", "layers.0.linear.weight",
                                       "layers.0.linear.bias", "layers.1.linear.weight", "layers.1.linear.bias",
                                       "lm_head.weight"}
    shared = ReDrafterDraft(5, 1, view, share_lm_head=True)
    assert set(shared.state_dict()) == {"rnn_w.weight", "rnn_u.weight", "rnn_u.bias", "input_proj.weight",
                                        "input_proj.bias", "layers.0.linear.weight", "layers.0.linear.bias"}
    assert shared.head_weight() is view.lm_head_weight and shared.exit_dim == d
    ablation = ReDrafterDraft(5, 1, view, rnn=False)
    assert not any(k.startswith("rnn_") for k in ablation.state_dict())


def test_fresh_draft_predicts_what_the_base_predicts():
    # lm_head = [W_base | 0] (or input_proj = [I | 0] with the shared head), zero-initialised ResBlocks.
    view = tiny_view()
    h, s = torch.randn(5, view.hidden_size), torch.randn(5, view.hidden_size)
    for share in (False, True):
        draft = ReDrafterDraft(3, 2, view, share_lm_head=share)
        for blk in draft.layers:
            torch.nn.init.zeros_(blk.linear.bias)
        torch.testing.assert_close(draft.logits(h, s), h @ view.lm_head_weight.T)


@pytest.mark.parametrize("rnn", [True, False])
def test_teacher_forced_logits_follow_the_recursion(rnn):
    """Depth i at position t sees h_t and the data tokens x_{t+1..t+i}, through the paper's recursion
    written out by hand (s_0 = 0, SiLU(W e + U s + b)) or, without the RNN, a running sum of embeddings."""
    torch.manual_seed(0)
    view = tiny_view()
    draft = _randomise(ReDrafterDraft(3, 2, view, rnn=rnn))
    ids = torch.randint(3, view.vocab_size, (1, 10))
    hidden = torch.randn(1, 10, view.hidden_size)
    logits = draft.teacher_forced_logits(hidden, ids)  # [K, 1, T, V]
    t = 2
    s = torch.zeros(view.hidden_size)
    for i in range(1, 4):
        e = view.embed_weight[ids[0, t + i]]
        if rnn:
            s = F.silu(draft.rnn_w.weight @ e + draft.rnn_u.weight @ s + draft.rnn_u.bias)
        else:
            s = s + e
        x = torch.cat([hidden[0, t], s])
        for blk in draft.layers:
            x = x + F.silu(blk.linear.weight @ x + blk.linear.bias)
        torch.testing.assert_close(logits[i - 1, 0, t], draft.lm_head.weight @ x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("share", [False, True])
def test_fast_loss_equals_materialised_twin(share):
    """The row-filtered chunked loss (and the plain one) against CE over `teacher_forced_logits` with
    offset_labels: same per-depth sums and counts, same total, same gradients."""
    torch.manual_seed(1)
    view = tiny_view()
    ids, mask, hidden = random_ids_and_hidden(view, 2, 16)
    mask[0, :4] = 0  # a user turn
    mask[1, 9:11] = 0  # another one in the middle: targets must not cross it
    draft = _randomise(ReDrafterDraft(3, 1, view, share_lm_head=share), seed=2)
    batch = DraftBatch(hidden, ids, mask)

    draft.zero_grad()
    logits = draft.teacher_forced_logits(hidden, ids)
    total, sums, counts = 0.0, [], []
    for i in range(1, 4):
        labels = offset_labels(ids, mask, 1 + i).reshape(-1)
        loss_sum = F.cross_entropy(logits[i - 1].reshape(-1, view.vocab_size), labels, ignore_index=-100,
                                   reduction="sum")
        count = int((labels != -100).sum())
        sums.append(float(loss_sum.detach()))
        counts.append(count)
        total = total + 0.9**i * loss_sum / count
    total.backward()
    want_grads = [p.grad.clone() for p in draft.parameters()]
    assert counts[0] > counts[1] > counts[2] > 0

    for chunked in (True, False):
        draft.zero_grad()
        out = draft.loss(batch, view, LossSection(decay=0.9, chunked=chunked, chunk_size=5))
        out.loss.backward()
        assert [s.count for s in out.per_depth] == counts
        assert [s.loss_sum for s in out.per_depth] == pytest.approx(sums, rel=1e-5)
        torch.testing.assert_close(out.loss, total.detach(), rtol=1e-5, atol=1e-5)
        for g, want in zip((p.grad for p in draft.parameters()), want_grads):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


def test_teacher_loss_targets_the_base_distribution_at_t_plus_i():
    """alpha=1: depth i's loss is the soft CE to softmax(lm_head(h_{t+i})), summed over valid rows."""
    torch.manual_seed(3)
    view = tiny_view()
    ids, mask, hidden = random_ids_and_hidden(view, 2, 12)
    mask[1, :3] = 0
    draft = _randomise(ReDrafterDraft(2, 1, view), seed=4)
    out = draft.loss(DraftBatch(hidden, ids, mask), view, LossSection(teacher_weight=1.0, chunk_size=4))
    with torch.no_grad():
        logits = draft.teacher_forced_logits(hidden, ids)
    for i in (1, 2):
        total = teacher_loss_sum_by_hand(hidden, ids, mask, view.lm_head_weight, i,
                                         lambda k, b, t: logits[k - 1, b, t])
        assert out.per_depth[i - 1].loss_sum == pytest.approx(total, rel=1e-5)


def test_prefix_layer_is_rejected_for_redrafter():
    with pytest.raises(ConfigError, match=r"draft\.hydra\.prefix_layer.*Hydra family"):
        load_train_config(["configs/redrafter.yaml", "configs/smoke.yaml"], ["draft.hydra.prefix_layer=true"])


def test_smoke_training_loss_decreases_and_exports(tmp_path):
    from models.export.specdraft import load_draft
    from train.loop import train

    run_dir = tmp_path / "redrafter"
    cfg = load_train_config(["configs/redrafter.yaml", "configs/smoke.yaml"],
                            [f"run_dir={run_dir}", "train.max_steps=12", "train.lr=5e-3", "train.log_every=4",
                             "train.val_batches=0"])
    assert cfg.draft.family == "redrafter" and cfg.draft.num_heads == 5 and cfg.loss.decay == 1.0
    train(cfg)
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [4, 8, 12]
    assert "loss/head5" in rows[0] and "top1/head5" in rows[0]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["family"] == "redrafter" and exported["beam_width"] >= 1 and exported["beam_length"] >= 2
    from models.base import load_base

    base = load_base("tiny")
    draft, _ = load_draft(run_dir / "export", BaseView.from_model(base.model), base.fingerprint)
    assert isinstance(draft, ReDrafterDraft) and draft.num_heads == 5 and draft.num_layers == 2
