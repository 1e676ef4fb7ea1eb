"""EAGLE-3 with more than one decoder layer (`draft.eagle3.num_layers`; models/families/eagle3/layers.py): the layout
(layers.1 is a plain d-wide decoder layer), a fresh deeper draft predicting exactly what a one-layer one does, the
TTT unroll against decoding step by step with the per-layer KV cache (also P-EAGLE's one forward), training, lossless
decoding (and the field benchmark's lockstep path equal to the per-prompt one), the export round trips (ours,
speculators / vLLM), llama.cpp's refusal, and the bad values refused at config load."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fit_draft
from helpers.cli import smoke_cli_eval, smoke_cli_train
from helpers.decoding import DECODE_NEW_TOKENS as NEW
from helpers.decoding import assert_lossless_and_accepting
from helpers.drafts import (
    assert_unroll_equals_inference,
    greedy_continuation_batch,
    perturb,
    random_batch_with_aux,
    with_draft_vocab,
)
from test_field_lockstep import _accepting, _assert_same, _fit, stored  # noqa: F401 (stored: a fixture)

from core.config_loader import ConfigError
from eval.engine.backends.hf import HFBackend
from models.export.specdraft import export_specdraft, load_draft
from models.families.eagle3.drafter import Eagle3Drafter
from models.families.eagle3.export_speculators import export_speculators, load_speculators
from models.families.eagle3.model import Eagle3Draft
from train.config import LossSection, load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _decode(draft, aux, ids, steps: int = 3) -> list[torch.Tensor]:
    """Drafting with the draft's own cache, row by row: for each anchor t the committed rows 0..t, then depths 2..steps
    from the data tokens and its own outputs -> per depth the outputs [T', d] of every anchor."""
    outs = [[] for _ in range(steps)]
    with torch.no_grad():
        for t in range(aux.shape[0] - steps):
            cache = draft.new_cache(2, "cpu", torch.float32)
            hidden, tk, tv = draft.commit_rows(cache, aux[:t + 1], ids[1:t + 2])[-1:], None, None
            outs[0].append(hidden[0])
            for j in range(1, steps):
                vis = torch.ones(1, 0 if tk is None else tk.shape[2], dtype=torch.bool)
                hidden, tk, tv = draft.draft_rows(cache, hidden, ids[t + 1 + j:t + 2 + j], torch.tensor([t + j]), tk,
                                                  tv, vis)
                outs[j].append(hidden[0])
    return [torch.stack(o) for o in outs]


def test_layout_layer_one_is_a_plain_decoder_layer(view4):
    draft = Eagle3Draft(view4, num_layers=3)
    d = view4.hidden_size
    names = {n for n in draft.state_dict() if n.startswith("layers.1.")}
    assert names == {"layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight"} | {
        f"layers.1.self_attn.{p}_proj.weight" for p in "qkvo"} | {f"layers.1.mlp.{p}_proj.weight"
                                                                 for p in ("gate", "up", "down")}
    assert draft.layers[0].self_attn.q_proj.in_features == 2 * d and draft.layers[1].self_attn.q_proj.in_features == d
    assert any(n.startswith("layers.2.") for n in draft.state_dict()) and draft.num_layers == 3
    assert draft.new_cache(4, "cpu", torch.float32).keys.shape[0] == 3
    assert "num_layers" not in Eagle3Draft(view4).export_config()  # a one-layer export's config is unchanged
    assert draft.export_config()["num_layers"] == 3


def test_fresh_deeper_draft_predicts_what_a_one_layer_draft_does(base4, view4):
    """Layers 1.. start as the identity (o_proj / down_proj zero): fresh, and beside a trained-looking layer 0 (the
    one-layer draft's perturbed weights loaded into the deeper one), the outputs are exactly the one-layer draft's,
    in the TTT unroll and in decoding with the cache."""
    one, two = Eagle3Draft(view4, ttt_steps=3).eval(), Eagle3Draft(view4, ttt_steps=3, num_layers=2).eval()
    batch = random_batch_with_aux(base4, one, b=1, t=12)
    for check in ("fresh", "layer 0 trained"):
        if check != "fresh":
            perturb(one, 0.2, seed=3)
            missing, unexpected = two.load_state_dict(one.state_dict(), strict=False)
            assert not unexpected and missing and all(n.startswith("layers.1.") for n in missing)
        with torch.no_grad():
            for a, b in zip(one.ttt_unroll(batch.aux_hidden, batch.input_ids, 3),
                            two.ttt_unroll(batch.aux_hidden, batch.input_ids, 3)):
                assert torch.equal(one.logits(a), two.logits(b)), check
        for a, b in zip(_decode(one, batch.aux_hidden[0], batch.input_ids[0]),
                        _decode(two, batch.aux_hidden[0], batch.input_ids[0])):
            assert torch.equal(a, b), check


@pytest.mark.parametrize("layers", [2, 4])
def test_unroll_equals_decoding_with_the_per_layer_cache(base4, view4, layers):
    draft = perturb(Eagle3Draft(view4, ttt_steps=3, num_layers=layers), 0.1, seed=1).eval()
    assert_unroll_equals_inference(draft, random_batch_with_aux(base4, draft, b=1, t=12))


def test_parallel_drafting_one_forward_equals_its_unroll(base4, view4):
    """P-EAGLE with two layers: parallel_rows (committed rows + mask slots in one forward, per layer) gives the
    unroll's depth-k outputs at every anchor; a second call continues the cache."""
    draft = perturb(Eagle3Draft(view4, ttt_steps=3, num_layers=2, parallel_drafting=True), 0.1, seed=2).eval()
    batch = random_batch_with_aux(base4, draft, b=1, t=12)
    ids, aux = batch.input_ids[0], batch.aux_hidden[0]
    with torch.no_grad():
        outs = draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 3)
        for t in (0, 4, 8):
            rows = draft.parallel_rows(draft.new_cache(2, "cpu", torch.float32), aux[:t + 1], ids[1:t + 2], 2)
            for k in range(3):
                torch.testing.assert_close(rows[t + k], outs[k][0, t], rtol=1e-5, atol=1e-5)
        cache = draft.new_cache(4, "cpu", torch.float32)
        draft.parallel_rows(cache, aux[:5], ids[1:6], 2)
        rows = draft.parallel_rows(cache, aux[5:9], ids[6:10], 2)
        assert cache.length == 9
        for k in range(3):
            torch.testing.assert_close(rows[3 + k], outs[k][0, 8], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained(model, view, prompts):
    """A two-layer draft that memorised the base's own greedy continuations of the test prompts."""
    torch.manual_seed(0)
    draft = Eagle3Draft(view, ttt_steps=3, num_layers=2)
    batch = greedy_continuation_batch(model, prompts, draft.aux_layers, NEW + 6)
    first, last = fit_draft(draft, [batch], view, LossSection(chunk_size=64), steps=40, lr=1e-2)
    assert float(last.loss.detach()) < 0.3 * first
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in draft.named_parameters()
               if n.startswith("layers.1.self_attn.q_proj"))  # the second layer trains past its identity start
    return draft.eval()


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_trained_two_layer_draft_decodes_losslessly(model, prompts, ar_outputs, trained, mode):
    drafter = Eagle3Drafter(trained, mode=mode, num_speculative_tokens=4)
    assert_lossless_and_accepting(HFBackend(model), drafter, prompts, ar_outputs)


def test_lockstep_field_simulation_equals_per_prompt_with_two_layers(model, view, stored, monkeypatch):  # noqa: F811
    refs, eos = stored
    draft = _fit(model, view, refs, ttt_steps=3, num_layers=2)
    _accepting(_assert_same(model, Eagle3Drafter(draft, mode="tree"), refs, eos, monkeypatch, widths=(3,)))
    _assert_same(model, Eagle3Drafter(draft, mode="chain", num_speculative_tokens=4), refs, eos, monkeypatch,
                 widths=(3,))


def test_export_round_trips(base4, view4, tmp_path):
    d2t = torch.tensor([7, 3, 100, 250, 64, 9, 11, 12, 13, 200, 201, 5])
    draft = perturb(Eagle3Draft(with_draft_vocab(view4, d2t), num_layers=2), 0.2, seed=4).eval()
    batch = random_batch_with_aux(base4, draft, b=1, t=12)
    with torch.no_grad():
        want = [draft.logits(o) for o in draft.ttt_unroll(batch.aux_hidden, batch.input_ids, 3)]
    export_specdraft(draft, tmp_path / "ours", "tiny4", "fp")
    ours, cfg = load_draft(tmp_path / "ours", view4)
    assert cfg["num_layers"] == 2 and ours.num_layers == 2
    spec = export_speculators(draft, tmp_path / "spec", "tiny4", verifier="x")
    layer_cfg = json.loads((spec / "config.json").read_text())["transformer_layer_config"]
    assert layer_cfg["num_hidden_layers"] == 2
    theirs = load_speculators(spec, view4)
    assert theirs.num_layers == 2
    with torch.no_grad():
        for loaded in (ours, theirs):
            got = [loaded.logits(o) for o in loaded.eval().ttt_unroll(batch.aux_hidden, batch.input_ids, 3)]
            for g, w in zip(got, want):
                if loaded is theirs:  # speculators sorts the head's rows by target id: compare in base ids
                    g, w = g[..., torch.argsort(loaded.d2t)], w[..., torch.argsort(draft.d2t)]
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_llamacpp_refuses_a_deeper_draft(tmp_path):
    """On an eight-layer base (three aux layers, which llama.cpp's graph needs), so only the layer count is refused."""
    from transformers import LlamaForCausalLM

    from models.draft import BaseView
    from models.families.eagle3.gguf import converter_input as eagle3_converter_input
    from models.tiny import tiny_llama_config

    torch.manual_seed(0)
    view8 = BaseView.from_model(LlamaForCausalLM(tiny_llama_config(num_layers=8)).eval())
    eagle3_converter_input(Eagle3Draft(view8), {"base_model": "tiny8"}, tmp_path, tmp_path / "one")  # one layer: ok
    with pytest.raises(ValueError) as err:
        eagle3_converter_input(Eagle3Draft(view8, num_layers=2), {"base_model": "tiny8"}, tmp_path, tmp_path / "o")
    msg = str(err.value)
    assert "\n" not in msg and "num_layers=2" in msg and "vllm" in msg, msg
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("overrides, value", [(["draft.eagle3.num_layers=0"], "0"),
                                              (["draft.eagle3.num_layers=5"], "5"), (["draft.num_layers=2"], "2")])
def test_bad_num_layers_fails_at_load_in_one_line(overrides, value):
    with pytest.raises(ConfigError) as err:
        load_train_config(["configs/eagle3.yaml"], overrides)
    msg = str(err.value)
    assert "\n" not in msg and overrides[0].split("=")[0] + "=" + value in msg and "1..4" in msg, msg
    assert "draft.eagle3.num_layers" in msg, msg


def test_smoke_train_and_eval_through_the_cli(tmp_path, clean_env):
    """configs/eagle3.yaml + draft.eagle3.num_layers=2 trains, exports two layers and decodes losslessly."""
    import math

    run_dir = tmp_path / "eagle3-2"
    rows = smoke_cli_train(run_dir, "configs/eagle3.yaml", ["train.max_steps=4", "draft.eagle3.num_layers=2"],
                           clean_env())
    assert any(math.isfinite(r.get("loss/head3", math.nan)) for r in rows)
    cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert cfg["family"] == "eagle3" and cfg["num_layers"] == 2
    report = smoke_cli_eval(run_dir, "chain", ["extra.eagle3_mode=chain", "extra.num_speculative_tokens=3"],
                            clean_env())
    assert report["method"] == "eagle3" and report["lossless"] is True
