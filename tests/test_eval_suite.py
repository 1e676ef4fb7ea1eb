"""`specdraft eval --suite`: a 2-set suite end to end on the smoke export (one table, one plot), the ShareGPT domain
tagging rule, and the one-line answer to an unknown suite or set."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eval.harness.domains import tag_domain
from eval.harness.suite import load_suite, suite_names


def test_a_two_set_suite_writes_one_table_and_one_plot(smoke_run, clean_env):
    run_dir, _ = smoke_run
    proc = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--draft", str(run_dir / "export"), "--suite",
                           "smoke", "--config", "configs/eval/smoke.yaml", "backend=hf"],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = run_dir / "eval" / "suite-smoke"
    summary = json.loads((out / "suite.json").read_text())
    assert [r["set"] for r in summary["sets"]] == ["mtbench", "humaneval"]
    for row in summary["sets"]:
        assert row["num_prompts"] == 2 and row["acceptance_length"] >= 1.0 and row["lossless"] is True
        assert len(row["accept_rate_per_position"]) == 4  # chain of the 4 smoke heads
        assert row["speedup"] > 0
        # every set has its own full report, on its own prompts
        report = json.loads((out / row["set"] / "report.json").read_text())
        assert report["acceptance_length"] == row["acceptance_length"]
        assert report["dataset"].endswith(f"prompts/{row['set']}.jsonl")
    ids = [json.loads(ln)["id"] for ln in (out / "humaneval" / "samples.jsonl").read_text().splitlines()]
    assert all(i.startswith("humaneval-HumanEval-") for i in ids)  # <file stem>-<task id>
    table = [ln for ln in (out / "suite.md").read_text().splitlines() if ln.startswith("| ")]
    assert table[0].startswith("| set | prompts | AL | speedup vs own AR")
    assert [ln.split("|")[1].strip() for ln in table[1:]] == ["mtbench", "humaneval"]
    assert (out / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| mtbench | 2 |" in proc.stdout


@pytest.mark.parametrize("text, domain", [
    ("Can you fix this?\n```\nx = 1\n```", "code"),
    ("How do I read a CSV file with pandas?", "code"),
    ("Write a python function that reverses a string", "code"),  # code wins over writing
    ("Solve for x: 3x + 2 = 11", "math"),
    ("What is 12 * 7?", "math"),
    ("Calculate the probability of two sixes", "math"),
    ("Write an essay about the French revolution", "writing"),
    ("Please compose a short poem about autumn", "writing"),
    ("Write a 2-3 paragraph story about a dog", "writing"),  # a range, not arithmetic; and writing comes first
    ("Rewrite this paragraph to sound friendlier", "writing"),
    ("What are good places to visit in Lisbon?", "chat"),
    ("Give me 2-3 ideas for a birthday party", "chat"),
])
def test_the_domain_tagging_rule(text, domain):
    assert tag_domain(text) == domain


def test_unknown_suite_or_set_is_one_line_naming_those_that_exist(tmp_path, clean_env):
    with pytest.raises(ValueError, match=r"unknown suite 'nope'; suites: default, smoke"):
        load_suite("nope")
    with pytest.raises(ValueError, match=r"suite 'default' has no set 'gsm8k'; its sets: mtbench, humaneval, math"):
        load_suite("default", ["gsm8k"])
    assert {"default", "smoke"} <= set(suite_names())
    assert [s.name for s in load_suite("default", ["humaneval", "sharegpt-code"]).sets] == ["humaneval",
                                                                                           "sharegpt-code"]
    for extra in (["--suite", "nope"], ["--suite", "default", "suite_sets=[mtbench,nope]"]):
        proc = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--draft", str(tmp_path), *extra],
                              capture_output=True, text=True, timeout=300, env=clean_env())
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
        assert len(errors) == 1 and ("suites: default" in errors[0] or "its sets: mtbench" in errors[0]), errors


def test_a_compare_config_suite_adds_one_setting_per_set(tmp_path):
    from core.config_loader import ConfigError
    from eval.harness.compare_config import CompareConfig, setting_configs

    cfg = CompareConfig(out_dir=str(tmp_path), suite="smoke", suite_prompts=3,
                        settings=[{"name": "mtbench-greedy", "dataset": "mtbench"}], eval={"max_new_tokens": 16})
    settings = setting_configs(cfg)
    assert list(settings) == ["mtbench-greedy", "suite-mtbench", "suite-humaneval"]
    for name in ("suite-mtbench", "suite-humaneval"):
        s = settings[name]
        assert s.num_prompts == 3 and s.max_new_tokens == 16 and s.dataset.endswith(f"{name[6:]}.jsonl")
    assert len((tmp_path / "suite" / "prompts" / "humaneval.jsonl").read_text().splitlines()) == 164
    with pytest.raises(ConfigError, match="eval.heldout_skip"):  # held-out ShareGPT sets need to know the skip
        setting_configs(CompareConfig(out_dir=str(tmp_path), suite="default",
                                      settings=[{"name": "m", "dataset": "mtbench"}]))
