"""Domino's own behaviour (what every block family does: tests/test_block_families.py): the GRU correction decoded
left to right equals a hand loop with PyTorch's GRU equations, and a fresh draft drafts like its backbone; the loss
against a hand computation (correction from the true earlier tokens, the uncorrected prefix, the backbone's own CE at
base_weight, decay weights) and the correction's gradients; its config options and export keys; the serving engines
and the CLI refusing it, naming the format it has."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.block_families import DOMINO, context_cache, scored_blocks
from helpers.drafts import random_batch_with_aux
from torch.nn import functional as F

from models.draft import BaseView
from models.export.formats import export_vllm
from models.export.schema import ExportError
from models.export.specdraft import export_specdraft, load_draft, read_export_config
from models.families.domino.model import DominoDraft, DominoLossOptions
from train.config import LossSection, load_train_config


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

@pytest.mark.parametrize("prefix_len", [0, 1, 2])
def test_chain_is_decoded_left_to_right_with_the_gru_correction(model, view, prefix_len):
    """draft_chain = the hand loop: g after the root and the drafts so far, z_k = lm_head(h_k) + W_out SiLU(W_in
    [h_k; g_k]) from slot prefix_len on, d_k = argmax z_k."""
    draft = DOMINO.draft(view, block_size=5, std=0.5, prefix_len=prefix_len)
    with torch.no_grad():
        draft.correction.embed_proj[2].weight.mul_(30.0)  # a correction that matters next to the slots' logits
    cache, root = context_cache(model, draft), 17
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
    cache = context_cache(model, draft, t=9)
    with torch.no_grad():
        h = draft.norm(draft.draft_block_outputs(cache, 5))
    assert draft.draft_chain(cache, 5)[0].tolist() == (h @ draft.lm_head.weight.T).argmax(-1).tolist()


def test_loss_matches_a_hand_computation(model, view):
    """Eval mode scores every anchor: row (t, k) = CE(z, x_{t+1+k}) with z the hand logits of slot k-1 from the
    true tokens x_{t+1} .. x_{t+k}, plus base_weight · CE(lm_head(h), x_{t+1+k}); weights lambda0·decay^(k-1);
    Σ w·ℓ / n."""
    draft = DOMINO.draft(view, block_size=3, gru_hidden=4, correction_dim=3, std=0.3)
    batch = random_batch_with_aux(model, draft, b=2, t=12)
    cfg = LossSection(teacher_weight=0.0, lambda0=1.0, decay=0.5, domino=DominoLossOptions(
        position_weights="decay", base_weight=0.4))
    got = draft.loss(batch, view, cfg).loss
    ids = batch.input_ids
    total, n = 0.0, 0
    with torch.no_grad():
        for b, t, out, labels in scored_blocks(draft, batch):
            h = draft.norm(out)
            prev = [int(ids[b, min(t + k, ids.shape[1] - 1)]) for k in (1, 2, 3)]
            z = _hand_logits(draft, h, prev)
            base = h @ draft.lm_head.weight.T
            for k in (1, 2, 3):
                y = int(labels[k - 1])
                if y == -100:
                    continue
                w = 0.5 ** (k - 1)
                total += w * float(F.cross_entropy(z[k - 1][None], torch.tensor([y])))
                total += 0.4 * w * float(F.cross_entropy(base[k - 1][None], torch.tensor([y])))
                n += 1
    assert n > 20
    assert float(got.detach()) == pytest.approx(total / n, rel=1e-5)


def test_the_correction_trains(model, view):
    """With the backbone's own CE off (base_weight 0) the loss still reaches the GRU and both correction layers
    (chunked == reference for every block family: tests/test_block_families.py)."""
    draft = DOMINO.draft(view, block_size=4).train()
    batch = random_batch_with_aux(model, draft, b=2, t=20)
    draft.loss(batch, view, DOMINO.loss(base_weight=0.0)).loss.backward()
    corr = draft.correction
    for p in (corr.prefix_gru.weight_ih_l0, corr.prefix_gru.weight_hh_l0, corr.embed_proj[0].weight,
              corr.embed_proj[2].weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0


# -- configs and exports --------------------------------------------------------------------------------------

def test_recipe_checks_its_own_options():
    """An uncorrected prefix of the whole block leaves nothing to correct, and the backbone's CE weight is not
    negative (the block rules and the refusal of draft.domino.* in another family's run: test_block_families.py)."""
    with pytest.raises(ValueError, match="prefix_len"):
        load_train_config(["configs/domino.yaml"], ["draft.domino.prefix_len=8"])
    with pytest.raises(ValueError, match="base_weight"):
        load_train_config(["configs/domino.yaml"], ["loss.domino.base_weight=-1"])


def test_export_keeps_its_own_keys_and_refuses_a_mistyped_one(model, view, tmp_path):
    """gru_hidden, correction_dim and prefix_len (here off its default) survive the specdraft round trip; its own
    keys' types are checked through FamilyFacts.export_key_types (the round trip of every block family:
    tests/test_block_families.py)."""
    out = export_specdraft(DOMINO.draft(view, prefix_len=2), tmp_path / "exp", "tiny", "fp")
    cfg = read_export_config(out)
    assert (cfg["gru_hidden"], cfg["correction_dim"], cfg["prefix_len"]) == (6, 5, 2)
    loaded, _ = load_draft(out, BaseView.from_model(model))
    assert isinstance(loaded, DominoDraft) and loaded.prefix_len == 2
    bad = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**bad, "gru_hidden": "six"}))
    with pytest.raises(ExportError, match="gru_hidden"):
        read_export_config(out)


def test_serving_engines_refuse_with_the_formats_it_has(view, tmp_path, capsys):
    """vLLM 0.32 and llama.cpp have no Domino method: the writers and `specdraft export --format vllm / gguf` say
    so, naming the format it has, and write nothing."""
    from cli.main import main
    from eval.serving.llamacpp_gguf import draft_gguf

    draft = DOMINO.draft(view)
    with pytest.raises(ValueError, match=r"vLLM cannot serve a 'domino' draft.*formats for domino: specdraft"):
        export_vllm(draft, tmp_path / "vllm", {"family": "domino", "base_model": "tiny"}, view)
    with pytest.raises(ValueError, match="llama.cpp serves .* drafts; this draft is 'domino'"):
        draft_gguf(draft, {"family": "domino"}, tmp_path, tmp_path / "d.gguf", "f32")
    assert not (tmp_path / "vllm").exists()
    run_dir = tmp_path / "run"
    export_specdraft(draft, run_dir / "export", "tiny", "fp")
    capsys.readouterr()
    for fmt in ("vllm", "gguf"):
        assert main(["export", "--run", str(run_dir), "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err
        assert f"--format {fmt}: " in err and "domino draft exports as specdraft" in err.lower(), err
        assert not (tmp_path / fmt).exists()
