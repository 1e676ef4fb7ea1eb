"""Hydra / Hydra++ heads: exact parameter counts, head inputs and offsets (hand-computed loss), learning
through the path embeddings, chunked == plain loss, prefix layer wiring, export round trip."""

import pytest
import torch
from conftest import assert_chunked_matches_reference, fit_draft
from torch.nn import functional as F

from data.targets import offset_labels
from models.draft import BaseView, DraftBatch
from models.export.specdraft import export_specdraft, load_draft
from models.families.hydra.model import HydraDraft
from models.tiny import tiny_llama
from train.config import LossSection


@pytest.fixture(scope="module")
def base():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def view(base):
    return BaseView.from_model(base)


def _n(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts_are_exact_and_modules_distinct(view):
    d, v = view.hidden_size, view.vocab_size
    draft = HydraDraft(num_heads=3, num_layers=2, base=view)
    params = list(draft.parameters())
    assert len({id(p) for p in params}) == len(params)
    # head k: R [(k+1)d, d] + W, b of block 1 + one ResBlock (d*d + d) + own LM head V*d
    per_head = [2 * (k + 1) * d * d + d + (d * d + d) + v * d for k in (1, 2, 3)]
    assert _n(draft) == sum(per_head)
    assert [_n(h) for h in draft.heads] == per_head
    shared = HydraDraft(num_heads=3, num_layers=2, base=view, share_lm_head=True)
    assert _n(shared) == sum(p - v * d for p in per_head)
    assert shared.head_weight(2) is view.lm_head_weight
    # the frozen embedding and shared head are buffers that never reach the export
    assert all("embed" not in k and "shared_lm_head" not in k for k in shared.state_dict())
    # own LM heads: copies of the base head, separate storage
    assert torch.equal(draft.head_weight(1), view.lm_head_weight)
    assert draft.head_weight(1).data_ptr() != draft.head_weight(2).data_ptr()


def test_prefix_layer_adds_exactly_one_base_decoder_layer(base, view):
    plain = HydraDraft(num_heads=2, num_layers=4, base=view)
    pp = HydraDraft(num_heads=2, num_layers=4, base=view, prefix_layer=True)
    assert _n(pp) - _n(plain) == _n(base.model.layers[-1])
    base_ptrs = {p.data_ptr() for p in base.parameters()}
    assert not any(p.data_ptr() in base_ptrs for p in pp.parameters())
    assert not any(m is base for m in pp.modules())
    with pytest.raises(ValueError, match="BaseView.from_model"):
        HydraDraft(2, 1, BaseView(view.lm_head_weight, view.embed_weight, view.hidden_size, view.vocab_size),
                   prefix_layer=True)


def test_fresh_head_reads_z_like_a_fresh_medusa_head(view):
    draft = HydraDraft(num_heads=2, num_layers=1, base=view)
    for head in draft.heads:
        torch.nn.init.zeros_(head.inp.linear.bias)
    z = torch.randn(5, view.hidden_size)
    path = draft.embed_tokens(torch.randint(0, view.vocab_size, (5, 2)))
    torch.testing.assert_close(draft.head_logits(2, z, path), z @ view.lm_head_weight.T)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_loss_uses_the_true_path_and_the_right_targets(view, alpha):
    """Hand-computed per-depth loss: head k reads [z_t; E[x_{t+1}]; ..; E[x_{t+k}]] and is scored against
    x_{t+1+k} (alpha=0) or softmax(lm_head(h_{t+k})) (alpha=1), only where offset_labels has a target."""
    torch.manual_seed(3)
    draft = HydraDraft(num_heads=3, num_layers=2, base=view)
    for p in draft.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(3, view.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    mask[0, 6] = 0  # a user token in the middle: windows may not cross it
    hidden = torch.randn(2, 12, view.hidden_size)
    out = draft.loss(DraftBatch(hidden, ids, mask), view, LossSection(teacher_weight=alpha, chunk_size=4))
    E, W = view.embed_weight, view.lm_head_weight
    for k in (1, 2, 3):
        valid = offset_labels(ids, mask, 1 + k) != -100
        total, n = 0.0, 0
        for b, t in valid.nonzero().tolist():
            x = torch.cat([hidden[b, t]] + [E[ids[b, t + j]] for j in range(1, k + 1)])[None]
            log_q = torch.log_softmax(draft.head_trunk(k, x)[0] @ draft.head_weight(k).T, -1)
            if alpha == 0:
                total += float(-log_q[ids[b, t + 1 + k]].detach())
            else:
                total += float(-(torch.softmax(hidden[b, t + k] @ W.T, -1) * log_q).sum().detach())
            n += 1
        assert out.per_depth[k - 1].count == n > 0
        assert out.per_depth[k - 1].loss_sum == pytest.approx(total, rel=1e-5)


def test_heads_learn_through_the_path_embeddings(view):
    """z carries no information (all zeros), the tokens follow a fixed permutation x_{i+1} = perm[x_i]:
    only the embedded path can tell head k its target, so the loss goes to ~0 only if the path arrives."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(view.vocab_size, generator=gen)
    seq = [5]
    for _ in range(19):
        seq.append(int(perm[seq[-1]]))
    ids = torch.tensor([seq])
    mask = torch.ones_like(ids)
    hidden = torch.zeros(1, ids.shape[1], view.hidden_size)
    K = 3
    draft = HydraDraft(num_heads=K, num_layers=1, base=view)
    _, out = fit_draft(draft, [DraftBatch(hidden, ids, mask)], view, LossSection(chunk_size=7), steps=40, lr=5e-2)
    assert out.loss.item() < 0.05
    assert all(s.top1 == s.count for s in out.per_depth)
    assert out.per_depth[0].count == ids.shape[1] - 2


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_chunked_and_plain_loss_agree(view, prefix, alpha):
    torch.manual_seed(1)
    ids = torch.randint(3, view.vocab_size, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[:, :4] = 0
    hidden = torch.randn(2, 16, view.hidden_size)
    draft = HydraDraft(num_heads=3, num_layers=2, base=view, prefix_layer=prefix)
    for p in draft.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    batch = DraftBatch(hidden, ids, mask)
    per_depth, _ = assert_chunked_matches_reference(draft, batch, view, chunk_size=5, teacher_weight=alpha)
    assert [s.count for s in per_depth] == [22, 20, 18]
    if prefix:
        assert draft.prefix.layer.self_attn.o_proj.weight.grad.abs().sum() > 0  # the prefix layer trains


def test_prefix_layer_output_is_z(view):
    draft = HydraDraft(num_heads=1, num_layers=1, base=view, prefix_layer=True)
    with torch.no_grad():
        draft.prefix.layer.self_attn.o_proj.weight.normal_(std=0.2)
    hidden = torch.randn(1, 6, view.hidden_size)
    ids = torch.randint(3, view.vocab_size, (1, 6))
    out = draft.loss(DraftBatch(hidden, ids, torch.ones_like(ids)), view, LossSection(chunked=False))
    z = draft.prefix(hidden)[0]
    x = torch.cat([z[:4], F.embedding(ids[0, 1:5], view.embed_weight)], dim=-1)
    want = F.cross_entropy(draft.head_trunk(1, x) @ draft.head_weight(1).T, ids[0, 2:6], reduction="sum")
    assert out.per_depth[0].loss_sum == pytest.approx(float(want.detach()), rel=1e-5)


def test_dropout_only_in_training(view):
    draft = HydraDraft(num_heads=2, num_layers=2, base=view, dropout=0.5)
    x = torch.randn(4, 3 * view.hidden_size)
    draft.train()
    assert not torch.equal(draft.head_trunk(2, x), draft.head_trunk(2, x))
    draft.eval()
    torch.testing.assert_close(draft.head_trunk(2, x), draft.head_trunk(2, x))


def test_export_round_trip(tmp_path, view):
    draft = HydraDraft(num_heads=2, num_layers=2, base=view, prefix_layer=True, share_lm_head=True)
    for p in draft.parameters():
        p.data.add_(torch.randn_like(p) * 0.02)
    cfg = draft.export_config()
    assert cfg == {"family": "hydra", "num_heads": 2, "num_layers": 2, "share_lm_head": True, "prefix_layer": True,
                   "hidden_size": view.hidden_size, "vocab_size": view.vocab_size, "draft_vocab_size": 0}
    export_specdraft(draft, tmp_path / "export", "tiny", "fp")
    loaded, _ = load_draft(tmp_path / "export", view, "fp")
    assert isinstance(loaded, HydraDraft) and loaded.prefix is not None
    for (k1, v1), (k2, v2) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
