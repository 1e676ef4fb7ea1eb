"""`specdraft export --format vllm`: names, shapes, config keys, and a round trip through vLLM's Medusa math.

No vllm here: `vllm_medusa_chain` re-implements what vLLM 0.32's Medusa does with the files (read from its
model_executor/models/medusa.py: ResBlocks x + SiLU(W x + b), one LM head per head or the shared `lm_head`,
token_map scatter into a [V] row of -inf, argmax per head). The end-to-end check with the real engine is
tests/test_serve_check.py (marker `vllm`)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from cli.main import main
from models.base import load_base
from models.draft import BaseView
from models.export.formats import export_vllm
from models.export.vllm import SPECULATIVE_CONFIG_FILE, read_engine_args, vllm_ngram_config
from models.families.medusa.export_vllm import export_vllm_medusa
from models.families.medusa.model import MedusaDraft
from models.families.ngram.export_vllm import export_vllm_ngram

K, L = 3, 2


@pytest.fixture(scope="module")
def tiny():
    base = load_base("tiny")
    return base, BaseView.from_model(base.model)


def _medusa(view, share: bool, seed: int = 0) -> MedusaDraft:
    torch.manual_seed(seed)
    draft = MedusaDraft(K, L, view, share_lm_head=share)
    with torch.no_grad():  # zero-init ResBlocks would hide a swapped weight/bias or head order
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return draft.eval()


def _export_cfg(base, **extra):
    return {"family": "medusa", "base_model": base.name, "base_fingerprint": base.fingerprint, **extra}


def vllm_medusa_chain(out_dir, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [n, d] -> [n, num_heads] base ids: vLLM's Medusa proposal, computed from the exported files only."""
    cfg = json.loads((out_dir / "config.json").read_text())
    t = load_file(str(out_dir / "model.safetensors"))
    token_map = t.get("token_map")
    drafts = []
    for h in range(cfg["num_heads"]):
        x = hidden
        for i in range(cfg["num_hidden_layers"]):
            w, b = t[f"blocks.{h}.layers.{i}.weight"], t[f"blocks.{h}.layers.{i}.bias"] if cfg["medusa_fc_bias"] else 0
            x = x + torch.nn.functional.silu(x @ w.T + b)
        head = t["lm_head.weight"] if cfg["original_lm_head"] else t[f"lm_heads.{h}.weight"]
        logits = x @ head.T  # [n, truncated_vocab_size]
        if token_map is not None and cfg["truncated_vocab_size"] < cfg["vocab_size"]:
            full = torch.full((x.shape[0], cfg["vocab_size"]), -torch.inf)
            full[:, token_map] = logits
            logits = full
        drafts.append(logits.argmax(-1))
    return torch.stack(drafts, dim=1)


def test_shared_head_names_shapes_config(tiny, tmp_path):
    base, view = tiny
    draft = _medusa(view, share=True)
    out = export_vllm(draft, tmp_path / "v", _export_cfg(base), view)
    t = load_file(str(out / "model.safetensors"))
    d, v = view.hidden_size, view.vocab_size
    want = {f"blocks.{h}.layers.{i}.{p}" for h in range(K) for i in range(L) for p in ("weight", "bias")}
    assert set(t) == want | {"lm_head.weight"}
    assert t["blocks.2.layers.1.weight"].shape == (d, d) and t["blocks.2.layers.1.bias"].shape == (d,)
    assert torch.equal(t["blocks.1.layers.0.weight"], draft.heads[1][0].linear.weight)
    assert torch.equal(t["lm_head.weight"], view.lm_head_weight)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == K and cfg["num_hidden_layers"] == L
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is True
    assert cfg["vocab_size"] == cfg["truncated_vocab_size"] == v and cfg["hidden_size"] == d
    assert cfg["base_fingerprint"] == base.fingerprint
    spec = json.loads((out / SPECULATIVE_CONFIG_FILE).read_text())
    assert spec == {"method": "medusa", "model": str(out.resolve()), "num_speculative_tokens": K}


def test_own_heads_names(tiny, tmp_path):
    base, view = tiny
    draft = _medusa(view, share=False)
    out = export_vllm(draft, tmp_path / "v", _export_cfg(base), view)
    t = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in t and "token_map" not in t
    for h in range(K):
        assert torch.equal(t[f"lm_heads.{h}.weight"], draft.heads[h][L].weight)
    assert json.loads((out / "config.json").read_text())["original_lm_head"] is False


@pytest.mark.parametrize("share", [True, False])
def test_round_trip_chain_matches_our_top1(tiny, tmp_path, share):
    """vLLM's proposal from the files == our heads' top-1 per depth (what our chain drafter proposes)."""
    base, view = tiny
    draft = _medusa(view, share=share, seed=1)
    out = export_vllm(draft, tmp_path / "v", _export_cfg(base), view)
    hidden = torch.randn(64, view.hidden_size)
    with torch.no_grad():
        ours = draft(hidden).argmax(-1).T  # [n, K]
    assert torch.equal(vllm_medusa_chain(out, hidden), ours)


def test_draft_vocabulary_token_map(tiny, tmp_path):
    """A d2t buffer set by hand: token_map = d2t, lm_head = W[d2t], truncated_vocab_size = N, and vLLM's
    proposal equals drafting over the N rows then mapping draft ids to base ids."""
    base, view = tiny
    draft = _medusa(view, share=True, seed=2)
    n = 40
    d2t = torch.randperm(view.vocab_size, generator=torch.Generator().manual_seed(0))[:n]
    draft.register_buffer("d2t", d2t)
    out = export_vllm(draft, tmp_path / "v", _export_cfg(base, draft_vocab_size=n), view)
    t = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert t["token_map"].dtype == torch.int64 and torch.equal(t["token_map"], d2t)
    assert torch.equal(t["lm_head.weight"], view.lm_head_weight[d2t])
    assert cfg["truncated_vocab_size"] == n and cfg["vocab_size"] == view.vocab_size
    # vLLM 0.32 reads token_map but never reports it loaded: the export asks for its strict check off
    assert read_engine_args(out) == {"model_loader_extra_config": {"enable_weights_track": False}}
    assert read_engine_args(export_vllm(_medusa(view, share=True), tmp_path / "full", _export_cfg(base), view)) == {}
    hidden = torch.randn(64, view.hidden_size)
    with torch.no_grad():
        ids = torch.stack([(draft.head_trunk(k, hidden) @ view.lm_head_weight[d2t].T).argmax(-1)
                           for k in range(1, K + 1)], dim=1)
    assert torch.equal(vllm_medusa_chain(out, hidden), d2t[ids])


def test_draft_vocabulary_errors(tiny, tmp_path):
    base, view = tiny
    own = _medusa(view, share=False)
    own.register_buffer("d2t", torch.arange(10))
    with pytest.raises(ValueError, match="share_lm_head=true"):
        export_vllm(own, tmp_path / "a", _export_cfg(base, draft_vocab_size=10), view)
    shared = _medusa(view, share=True)
    with pytest.raises(ValueError, match="no d2t buffer"):
        export_vllm(shared, tmp_path / "b", _export_cfg(base, draft_vocab_size=10), view)
    shared.register_buffer("d2t", torch.arange(12))
    with pytest.raises(ValueError, match="holds 12 ids"):
        export_vllm(shared, tmp_path / "c", _export_cfg(base, draft_vocab_size=10), view)
    shared.d2t = torch.tensor([0, view.vocab_size])
    with pytest.raises(ValueError, match="another base"):
        export_vllm(shared, tmp_path / "d", _export_cfg(base, draft_vocab_size=2), view)


@pytest.mark.parametrize("family,formats", [("hydra", "specdraft"), ("redrafter", "specdraft, redrafter-trtllm"),
                                            ("ctc", "specdraft")])
def test_families_vllm_cannot_serve(tiny, tmp_path, family, formats):
    _, view = tiny
    with pytest.raises(ValueError, match=f"vLLM cannot serve a '{family}'.*formats for {family}: {formats}"):
        export_vllm(torch.nn.Linear(1, 1), tmp_path / "x", {"family": family}, view)
    assert not (tmp_path / "x").exists()


def test_ngram_speculative_config(tmp_path):
    assert vllm_ngram_config({"w": 4, "q": 2, "k": 10}) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match="w >= 1"):
        vllm_ngram_config({"w": 0})
    from models.registry import family_spec  # each family registers its writer (FamilySpec.writers["vllm"])

    assert family_spec("medusa").writers["vllm"] is export_vllm_medusa
    assert family_spec("ngram").writers["vllm"] is export_vllm_ngram
    assert main(["export", "--format", "vllm", "--method", "ngram", "--out", str(tmp_path / "ng"),
                 "extra.w=5", "extra.q=3"]) == 0
    spec = json.loads((tmp_path / "ng" / SPECULATIVE_CONFIG_FILE).read_text())
    assert spec["num_speculative_tokens"] == 5 and spec["prompt_lookup_min"] == spec["prompt_lookup_max"] == 3


def test_cli_export_vllm_from_run(smoke_run, tmp_path, capsys):
    run_dir, _ = smoke_run
    out = tmp_path / "vllm"
    assert main(["export", "--run", str(run_dir), "--format", "vllm", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert cfg["num_heads"] == exported["num_heads"] and cfg["base_fingerprint"] == exported["base_fingerprint"]
    assert main(["export", "--format", "vllm", "--out", str(out)]) == 2  # neither --run nor --method
    assert "--run" in capsys.readouterr().err
