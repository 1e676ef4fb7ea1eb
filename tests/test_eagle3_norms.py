"""EAGLE-3's normalisation variants (draft.eagle3.fc_norm / norm_before_fc / norm_output / norm_before_residual;
EAGLE-3.1 = fc_norm + norm_output). Each variant is written out by hand from the plain draft's pieces and
F.rms_norm; the TTT unroll equals step-by-step inference with them on; decoding is lossless; the exports carry the
keys and tensors speculators and vLLM read and load back to the same drafts; llama.cpp's converter refuses what its
graph lacks; the config refuses fc_norm with norm_before_fc; a plain draft keeps its tensors and export config."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fit_draft
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import assert_unroll_equals_inference, greedy_continuation_batch, perturb, random_batch_with_aux
from safetensors.torch import load_file
from test_serve_check import _have_vllm
from torch.nn import functional as F

from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from models.draft import BaseView
from models.export.specdraft import export_specdraft, load_draft
from models.families.eagle3.drafter import Eagle3Drafter
from models.families.eagle3.export_speculators import export_speculators, load_speculators
from models.families.eagle3.gguf import converter_input as eagle3_converter_input
from models.families.eagle3.model import NORM_VARIANTS, Eagle3Draft
from train.config import LossSection

EAGLE31 = {"fc_norm": True, "norm_output": True}
# speculators' trainer defaults for eagle3 (train/config/schema.py): one norm before fc, normed outputs, normed residual
SPECULATORS_DEFAULTS = {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}
VARIANTS = [{key: True} for key in NORM_VARIANTS] + [EAGLE31, SPECULATORS_DEFAULTS]
IDS = [",".join(v) for v in VARIANTS]


def _pair(view, variant: dict, seed: int = 1) -> tuple[Eagle3Draft, Eagle3Draft]:
    """(plain draft, the same weights with `variant` on); the variant's own norm weights drawn off 1."""
    plain = perturb(Eagle3Draft(view, ttt_steps=3), 0.05, seed=seed).eval()
    draft = Eagle3Draft(view, ttt_steps=3, **variant).eval()
    draft.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith(("fc_norm.", "input_norm.")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 7)))
    return plain, draft


def _rms(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


# -- the variants by hand ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [{"fc_norm": True}, {"norm_before_fc": True}], ids=["fc_norm", "norm_before_fc"])
def test_fc_input_norms_by_hand(base4, view4, variant):
    """fc_norm = the plain draft fed [n_1(a1); n_2(a2); ...]; norm_before_fc = the plain draft fed n([a1; a2; ...])."""
    plain, draft = _pair(view4, variant)
    batch = random_batch_with_aux(base4, draft, b=1, t=10)
    aux, d = batch.aux_hidden, view4.hidden_size
    if "fc_norm" in variant:
        chunks = aux.split(d, dim=-1)
        normed = torch.cat([_rms(a, n.weight, draft.eps) for a, n in zip(chunks, draft.fc_norm)], dim=-1)
    else:
        normed = _rms(aux, draft.input_norm.weight, draft.eps)
    with torch.no_grad():
        got = draft.ttt_unroll(aux, batch.input_ids, 3)
        want = plain.ttt_unroll(normed, batch.input_ids, 3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_norm_output_feeds_the_normed_output_on(base4, view4):
    """norm_output: depth 1's output is norm(plain output); depth 2 is the plain layer fed that normed output, normed
    again; the logits are lm_head(output) with no second norm."""
    plain, draft = _pair(view4, {"norm_output": True})
    batch = random_batch_with_aux(base4, draft, b=1, t=10)
    ids, aux, t = batch.input_ids[0], batch.aux_hidden[0], 5
    norm = lambda x: _rms(x, plain.norm.weight, plain.eps)  # noqa: E731
    with torch.no_grad():
        outs = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 2)
        cache = plain.new_cache(8, "cpu", torch.float32)
        row = norm(plain.commit_rows(cache, aux[:t + 1], ids[1:t + 2])[-1:])
        torch.testing.assert_close(outs[0][0, t], row[0], rtol=1e-5, atol=1e-5)
        vis = torch.ones(1, 0, dtype=torch.bool)
        nxt, _, _ = plain.draft_rows(cache, row, ids[t + 2:t + 3], torch.tensor([t + 1]), None, None, vis)
        torch.testing.assert_close(outs[1][0, t], norm(nxt)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(draft.logits(outs[1][0, t]), F.linear(norm(nxt)[0], draft.lm_head.weight))


def test_norm_before_residual_by_hand(view4):
    """The layer's residual is hidden_norm(feature): its output is hidden_norm(g) + attn + MLP(...), by hand."""
    plain, draft = _pair(view4, {"norm_before_residual": True})
    layer, ref = draft.layers[0], plain.layers[0]
    gen = torch.Generator().manual_seed(3)
    emb, g = torch.randn(1, 4, view4.hidden_size, generator=gen), torch.randn(1, 4, view4.hidden_size, generator=gen)
    x, residual = layer.pre(emb, g)
    x_ref, residual_ref = ref.pre(emb, g)
    torch.testing.assert_close(x, x_ref)
    torch.testing.assert_close(residual_ref, g)
    torch.testing.assert_close(residual, _rms(g, ref.hidden_norm.weight, draft.eps))


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_unroll_equals_incremental_inference(base4, view4, variant):
    """Step j of row t in training = drafting depth j+1 with the draft's KV cache, every variant on."""
    _, draft = _pair(view4, variant)
    batch = random_batch_with_aux(base4, draft, b=1, t=12)
    assert_unroll_equals_inference(draft, batch, rows=(0, 6))


@pytest.mark.parametrize("variant", [EAGLE31, SPECULATORS_DEFAULTS], ids=["eagle31", "speculators_defaults"])
def test_fresh_draft_still_predicts_from_the_highest_aux_layer(base4, view4, variant):
    """The init stays meaningful with the norms on: a fresh draft's depth-1 argmax is the plain fresh draft's."""
    plain, draft = Eagle3Draft(view4), Eagle3Draft(view4, **variant)
    batch = random_batch_with_aux(base4, draft)
    with torch.no_grad():
        want = plain.logits(plain.ttt_unroll(batch.aux_hidden, batch.input_ids, 1)[0]).argmax(-1)
        got = draft.logits(draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 1)[0]).argmax(-1)
    assert (got == want).float().mean() > 0.95


# -- decoding ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained31(model, view, prompts):
    """An EAGLE-3.1 draft (fc_norm + norm_output) that memorised the base's greedy continuations."""
    torch.manual_seed(0)
    draft = Eagle3Draft(view, ttt_steps=3, **EAGLE31)
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_draft(draft, [batch], view, LossSection(chunk_size=64, teacher_weight=0.0), steps=60, lr=1e-2)
    finally:
        torch.set_num_threads(threads)
    return draft.eval()


@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_and_accepting_with_eagle31(model, trained31, prompts, ar_outputs, backend_kind, mode):
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    drafter = Eagle3Drafter(trained31, mode=mode, num_speculative_tokens=3)
    assert_lossless_and_accepting(backend, drafter, prompts, ar_outputs)


# -- exports ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [EAGLE31, SPECULATORS_DEFAULTS], ids=["eagle31", "speculators_defaults"])
def test_exports_carry_the_variants_and_round_trip(base4, view4, tmp_path, variant):
    """speculators' config keys (all four written) and tensor names; both round trips give the same outputs."""
    _, draft = _pair(view4, variant)
    out = export_speculators(draft, tmp_path / "spec", "tiny4", verifier="/some/base")
    cfg = json.loads((out / "config.json").read_text())
    assert {key: cfg[key] for key in NORM_VARIANTS} == {key: key in variant for key in NORM_VARIANTS}
    tensors = load_file(out / "model.safetensors")
    k, d = len(draft.aux_layers), view4.hidden_size
    if "fc_norm" in variant:
        assert [tensors[f"fc_norm.{i}.weight"].shape for i in range(k)] == [(d,)] * k
        assert "input_norm.weight" not in tensors
    else:
        assert tensors["input_norm.weight"].shape == (k * d,) and not any(n.startswith("fc_norm") for n in tensors)
    ours = export_specdraft(draft, tmp_path / "ours", "tiny4", None, draft.export_config())
    written = {key: v for key, v in draft.export_config().items() if key in NORM_VARIANTS}
    assert written == dict.fromkeys(variant, True)
    batch = random_batch_with_aux(base4, draft, b=1, t=10)
    with torch.no_grad():
        want = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 3)
        view = BaseView.from_model(base4)
        for loaded in (load_speculators(out, view), load_draft(ours, view)[0]):
            assert loaded.norm_variants() == variant
            for g, w in zip(loaded.eval().ttt_unroll(batch.aux_hidden, batch.input_ids, 3), want):
                torch.testing.assert_close(g, w)


def test_plain_draft_is_unchanged(view4, tmp_path):
    draft = Eagle3Draft(view4)
    assert draft.norm_variants() == {} and not set(NORM_VARIANTS) & set(draft.export_config())
    assert not any(n.startswith(("fc_norm", "input_norm")) for n in draft.state_dict())
    cfg = json.loads((export_speculators(draft, tmp_path / "s", "tiny4", verifier="x") / "config.json").read_text())
    assert {key: cfg[key] for key in NORM_VARIANTS} == dict.fromkeys(NORM_VARIANTS, False)


def test_speculators_config_without_norm_before_residual_is_refused(view4, tmp_path):
    out = export_speculators(Eagle3Draft(view4), tmp_path / "s", "tiny4", verifier="x")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no norm_before_residual"):
        load_speculators(out, view4)


# -- refusals ---------------------------------------------------------------------------------------------------------

def test_llamacpp_refuses_the_norms_its_graph_lacks(view4, tmp_path):
    """llama.cpp's EAGLE-3 graph reads norm_before_residual only: fc_norm / norm_output are refused by name."""
    draft = Eagle3Draft(view4, **EAGLE31)
    with pytest.raises(ValueError, match="no fc_norm, norm_output.*--format vllm"):
        eagle3_converter_input(draft, {"base_model": "tiny4"}, tmp_path / "base", tmp_path / "out")


def test_fc_norm_and_norm_before_fc_exclude_each_other(view4):
    from core.config_loader import ConfigError
    from train.config import load_train_config

    with pytest.raises(ValueError, match="exclude each other"):
        Eagle3Draft(view4, fc_norm=True, norm_before_fc=True)
    with pytest.raises(ConfigError, match="draft.eagle3.norm_before_fc=True: fc_norm"):
        load_train_config(["configs/eagle3.yaml", "configs/smoke.yaml"],
                          ["draft.eagle3.fc_norm=true", "draft.eagle3.norm_before_fc=true"])
    cfg = load_train_config(["configs/eagle3.yaml", "configs/smoke.yaml"], ["draft.eagle3.fc_norm=true"])
    assert cfg.draft.eagle3.fc_norm is True and cfg.draft.eagle3.norm_output is False


# -- vLLM --------------------------------------------------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_vllm_serves_eagle31_and_accepts_what_ours_accepts(tmp_path, capsys):
    """vLLM's CPU build serves an export with fc_norm + norm_output + norm_before_residual (its fc_norm modules and
    post-norm feedback): per-position acceptance equals our chain decoder's. The draft is trained part way (20 steps)
    so that acceptance falls with depth and a layout read differently by the two engines would show."""
    from vllm_fixtures import eagle3_export_on_servable_base

    from cli.main import main

    export = eagle3_export_on_servable_base(tmp_path, steps=20, **EAGLE31, norm_before_residual=True)
    rc = main(["serve-check", "--draft", str(export), "--config", "configs/eval/smoke.yaml", "max_new_tokens=150",
               "serve_enforce_eager=true"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "run" / "serve_check" / "smoke" / "report.json").read_text())
    print(json.dumps({"acceptance_check": report["acceptance_check"]}, indent=1))
    acc = report["acceptance_check"]
    assert acc["ok"] and len(acc["vllm"]) == 3 and acc["max_abs_diff"] <= 0.03
    assert min(acc["vllm"]) > 0.05 and min(acc["vllm"]) < 0.95  # real numbers, not all-or-nothing
    assert report["our_lossless"] is True
