"""`specdraft serve-check`: report arithmetic, actionable errors (no vllm needed), and one end-to-end run with
the real vLLM engine (marker `vllm`: skipped without .venv-vllm; `make vllm` builds it)."""

import json
import os
import stat
import time
from pathlib import Path

import pytest

from cli.main import main
from eval.engine.tree import chain_choices
from eval.serving.serve_check import (
    ServeCheckError,
    check_fingerprint,
    root_cause,
    run_engine,
    vllm_python,
)
from eval.serving.serve_check_report import (
    agreement,
    build_serve_report,
    compare_acceptance,
    mismatch_message,
    vllm_engine_numbers,
)


def _runner_result(per_pos, drafts, accepted, rows):
    return {"results": rows, "timing": "engine_timestamps", "spec_decode": {
        "vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": drafts * len(per_pos),
        "vllm:spec_decode_num_accepted_tokens": accepted,
        "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos}}


def test_vllm_numbers_from_counters():
    rows = [{"id": "a", "tokens": list(range(20)), "decode_seconds": 0.5},
            {"id": "b", "tokens": list(range(6)), "decode_seconds": 0.5}]
    e = vllm_engine_numbers(_runner_result([8, 4, 1], drafts=10, accepted=13, rows=rows))
    assert e["accept_rate_per_position"] == [0.8, 0.4, 0.1]
    # 26 tokens from 26 - 13 = 13 engine steps (each emits one token + its accepted drafts); 1.3 per draft
    assert e["acceptance_length"] == pytest.approx(2.0) and e["accepted_per_draft"] == pytest.approx(1.3)
    assert e["new_tokens"] == 24 and e["tokens_per_second"] == pytest.approx(24.0)  # first token = prefill's
    ar = vllm_engine_numbers({"results": rows, "spec_decode": {}})
    assert ar["accept_rate_per_position"] == [] and ar["acceptance_length"] == 1.0


def test_compare_acceptance_names_the_position():
    ok = compare_acceptance([0.15, 0.01, 0.0], [0.148, 0.012, 0.0], 0.03)
    assert ok["ok"] and ok["worst_position"] == 1 and ok["max_abs_diff"] == pytest.approx(0.002)
    bad = compare_acceptance([0.15, 0.20, 0.0], [0.15, 0.01, 0.0], 0.03)
    assert not bad["ok"] and bad["positions_over_tolerance"] == [2]
    msg = mismatch_message(bad, "medusa chain of 3")
    assert "position 2: vLLM 0.200 vs ours 0.010" in msg and "format or semantics bug" in msg
    short = compare_acceptance([0.3, 0.1], [0.3, 0.1, 0.05], 0.03)  # a depth only one side drafted
    assert not short["ok"] and short["positions_over_tolerance"] == [3]
    assert not compare_acceptance([], [], 0.03)["ok"]  # nothing measured is not a pass
    exact = compare_acceptance([0.2, 0.1], [0.2, 0.1], 0.03)
    assert exact["ok"] and exact["max_abs_diff"] == 0 and exact["worst_position"] == 1


def test_agreement_and_report_table():
    ref = {"a": [1, 2, 3, 4], "b": [5, 6]}
    assert agreement(ref, {"a": [1, 2, 3, 4], "b": [5, 6]}) == {"identical_prompts": 1.0,
                                                                "common_prefix_fraction": 1.0, "prompts": 2}
    part = agreement(ref, {"a": [1, 2, 9, 9], "b": [5, 6]})
    assert part["identical_prompts"] == 0.5 and part["common_prefix_fraction"] == pytest.approx(0.75)
    assert agreement(ref, {}) is None
    engines = {"vllm_ar": {"tokens_per_second": 50.0, "outputs": ref},
               "ours_draft": {"tokens_per_second": 75.0, "accept_rate_per_position": [0.5], "outputs": ref,
                              "acceptance_length": 1.5}}
    report = build_serve_report(engines, compare_acceptance([0.5], [0.5], 0.03), {})
    assert report["engines"]["ours_draft"]["speedup_vs_vllm_ar"] == pytest.approx(1.5)
    assert report["engines"]["ours_draft"]["agreement_with_vllm_ar"]["identical_prompts"] == 1.0
    assert "outputs" not in report["engines"]["vllm_ar"]


def test_chain_choices():
    assert chain_choices(3) == [[0], [0, 0], [0, 0, 0]]


def test_root_cause_skips_wrappers():
    lines = ["INFO fine", "(Worker) ERROR RuntimeError: Unsupported CPU attention configuration: head_dim=16",
             "RuntimeError: Worker failed with error 'x', please check the stack trace",
             "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."]
    assert root_cause(lines) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    assert root_cause(["nothing here"]) is None


def test_missing_venv_says_make_vllm(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_VLLM_VENV", str(tmp_path / "nope"))
    with pytest.raises(ServeCheckError, match="make vllm"):
        vllm_python()
    assert main(["serve-check", "--engine", "vllm", "--method", "ngram"]) == 3
    assert "make vllm" in capsys.readouterr().err
    # --engine auto (the default) falls back to llama.cpp where it is built; with neither, both fixes are named
    monkeypatch.setenv("SPECDRAFT_LLAMACPP_DIR", str(tmp_path / "no-llamacpp"))
    assert main(["serve-check", "--method", "ngram"]) == 3
    err = capsys.readouterr().err
    assert "make vllm" in err and "make llamacpp" in err


def _fake_venv(tmp_path, monkeypatch, script: str):
    """A venv whose `python` is a shell script standing in for the vLLM runner."""
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n" + script)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("SPECDRAFT_VLLM_VENV", str(tmp_path / "venv"))


def test_engine_death_shows_reason_and_log(tmp_path, monkeypatch):
    _fake_venv(tmp_path, monkeypatch, "echo '[serve-check] x: building'\necho 'loading...'\n"
               "echo '(Worker) ERROR ValueError: bad tensor blocks.0.layers.0.weight'\nexit 1\n")
    with pytest.raises(ServeCheckError, match=r"died with exit code 1: ValueError: bad tensor") as err:
        run_engine({"label": "x", "base_dir": "/b"}, tmp_path, timeout=60)
    assert "loading..." in str(err.value) and (tmp_path / "x.log").is_file()


def test_engine_load_error_is_reported(tmp_path, monkeypatch):
    # The runner writes {"error": "load"} to the job's "out" (argument 2 of the script: the job file).
    _fake_venv(tmp_path, monkeypatch, 'out=$(sed -n \'s/.*"out": "\\([^"]*\\)".*/\\1/p\' "$2")\n'
               'echo \'{"error": "load", "message": "ValueError: no config.json"}\' > "$out"\nexit 3\n')
    with pytest.raises(ServeCheckError, match="could not build the engine for x on /b.*no config.json"):
        run_engine({"label": "x", "base_dir": "/b"}, tmp_path, timeout=60)


def test_engine_runs_from_a_relative_work_directory(tmp_path, monkeypatch):
    # `serve-check --method ngram` works under runs/ngram/... (relative); the runner runs in that directory, so
    # it must get absolute paths for its job file and its result (a relative one pointed below itself).
    _fake_venv(tmp_path, monkeypatch, 'out=$(sed -n \'s/.*"out": "\\([^"]*\\)".*/\\1/p\' "$2")\n'
               'echo \'{"results": [], "label": "x"}\' > "$out"\n')
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "w").mkdir(parents=True)
    result = run_engine({"label": "x", "base_dir": "/b"}, Path("runs/w"), timeout=60)
    assert result["label"] == "x" and (tmp_path / "runs" / "w" / "x.result.json").is_file()


def test_engine_timeout_kills_the_group(tmp_path, monkeypatch):
    pidfile = tmp_path / "child.pid"
    _fake_venv(tmp_path, monkeypatch, f"sleep 300 &\necho $! > {pidfile}\necho '[serve-check] x: hanging'\nwait\n")
    t0 = time.monotonic()
    with pytest.raises(ServeCheckError, match="did not finish within 2 s"):
        run_engine({"label": "x", "base_dir": "/b"}, tmp_path, timeout=2)
    assert time.monotonic() - t0 < 30
    child = int(pidfile.read_text())
    time.sleep(0.5)
    # The engine's own children die with it (no hang, no orphan): gone, or a zombie waiting for init to reap it.
    stat_file = f"/proc/{child}/stat"
    assert not os.path.exists(stat_file) or open(stat_file).read().split(")")[-1].split()[0] == "Z"


def test_fingerprint_mismatch_is_an_error(tmp_path):
    from vllm_fixtures import servable_tiny_base

    d = servable_tiny_base(tmp_path / "base")
    with pytest.raises(ServeCheckError, match="fingerprint"):
        check_fingerprint({"base_model": "x", "base_fingerprint": "0" * 16}, d, "runs/x/export")
    from models.base import fingerprint_checkpoint

    check_fingerprint({"base_fingerprint": fingerprint_checkpoint(d)}, d, "runs/x/export")  # same base: fine


def _have_vllm() -> bool:
    try:
        vllm_python()
        return True
    except ServeCheckError:
        return False


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_serve_check_end_to_end(tmp_path, capsys):
    """The real engine serves our Medusa export: the CLI exits 0, per-position acceptance agrees with our chain
    decoder, and the report, the PNG and vLLM's copy of the export are written."""
    from vllm_fixtures import medusa_export_on_servable_base

    export = medusa_export_on_servable_base(tmp_path)
    rc = main(["serve-check", "--draft", str(export), "--config", "configs/eval/smoke.yaml", "max_new_tokens=32",
               "serve_enforce_eager=true"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "vllm_draft: prompt 3/3" in out and "| vLLM + draft |" in out
    report_dir = tmp_path / "run" / "serve_check" / "smoke"
    report = json.loads((report_dir / "report.json").read_text())
    acc = report["acceptance_check"]
    assert acc["ok"] and len(acc["vllm"]) == 3 and acc["max_abs_diff"] <= 0.03
    assert report["engines"]["vllm_draft"]["num_drafts"] > 0
    assert any(r > 0 for r in acc["vllm"])  # something was accepted: the check compared real numbers
    # fp32 on both sides: greedy outputs agree with vLLM AR, and our decoder stayed lossless
    assert report["engines"]["ours_ar"]["agreement_with_vllm_ar"]["common_prefix_fraction"] > 0.9
    assert report["our_lossless"] is True
    assert (report_dir / "serve_check.png").stat().st_size > 0 and (report_dir / "report.md").is_file()
    assert (report_dir / "vllm" / "export" / "model.safetensors").is_file()
    # The second check: both engines' n-gram drafts (vLLM's prompt-lookup rule on our side too).
    assert report["ngram_check"]["ok"] and report["engines"]["ours_ngram"]["accept_rate_per_position"]


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_serve_check_of_a_family_vllm_cannot_serve(tmp_path, capsys):
    """A Hydra export (the `make demo` family): no vLLM + draft row, ours decodes the draft with its eval tree
    beside vLLM AR and vLLM's n-gram, and the n-gram acceptance of both engines is the check (exit 0)."""
    from vllm_fixtures import hydra_export_on_servable_base

    export = hydra_export_on_servable_base(tmp_path)
    rc = main(["serve-check", "--draft", str(export), "--config", "configs/eval/smoke.yaml", "max_new_tokens=32",
               "serve_enforce_eager=true", "num_prompts=2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no method for a hydra draft" in out and "| ours + draft |" in out and "| vLLM + draft |" not in out
    report = json.loads((tmp_path / "run" / "serve_check" / "smoke" / "report.json").read_text())
    assert report["draft_served_by_vllm"] is False and "vllm_draft" not in report["engines"]
    assert report["acceptance_check"]["ok"] and report["engines"]["vllm_ngram"]["num_drafts"] > 0
    assert report["our_lossless"] is True


VLLM_PROPOSALS = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as propose
cases = json.load(sys.stdin)
print(json.dumps([propose(np.array(c["seq"], dtype=np.int32), c["q_min"], c["q_max"], 10**6, c["w"]).tolist()
                  for c in cases]))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_longest_match_proposes_what_vllms_ngram_proposer_proposes():
    """Our strategy=longest_match row equals vLLM's own prompt-lookup function on random, repetitive sequences
    (the rule serve-check --method ngram relies on; the engine run compares only aggregate acceptance)."""
    import subprocess

    import torch

    from models.families.ngram.drafter import longest_match_row

    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in (1, 2, 3, 8, 30, 200):
        for symbols in (2, 3, 6):
            for q_min, q_max, w in ((1, 1, 3), (1, 4, 5), (2, 3, 2), (3, 3, 10)):
                seq = torch.randint(0, symbols, (n,), generator=gen).tolist()
                cases.append({"seq": seq, "q_min": q_min, "q_max": q_max, "w": w})
    proc = subprocess.run([str(vllm_python()), "-c", VLLM_PROPOSALS], input=json.dumps(cases), text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [longest_match_row(torch.tensor(c["seq"]), c["q_min"], c["q_max"], c["w"]) for c in cases]
    assert sum(len(r) > 0 for r in theirs) >= len(cases) // 3  # many cases propose something
    mismatches = [(c, t, o) for c, t, o in zip(cases, theirs, ours) if t != o]
    assert not mismatches, mismatches[:3]
