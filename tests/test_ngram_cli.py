"""`specdraft eval --method ngram` end to end on the tiny base: report contract, cached table, errors."""

import json
import subprocess
import sys

from eval.harness.report import REPORT_KEYS


def _eval(args, env):
    return subprocess.run([sys.executable, "-m", "cli.main", "eval", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_ngram_method_writes_the_contract_report(tmp_path, clean_env):
    env = clean_env({"SPECDRAFT_CACHE": str(tmp_path / "cache")})
    args = ["--method", "ngram", "--config", "configs/eval/ngram_smoke.yaml", f"run_dir={tmp_path / 'run'}"]
    proc = _eval(args + ["prompt_lookup=true"], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "eval" / "ngram-smoke" / "report.json").read_text())
    assert set(report) - {"extra"} == set(REPORT_KEYS)
    assert report["method"] == "ngram" and report["base_model"] == "tiny" and report["num_prompts"] == 3
    assert report["lossless"] is True  # greedy, fp32
    assert len(report["accept_rate_per_position"]) == 3  # w = 3
    extra = report["extra"]
    assert (extra["k"], extra["w"], extra["strategy"], extra["max_nodes"]) == (4, 3, "mixed", 13)
    assert extra["bigram_table_cached"] is False and extra["prompt_lookup"]["tokens_per_second"] > 0
    assert "speedup" in proc.stdout
    # Second run: the table comes from the disk cache; overrides reach the drafter.
    proc = _eval(args + ["extra.k=2", "extra.w=5"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    extra = json.loads((tmp_path / "run" / "eval" / "ngram-smoke" / "report.json").read_text())["extra"]
    assert extra["bigram_table_cached"] is True and (extra["k"], extra["w"]) == (2, 5)


def test_ngram_method_errors_are_clear(tmp_path, clean_env):
    env = clean_env({"SPECDRAFT_CACHE": str(tmp_path / "cache")})
    proc = _eval(["--method", "nope", "--config", "configs/eval/ngram_smoke.yaml", f"run_dir={tmp_path}"], env)
    assert proc.returncode != 0 and "unknown --method 'nope'" in proc.stderr
    proc = _eval(["--method", "ngram", "--config", "configs/eval/ngram_smoke.yaml", f"run_dir={tmp_path}",
                  "extra.kk=3"], env)
    assert proc.returncode != 0 and "unknown drafter option(s) ['kk']" in proc.stderr


def test_ngram_sweep_mode_writes_grid_table_and_heatmap(tmp_path, clean_env):
    env = clean_env({"SPECDRAFT_CACHE": str(tmp_path / "cache")})
    proc = _eval(["--method", "ngram", "--config", "configs/eval/ngram_smoke.yaml", f"run_dir={tmp_path / 'run'}",
                  "sweep_k=[1,2]", "sweep_w=[1,3]"], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = tmp_path / "run" / "eval" / "ngram-smoke" / "sweep"
    result = json.loads((out / "sweep.json").read_text())
    assert [(c["k"], c["w"]) for c in result["cells"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(c["acceptance_length"] >= 1.0 and c["lossless"] for c in result["cells"])  # fp32 greedy
    assert (out / "sweep_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert "| k \\ w | 1 | 3 |" in (out / "sweep.md").read_text()
