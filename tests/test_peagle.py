"""P-EAGLE: EAGLE-3 with parallel drafting (draft.eagle3.parallel_drafting). The training unroll's mask slots see only
the mask token and mask_hidden and equal the one-forward inference of the drafter; the loss per depth (by hand, COD
sampling nested and sized, chunked == reference); the drafter drafts K tokens from one forward as vLLM does (a slow
reference decode loop that recomputes everything per step gives the same tokens and acceptance), losslessly on both
backends; the speculators `peagle` export and its round trip; a plain EAGLE-3 draft is unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fit_draft
from helpers.cli import smoke_cli_eval, smoke_cli_train
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import (
    greedy_continuation_batch,
    perturb,
    random_batch_with_aux,
    with_draft_vocab,
)
from safetensors.torch import load_file
from test_serve_check import _have_vllm
from torch.nn import functional as F

from data.targets import offset_labels
from eval.engine.backends.fast import FastBackend
from eval.engine.backends.hf import HFBackend
from eval.engine.decoder import speculative_generate
from eval.engine.drafters.registry import DRAFTERS, build_drafter
from eval.harness.config import EvalConfig
from models.base import last_hidden_and_aux
from models.draft import BaseView
from models.export.formats import export_vllm
from models.export.specdraft import export_specdraft, load_draft
from models.export.vllm import SPECULATIVE_CONFIG_FILE
from models.families.eagle3.drafter import Eagle3Drafter
from models.families.eagle3.export_speculators import export_speculators, load_speculators
from models.families.eagle3.model import Eagle3Draft
from models.families.eagle3.ttt import cod_keep
from train.config import LossSection

D2T = torch.tensor([7, 3, 100, 250, 64, 9, 11, 12, 13, 200, 201, 5])


def _peagle(view, steps=3, seed=1, **kw):
    torch.manual_seed(seed)
    return perturb(Eagle3Draft(view, ttt_steps=steps, parallel_drafting=True, **kw), 0.1, seed=seed)


# -- the model ---------------------------------------------------------------------------------------------------------

def test_options_defaults_keep_plain_eagle3(view4):
    plain = Eagle3Draft(view4)
    assert not plain.parallel_drafting and "mask_hidden" not in plain.state_dict()
    cfg = plain.export_config()
    assert not {"parallel_drafting", "mask_token_id", "eagle3_mode", "num_speculative_tokens"} & set(cfg)
    draft = Eagle3Draft(view4, parallel_drafting=True)
    d = view4.hidden_size
    assert draft.state_dict()["mask_hidden"].shape == (1, 1, len(draft.aux_layers) * d)
    assert draft.mask_token_id == 0  # the tiny base's pad token (default_mask_token_id)
    cfg = draft.export_config()
    assert cfg["parallel_drafting"] is True and cfg["eagle3_mode"] == "chain" and cfg["num_speculative_tokens"] == 3
    with pytest.raises(ValueError, match="mask_token_id"):
        Eagle3Draft(view4, parallel_drafting=True, mask_token_id=view4.vocab_size)


def test_mask_slots_read_only_the_mask_token_and_mask_hidden(base4, view4):
    """Anchor t's depth >= 2 outputs do not change when the tokens after x_{t+1} change (a plain EAGLE-3's do: its
    step j reads x_{t+1+j}), and they do change with mask_hidden and with mask_token_id."""
    draft = _peagle(view4).eval()
    batch = random_batch_with_aux(base4, draft, b=1, t=14)
    ids, aux = batch.input_ids, batch.aux_hidden
    t = 6
    other = ids.clone()
    other[0, t + 2:] = (other[0, t + 2:] + 7) % 300 + 3  # every token after x_{t+1}
    _, aux2 = last_hidden_and_aux(base4, other, None, draft.aux_layers)
    aux2[:, : t + 2] = aux[:, : t + 2]  # same features up to t (they are causal anyway)
    with torch.no_grad():
        a = draft.ttt_unroll(aux, ids, 3)
        b = draft.ttt_unroll(aux2, other, 3)
        plain_a = draft.ttt_unroll(aux, ids, 3, parallel=False)
        plain_b = draft.ttt_unroll(aux2, other, 3, parallel=False)
        for j in range(3):
            torch.testing.assert_close(a[j][0, t], b[j][0, t])
        assert not torch.allclose(plain_a[1][0, t], plain_b[1][0, t])  # the AR unroll reads x_{t+2}
        draft.mask_hidden.add_(1.0)
        c = draft.ttt_unroll(aux, ids, 3)
        torch.testing.assert_close(c[0], a[0])  # depth 1 is EAGLE-3's step 0: no mask slot in it
        assert not torch.allclose(c[1][0, t], a[1][0, t])
        draft.mask_token_id = 5
        e = draft.ttt_unroll(aux, ids, 3)
        assert not torch.allclose(e[2][0, t], c[2][0, t])


def test_unroll_equals_the_one_forward_of_inference(base4, view4):
    """For every anchor t: parallel_rows over the committed rows 0..t plus K-1 mask slots (one call, a draft KV cache
    that grows) gives the unroll's depth-1 output at t and its mask slots' outputs; the dense-mask twin agrees."""
    draft = _peagle(view4, steps=4).eval()
    batch = random_batch_with_aux(base4, draft, b=1, t=12)
    ids, aux = batch.input_ids[0], batch.aux_hidden[0]
    with torch.no_grad():
        outs = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 4)
        ref = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 4, reference=True)
        for j in range(4):
            torch.testing.assert_close(outs[j], ref[j], rtol=1e-5, atol=1e-5)
        for t in range(ids.numel() - 1):
            cache = draft.new_cache(2, "cpu", torch.float32)  # small: grows
            rows = draft.parallel_rows(cache, aux[: t + 1], ids[1: t + 2], 3)  # [t + 1 + 3, d]
            assert cache.length == t + 1  # the slots' keys are not kept
            for j in range(4):
                torch.testing.assert_close(rows[t + j], outs[j][0, t], rtol=1e-5, atol=1e-5)
        # committed in two calls (a cache that already holds rows) = committed at once
        cache = draft.new_cache(4, "cpu", torch.float32)
        draft.parallel_rows(cache, aux[:5], ids[1:6], 2)
        rows = draft.parallel_rows(cache, aux[5:9], ids[6:10], 3)
        for j in range(4):
            torch.testing.assert_close(rows[3 + j], outs[j][0, 8], rtol=1e-5, atol=1e-5)


def test_cod_sampling_is_nested_and_sized():
    torch.manual_seed(0)
    valid0 = torch.rand(3, 40) > 0.2
    keep, n0, kept = None, 0, []
    for depth in range(5):
        valid = valid0.clone()
        valid[:, 40 - depth:] = False  # deeper targets run out at the end
        keep = cod_keep(valid, keep, depth, n0, 0.7, 0.2)
        n0 = int(keep.sum()) if depth == 0 else n0
        kept.append(keep)
        assert not bool((keep & ~valid).any())
    assert int(kept[0].sum()) == int(valid0.sum())
    for depth in range(1, 5):
        assert not bool((kept[depth] & ~kept[depth - 1]).any())  # nested
        assert int(kept[depth].sum()) == round(n0 * max(0.7 ** depth, 0.2))
    one = cod_keep(torch.ones(1, 4, dtype=torch.bool), torch.tensor([[True, False, False, False]]), 1, 4, 0.7, 0.2)
    assert one.tolist() == [[True, False, False, False]]  # fewer candidates than wanted: all of them


def test_loss_per_depth_by_hand_and_sampling_in_training_only(base4, view4):
    """Every anchor (eval mode): Σ_j 0.8^j · mean soft CE of depth j+1 over the rows with a target, from the parallel
    unroll. Training mode: depth 1 keeps every row, deeper depths the COD share."""
    draft = _peagle(view4, steps=3).eval()
    batch = random_batch_with_aux(base4, draft, b=2, t=20)
    out = draft.loss(batch, view4, LossSection(teacher_weight=1.0, decay=0.8))
    outs = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 3)
    s = batch.input_ids.shape[1] - 1
    want = 0.0
    for j in range(3):
        labels = offset_labels(batch.input_ids, batch.loss_mask, 2 + j)[:, :s]
        valid = labels != -100
        logq = torch.log_softmax(draft.logits(outs[j]), -1)
        teacher = F.pad(batch.hidden[:, 1 + j:], (0, 0, 0, j))[:, :s] @ view4.lm_head_weight.T
        want += 0.8 ** j * (-(torch.softmax(teacher, -1) * logq).sum(-1))[valid].mean()
        assert out.per_depth[j].count == int(valid.sum())
        assert out.per_depth[j].top1 == int((logq.argmax(-1) == labels)[valid].sum())
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-5, atol=1e-5)
    draft.train()
    counts = [d.count for d in draft.loss(batch, view4, LossSection()).per_depth]
    n0 = out.per_depth[0].count
    assert counts == [n0, round(n0 * 0.7), round(n0 * 0.49)]
    draft.cod_ratio = draft.cod_ratio_min = 1.0  # every anchor at every depth
    assert [d.count for d in draft.loss(batch, view4, LossSection()).per_depth] == [d.count for d in out.per_depth]


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_chunked_loss_matches_reference_with_sampling(base4, view4, alpha):
    draft = _peagle(view4, steps=3)
    draft.train()
    batch = random_batch_with_aux(base4, draft, b=2, t=20)
    results = []
    for chunked in (True, False):
        torch.manual_seed(7)  # the same COD draw on both paths
        draft.zero_grad()
        out = draft.loss(batch, view4, LossSection(chunked=chunked, teacher_weight=alpha, chunk_size=7))
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in draft.parameters()],
                        [(d.count, d.top1) for d in out.per_depth]))
    (la, ga, da), (lb, gb, db) = results
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    assert da == db
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert float(draft.mask_hidden.grad.abs().sum()) > 0  # the mask feature is trained


# -- decoding ----------------------------------------------------------------------------------------------------------

def _trained_peagle(model, view, prompts, steps=60):
    """A P-EAGLE draft that memorised the base's own greedy continuations of the test prompts (every anchor, every
    depth: COD shares 1.0)."""
    torch.manual_seed(0)
    draft = Eagle3Draft(view, ttt_steps=4, parallel_drafting=True, cod_ratio=1.0, cod_ratio_min=1.0)
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_draft(draft, [batch], view, LossSection(chunk_size=64, teacher_weight=0.0), steps=steps, lr=1e-2)
    finally:
        torch.set_num_threads(threads)
    return draft.eval()


@pytest.fixture(scope="module")
def trained(model, view, prompts):
    return _trained_peagle(model, view, prompts)


def slow_parallel_decode(model, draft, prompt, k: int, new: int) -> tuple[list[int], list[int]]:
    """The reference loop: no KV cache anywhere. Each step runs the base on the whole committed text (its greedy
    next token is the root, its aux states the draft's features), the draft's parallel unroll on the whole text +
    root (the last anchor's K outputs are the K drafts), then the base on text + root + drafts to accept the
    longest greedy-matching prefix. Returns (new tokens, per step accepted drafts + 1)."""
    seq = prompt.tolist()
    tokens, lengths = [], []
    with torch.no_grad():
        root = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        tokens.append(root)
        while len(tokens) < new:
            _, aux = last_hidden_and_aux(model, torch.tensor([seq]), None, draft.aux_layers)
            ids = torch.tensor([seq + [root]])
            aux = F.pad(aux, (0, 0, 0, 1))  # the root's row: no feature read (the unroll reads aux[:, :T-1])
            outs = draft.ttt_unroll(aux, ids, k)
            drafts = [int(draft.to_base(draft.logits(o[0, -1]).argmax())) for o in outs]
            verify = model(torch.tensor([seq + [root] + drafts])).logits[0, len(seq):].argmax(-1).tolist()
            n = 0
            while n < k and drafts[n] == verify[n]:
                n += 1
            lengths.append(n + 1)
            seq += [root] + drafts[:n]
            root = verify[n]
            tokens += drafts[:n] + [root]
    return tokens[:new], lengths


@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
def test_one_forward_drafter_equals_the_slow_reference_loop(model, trained, prompts, backend_kind):
    """The drafter (one layer call per step over the new committed rows and K-1 mask slots, a KV cache of the
    committed rows) drafts exactly what the cache-free reference loop drafts: same tokens, same accepted length at
    every step; and every step drafted K deep."""
    drafter = Eagle3Drafter(trained, mode="chain", num_speculative_tokens=4)
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    for prompt in prompts:
        got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW, eos_ids=None)
        want_tokens, want_lengths = slow_parallel_decode(model, trained, prompt, 4, NEW)
        assert got.tokens == want_tokens
        assert got.accepted_lengths == want_lengths
        assert got.proposed_counts[:4] == [got.base_steps] * 4


@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
def test_lossless_and_accepting_with_a_trained_draft(model, trained, prompts, ar_outputs, backend_kind):
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    chain = Eagle3Drafter(trained, mode="chain", num_speculative_tokens=4)
    assert_lossless_and_accepting(backend, chain, prompts, ar_outputs)


@pytest.mark.parametrize("backend_kind", ["hf", "fast"])
def test_lossless_with_random_drafts_and_a_draft_vocabulary(model, view, prompts, ar_outputs, backend_kind):
    d2t = torch.tensor(sorted({t for out in ar_outputs for t in out} | {3, 9, 11}))
    backend = HFBackend(model) if backend_kind == "hf" else FastBackend(model, max_len=128)
    for v in (view, with_draft_vocab(view, d2t)):
        drafter = Eagle3Drafter(_peagle(v).eval(), mode="chain", num_speculative_tokens=3)
        for prompt, want in zip(prompts, ar_outputs):
            got = speculative_generate(backend, drafter, prompt, max_new_tokens=NEW)
            assert got.tokens == want


def test_builder_defaults_to_the_parallel_chain_and_refuses_trees(trained):
    cfg = trained.export_config()
    drafter, info = build_drafter(trained, cfg, EvalConfig())
    assert drafter.parallel and info["eagle3_mode"] == "chain" and info["num_speculative_tokens"] == 4
    assert info["parallel_drafting"] is True and DRAFTERS["eagle3"].shape(info) == "parallel chain of 4"
    drafter, info = build_drafter(trained, cfg, EvalConfig(extra={"num_speculative_tokens": 2}))
    assert drafter.max_nodes == 3
    with pytest.raises(ValueError, match="eagle3_mode=chain"):
        build_drafter(trained, cfg, EvalConfig(extra={"eagle3_mode": "tree"}))
    assert DRAFTERS["eagle3"].tune_shapes(trained) == []  # chains only
    trained.parallel_drafting = False  # the same weights read as a plain EAGLE-3: its trees come back
    try:
        assert len(DRAFTERS["eagle3"].tune_shapes(trained)) == 4
    finally:
        trained.parallel_drafting = True


# -- export ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d2t", [None, D2T])
def test_peagle_layout_and_round_trips(base4, view4, tmp_path, d2t):
    """speculators' peagle layout (what vLLM's update_peagle reads), vLLM's speculative_config with parallel_drafting,
    and both round trips (speculators and specdraft formats) draft the same tokens from one forward."""
    v = with_draft_vocab(view4, d2t)
    draft = _peagle(v, steps=3, mask_token_id=17).eval()
    out = export_speculators(draft, tmp_path / "spec", "tiny4", verifier="/some/base")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleSpeculator"]
    assert cfg["mask_token_id"] == 17 and cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["norm_before_residual"] is False and cfg["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 3
    t = load_file(out / "model.safetensors")
    d = view4.hidden_size
    assert t["mask_hidden"].shape == (1, 1, 2 * d) and "embed" not in t
    torch.testing.assert_close(t["mask_hidden"], draft.mask_hidden.detach())
    vdir = export_vllm(draft, tmp_path / "vllm", draft.export_config(), v)
    assert json.loads((vdir / SPECULATIVE_CONFIG_FILE).read_text()) == {
        "method": "eagle3", "model": str(vdir.resolve()), "num_speculative_tokens": 3, "parallel_drafting": True}
    spec_loaded = load_speculators(out, BaseView.from_model(base4))
    assert spec_loaded.parallel_drafting and spec_loaded.mask_token_id == 17
    ours = export_specdraft(draft, tmp_path / "ours", "tiny4", None, draft.export_config())
    ours_loaded, _ = load_draft(ours, BaseView.from_model(base4))
    assert ours_loaded.parallel_drafting and ours_loaded.mask_token_id == 17
    batch = random_batch_with_aux(base4, draft, b=1, t=12)
    aux, ids = batch.aux_hidden[0, :-1], batch.input_ids[0]
    with torch.no_grad():
        want = draft.to_base(draft.logits(draft.parallel_rows(draft.new_cache(8, "cpu", torch.float32), aux,
                                                              ids[1:], 2)[-3:]).argmax(-1))
        for loaded in (spec_loaded, ours_loaded):
            rows = loaded.parallel_rows(loaded.new_cache(8, "cpu", torch.float32), aux, ids[1:], 2)[-3:]
            assert loaded.to_base(loaded.logits(rows).argmax(-1)).tolist() == want.tolist()


def test_plain_eagle3_export_is_unchanged(view4, tmp_path):
    """No peagle key, tensor or speculative_config entry on a plain EAGLE-3 draft."""
    draft = perturb(Eagle3Draft(view4), 0.1, seed=2).eval()
    out = export_speculators(draft, tmp_path / "spec", "tiny4", verifier="x")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and "mask_token_id" not in cfg
    assert "mask_hidden" not in load_file(out / "model.safetensors")
    vdir = export_vllm(draft, tmp_path / "vllm", draft.export_config(), view4)
    assert "parallel_drafting" not in json.loads((vdir / SPECULATIVE_CONFIG_FILE).read_text())


# -- the recipe --------------------------------------------------------------------------------------------------------

def test_smoke_train_then_cli_eval_is_lossless(tmp_path, clean_env):
    """`specdraft train --config configs/eagle3.yaml --config configs/smoke.yaml draft.eagle3.parallel_drafting=true`,
    then `specdraft eval` on its export: the parallel chain of its 3 depths by default, lossless."""
    import math

    run_dir = tmp_path / "peagle"
    rows = smoke_cli_train(run_dir, "configs/eagle3.yaml", ["train.max_steps=4", "draft.eagle3.parallel_drafting=true"],
                           clean_env())
    assert any(math.isfinite(r.get("loss/head3", math.nan)) for r in rows)
    cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert cfg["family"] == "eagle3" and cfg["parallel_drafting"] is True and cfg["num_speculative_tokens"] == 3
    report = smoke_cli_eval(run_dir, "parallel", [], clean_env())
    assert report["method"] == "eagle3" and report["lossless"] is True
    assert report["extra"]["parallel_drafting"] is True and report["extra"]["num_speculative_tokens"] == 3


# -- vLLM --------------------------------------------------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_vllm_serves_the_peagle_export_and_accepts_what_ours_accepts(tmp_path, capsys):
    """vLLM's CPU build serves the peagle export (method eagle3 + parallel_drafting: PeagleLlamaForCausalLM, its
    mask_hidden loaded) of a draft that memorised the base's answers: per-position acceptance equals our one-forward
    chain decoder's at each of the 3 positions, none of them zero; both engines' outputs are the base's own."""
    from vllm_fixtures import eagle3_export_on_servable_base

    from cli.main import main

    export = eagle3_export_on_servable_base(tmp_path, parallel_drafting=True, cod_ratio=1.0, cod_ratio_min=1.0)
    rc = main(["serve-check", "--draft", str(export), "--config", "configs/eval/smoke.yaml", "max_new_tokens=150",
               "serve_enforce_eager=true"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "run" / "serve_check" / "smoke" / "report.json").read_text())
    print(json.dumps({"acceptance_check": report["acceptance_check"],
                      "vllm_draft": report["engines"]["vllm_draft"]}, indent=1))
    assert report["speculative_config"]["parallel_drafting"] is True
    acc = report["acceptance_check"]
    assert acc["ok"] and len(acc["vllm"]) == 3 and acc["max_abs_diff"] <= 0.03
    assert min(acc["vllm"]) > 0.1  # memorised answers: the mask slots' drafts are accepted too (~0.5, ~0.27 here)
    assert report["our_lossless"] is True
    assert report["engines"]["ours_ar"]["agreement_with_vllm_ar"]["common_prefix_fraction"] > 0.9
    log = (tmp_path / "run" / "serve_check" / "smoke" / "vllm" / "vllm_draft.log").read_text()
    assert "PeagleLlamaForCausalLM" in log and "mask_hidden not found" not in log
