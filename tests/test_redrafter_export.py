"""ReDrafter exports: the specdraft format through load_draft, the TensorRT-LLM drafter layout (names,
config keys, read back into a fresh model), and `specdraft export --format redrafter-trtllm`."""

import json

import pytest
import torch

from cli.main import main as cli_main
from models.base import load_base
from models.draft import BaseView
from models.export.specdraft import export_specdraft, load_draft, read_tensors
from models.families.medusa.model import MedusaDraft
from models.families.redrafter.export_trtllm import export_redrafter_trtllm, load_redrafter_trtllm
from models.families.redrafter.model import ReDrafterDraft


@pytest.fixture(scope="module")
def base():
    return load_base("tiny")


@pytest.fixture(scope="module")
def view(base):
    return BaseView.from_model(base.model)


def _trained_like(draft, seed=0):
    """Every weight moved off its initial value, so a round trip cannot pass by re-initialising."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return draft.eval()


def _same_outputs(a, b, view):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 9, view.hidden_size, generator=gen)
    ids = torch.randint(3, view.vocab_size, (1, 9), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(a.teacher_forced_logits(hidden, ids), b.teacher_forced_logits(hidden, ids))


VARIANTS = [dict(), dict(share_lm_head=True), dict(rnn=False)]


@pytest.mark.parametrize("kw", VARIANTS)
def test_specdraft_export_round_trips(kw, base, view, tmp_path):
    draft = _trained_like(ReDrafterDraft(5, 2, view, beam_width=6, beam_length=3, **kw))
    export_specdraft(draft, tmp_path / "export", base.name, base.fingerprint)
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["family"] == "redrafter" and (cfg["beam_width"], cfg["beam_length"]) == (6, 3)
    assert set(read_tensors(tmp_path / "export" / "model.safetensors")) == set(draft.state_dict())
    loaded, _ = load_draft(tmp_path / "export", view, base.fingerprint)
    assert isinstance(loaded, ReDrafterDraft) and loaded.export_config() == draft.export_config()
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    _same_outputs(draft, loaded, view)


def test_trtllm_layout_names_and_config(view, tmp_path):
    draft = _trained_like(ReDrafterDraft(5, 2, view))
    export_redrafter_trtllm(draft, tmp_path / "trt", {"base_model": "tiny"}, view, beam_width=8, beam_length=5)
    cfg = json.loads((tmp_path / "trt" / "config.json").read_text())
    d = view.hidden_size
    assert cfg["model_type"] == "recurrent_drafting_drafter"
    assert (cfg["hidden_size"], cfg["exit_dim"], cfg["vocab_size"]) == (d, 2 * d, view.vocab_size)
    assert cfg["num_draft_layers"] == 2 and cfg["rnn"] is True
    assert cfg["redrafter_num_beams"] == 8 and cfg["redrafter_draft_len_per_beam"] == 4  # root excluded
    tensors = read_tensors(tmp_path / "trt" / "model.safetensors")
    assert set(tensors) == {"rnn_u.weight", "rnn_u.bias", "rnn_w.weight", "lm_head.0.linear.weight",
                            "lm_head.0.linear.bias", "lm_head.1.linear.weight", "lm_head.1.linear.bias",
                            "lm_head.2.weight"}  # no input_proj: exit_dim == 2 * hidden_size
    assert torch.equal(tensors["lm_head.2.weight"], draft.lm_head.weight)
    assert torch.equal(tensors["lm_head.1.linear.bias"], draft.layers[1].linear.bias)
    assert tensors["lm_head.2.weight"].shape == (view.vocab_size, 2 * d)


@pytest.mark.parametrize("kw", VARIANTS)
def test_trtllm_export_reads_back_into_a_fresh_model(kw, view, tmp_path):
    draft = _trained_like(ReDrafterDraft(5, 2, view, **kw), seed=3)
    export_redrafter_trtllm(draft, tmp_path / "trt", {"base_model": "tiny"}, view)
    tensors = read_tensors(tmp_path / "trt" / "model.safetensors")
    assert ("input_proj.weight" in tensors) == bool(kw.get("share_lm_head"))
    assert ("rnn_u.weight" in tensors) == kw.get("rnn", True)
    if kw.get("share_lm_head"):  # the reference drafter always carries its head: the frozen base one
        assert torch.equal(tensors["lm_head.2.weight"], view.lm_head_weight)
    loaded = load_redrafter_trtllm(tmp_path / "trt", view)
    assert (loaded.share_lm_head, loaded.rnn, loaded.num_layers) == (draft.share_lm_head, draft.rnn, 2)
    assert (loaded.beam_width, loaded.beam_length) == (draft.beam_width, draft.beam_length)
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    _same_outputs(draft, loaded, view)


def test_trtllm_export_rejects_other_families_and_bad_beams(view, tmp_path):
    with pytest.raises(ValueError, match="ReDrafter"):
        export_redrafter_trtllm(MedusaDraft(2, 1, view), tmp_path / "m", {"base_model": "tiny"}, view)
    with pytest.raises(ValueError, match="beam_length"):
        export_redrafter_trtllm(ReDrafterDraft(2, 1, view), tmp_path / "r", {"base_model": "tiny"}, view, beam_length=1)
    assert not (tmp_path / "r").exists()


def test_cli_export_format_redrafter_trtllm(base, view, tmp_path):
    run = tmp_path / "run"
    draft = _trained_like(ReDrafterDraft(5, 1, view, beam_width=3, beam_length=4))
    export_specdraft(draft, run / "export", base.name, base.fingerprint)
    assert cli_main(["export", "--run", str(run), "--format", "redrafter-trtllm", "--out", str(tmp_path / "t")]) == 0
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert (cfg["redrafter_num_beams"], cfg["redrafter_draft_len_per_beam"]) == (3, 3)
    assert cfg["base_model_name_or_path"] == "tiny"
    _same_outputs(draft, load_redrafter_trtllm(tmp_path / "t", view), view)
