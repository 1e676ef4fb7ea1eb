"""EAGLE-3 draft: aux states, TTT attention (fast == dense-mask twin), the TTT unroll equals step-by-step
inference with the draft's own KV cache, the loss (chunked == reference, hand-computed step weights and
targets), the init, the draft vocabulary and the specdraft export round trip."""

import pytest
import torch
from conftest import assert_chunked_matches_reference, fit_draft
from helpers.drafts import (
    assert_unroll_equals_inference,
    four_layer_tiny_llama,
    random_batch_in_draft_vocab,
    random_batch_with_aux,
    with_draft_vocab,
)
from torch.nn import functional as F

from data.targets import offset_labels
from losses.ttt import ttt_step_weights, ttt_weighted_loss
from models.base import _decoder, last_hidden_and_aux
from models.draft import BaseView
from models.export.specdraft import export_specdraft, load_draft
from models.families.eagle3.model import Eagle3Draft, default_aux_layers
from models.families.eagle3.ttt import ttt_attention, ttt_attention_reference
from models.tiny import tiny_llama
from train.config import LossSection


@pytest.fixture(scope="module")
def base():
    return four_layer_tiny_llama()


@pytest.fixture(scope="module")
def view(base):
    return BaseView.from_model(base)


def _randomize(draft, seed=1):
    """Move every weight off its init so the checks below see a generic draft (zeros would hide bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return draft


def test_default_aux_layers_follow_speculators():
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2
    assert default_aux_layers(32) == [2, 16, 29]  # Llama-3-8B
    assert default_aux_layers(2) == [0, 1]  # the 2-layer test base: clamped, distinct


def test_aux_states_are_layer_outputs(base):
    ids = torch.randint(3, 320, (1, 9))
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for layer in _decoder(base).layers]
    try:
        h, aux = last_hidden_and_aux(base, ids, None, [0, 1, 3])
    finally:
        for hk in hooks:
            hk.remove()
    d = base.config.hidden_size
    torch.testing.assert_close(aux[..., :d], base.get_input_embeddings()(ids))  # id 0 = the embeddings
    torch.testing.assert_close(aux[..., d:2 * d], outs[0])  # id 1 = output of layer 0 (pre final norm)
    torch.testing.assert_close(aux[..., 2 * d:], outs[2])
    with pytest.raises(ValueError, match="draft.aux_layers"):
        last_hidden_and_aux(base, ids, None, [4])  # = L: post-norm in HF, refused


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_matches_dense_mask_twin(steps):
    gen = torch.Generator().manual_seed(steps)
    q = torch.randn(2, 3, 11, 8, generator=gen)
    keys = [torch.randn(2, 3, 11, 8, generator=gen) for _ in range(steps)]
    vals = [torch.randn(2, 3, 11, 8, generator=gen) for _ in range(steps)]
    torch.testing.assert_close(ttt_attention(q, keys, vals), ttt_attention_reference(q, keys, vals),
                               rtol=1e-5, atol=1e-5)


def test_ttt_attention_row_sees_prefix_and_own_steps_only():
    """Changing a key the mask hides (a later row's step-0 key, another row's step-1 key) changes nothing."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 5, 4, generator=gen)
    keys = [torch.randn(1, 1, 5, 4, generator=gen) for _ in range(2)]
    vals = [torch.randn(1, 1, 5, 4, generator=gen) for _ in range(2)]
    out = ttt_attention(q, keys, vals)
    k0, v1 = keys[0].clone(), vals[1].clone()
    k0[..., 3:, :] += 5.0  # rows 3, 4 of step 0: invisible to row 2
    v1[..., 1, :] += 5.0  # row 1's step-1 value: only row 1 sees it
    out2 = ttt_attention(q, [k0, keys[1]], [vals[0], v1])
    torch.testing.assert_close(out2[..., :3, :][..., [0, 2], :], out[..., :3, :][..., [0, 2], :])
    assert not torch.allclose(out2[..., 1, :], out[..., 1, :])


def test_ttt_unroll_equals_incremental_inference(base, view):
    """Step j of row t in training = drafting depth j+1 after committing rows 0..t, feeding the data tokens
    x_{t+1+i} and the draft's own outputs: the TTT mask is exactly what inference sees."""
    draft = _randomize(Eagle3Draft(view, ttt_steps=3)).eval()
    batch = random_batch_with_aux(base, draft, b=1, t=12)
    assert_unroll_equals_inference(draft, batch)


def test_fresh_draft_predicts_from_the_highest_aux_layer(base, view):
    draft = Eagle3Draft(view)
    batch = random_batch_with_aux(base, draft)
    out = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 1)[0]  # o_proj = down_proj = 0: out = fc(aux)
    d = view.hidden_size
    torch.testing.assert_close(out, batch.aux_hidden[:, :-1, -d:])
    want = F.linear(F.rms_norm(out, (d,), base.model.norm.weight, base.config.rms_norm_eps), view.lm_head_weight)
    torch.testing.assert_close(draft.logits(out), want, rtol=1e-5, atol=1e-5)


def test_step_weights_and_weighted_loss_by_hand():
    assert ttt_step_weights(3, 1.0, 0.8) == pytest.approx([1.0, 0.8, 0.64])
    sums, counts = torch.tensor([6.0, 4.0, 9.0]), torch.tensor([3, 2, 0])
    # 1.0 * 6/3 + 0.5 * 4/2 + (no targets: 0)
    assert float(ttt_weighted_loss(sums, counts, [1.0, 0.5, 0.25])) == pytest.approx(3.0)


def test_loss_is_weighted_soft_ce_to_the_base_by_hand(base, view):
    """Recompute every step's loss densely from the unroll: soft CE to softmax(h_{t+1+j} W^T), rows with a
    valid target x_{t+2+j}, weight 0.8^j."""
    draft = _randomize(Eagle3Draft(view, ttt_steps=3))
    batch = random_batch_with_aux(base, draft)
    out = draft.loss(batch, view, LossSection(teacher_weight=1.0, decay=0.8))
    outs = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 3)
    s = batch.input_ids.shape[1] - 1
    want = 0.0
    for j in range(3):
        labels = offset_labels(batch.input_ids, batch.loss_mask, 2 + j)[:, :s]
        valid = labels != -100
        logq = torch.log_softmax(draft.logits(outs[j]), -1)
        teacher = F.pad(batch.hidden[:, 1 + j:], (0, 0, 0, j))[:, :s] @ view.lm_head_weight.T
        ce = -(torch.softmax(teacher, -1) * logq).sum(-1)
        want += 0.8 ** j * ce[valid].mean()
        assert out.per_depth[j].count == int(valid.sum())
        assert out.per_depth[j].top1 == int((logq.argmax(-1) == labels)[valid].sum())
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_chunked_loss_matches_reference(base, view, alpha):
    draft = _randomize(Eagle3Draft(view, ttt_steps=3))
    assert_chunked_matches_reference(draft, random_batch_with_aux(base, draft), view, teacher_weight=alpha,
                                     chunk_size=7)


def test_draft_vocabulary_head_rows_labels_and_misses(base, view):
    d2t = torch.tensor([5, 17, 3, 250, 64, 99, 120, 7])
    small = with_draft_vocab(view, d2t)
    draft = Eagle3Draft(small)
    assert draft.lm_head.weight.shape == (8, view.hidden_size)
    torch.testing.assert_close(draft.lm_head.weight, view.lm_head_weight[d2t])
    assert "d2t" in draft.state_dict() and "t2d" not in draft.state_dict()
    assert draft.export_config()["draft_vocab_size"] == 8
    # Data drawn from the map except one id: every target is countable, the outside ones are misses.
    batch = random_batch_in_draft_vocab(base, draft, d2t)
    for alpha in (0.0, 1.0):
        out = draft.loss(batch, small, LossSection(teacher_weight=alpha))
        assert out.per_depth[0].count == 2 * 14  # outside targets counted (as misses)
        assert torch.isfinite(out.loss)
    first, last = fit_draft(draft, [batch], small, LossSection(teacher_weight=0.0), steps=40, lr=1e-2)
    assert float(last.loss.detach()) < 0.3 * first
    assert 24 <= last.per_depth[0].top1 <= 2 * 14 - 1  # learnt; the target outside the map can never be a hit


def test_memorises_a_batch_and_export_round_trip(base, view, tmp_path):
    draft = Eagle3Draft(view, ttt_steps=2)
    batch = random_batch_with_aux(base, draft)
    first, last = fit_draft(draft, [batch], view, LossSection(teacher_weight=0.0), steps=20, lr=1e-2)
    assert float(last.loss.detach()) < 0.3 * first
    export_specdraft(draft, tmp_path / "export", "tiny4", "fp")
    loaded, cfg = load_draft(tmp_path / "export", view)
    assert cfg["family"] == "eagle3" and cfg["aux_layers"] == draft.aux_layers and cfg["ttt_steps"] == 2
    with torch.no_grad():
        a = draft.eval().ttt_unroll(batch.aux_hidden, batch.input_ids, 2)
        b = loaded.ttt_unroll(batch.aux_hidden, batch.input_ids, 2)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_export_round_trip_with_draft_vocabulary(view, tmp_path):
    d2t = torch.tensor([9, 4, 77, 31])
    small = with_draft_vocab(view, d2t)
    draft = _randomize(Eagle3Draft(small))
    export_specdraft(draft, tmp_path / "e", "tiny4", "fp")
    loaded, _ = load_draft(tmp_path / "e", view)  # the eval side: no map in the view, it comes from the export
    assert torch.equal(loaded.d2t, d2t) and int(loaded.t2d[77]) == 2 and int(loaded.t2d[5]) == -1
    torch.testing.assert_close(loaded.lm_head.weight, draft.lm_head.weight)


def test_two_layer_base_and_bad_config(view):
    tiny = BaseView.from_model(tiny_llama(0))
    assert Eagle3Draft(tiny).aux_layers == [0, 1]
    with pytest.raises(ValueError, match="aux_layers"):
        Eagle3Draft(view, aux_layers=[1, 1, 2])
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3Draft(view, ttt_steps=8)
