"""`specdraft eval` end to end on a smoke-trained export: the report contract, files, losslessness."""

import json
import subprocess
import sys

from eval.harness.report import PLOT_FILES, REPORT_KEYS


def test_eval_cli_writes_the_contract_report(smoke_run, clean_env):
    run_dir, _ = smoke_run
    proc = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--draft", str(run_dir / "export"),
                           "--config", "configs/eval/smoke.yaml", "backend=hf"],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = run_dir / "eval" / "smoke"
    report = json.loads((out / "report.json").read_text())
    assert set(report) - {"extra"} == set(REPORT_KEYS)
    assert report["method"] == "medusa" and report["base_model"] == "tiny" and report["num_prompts"] == 3
    assert report["lossless"] is True and report["lossless_fraction"] == 1.0  # greedy, fp32: exact
    assert report["acceptance_length"] >= 1.0
    assert len(report["accept_rate_per_position"]) == 4  # chain4 on 4 heads
    assert report["ar_tokens_per_second"] > 0 and report["hf_tokens_per_second"] > 0
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3
    for name in PLOT_FILES.values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "acceptance length" in proc.stdout and "speedup" in proc.stdout


def test_eval_cli_errors_are_clear(tmp_path, clean_env):
    proc = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--draft", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 2 and "no config.json" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--draft", str(tmp_path), "tree=nope"],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 2 and "tree" in proc.stderr


def test_sharegpt_eval_skips_exactly_the_training_conversations():
    import pytest

    from eval.harness.config import load_eval_config
    from eval.harness.runner import resolve_heldout_skip

    cfg = load_eval_config(["configs/eval/sharegpt.yaml"])
    trained = {"train_data": {"source": "sharegpt", "max_records": 1500}}
    assert resolve_heldout_skip(cfg, trained).heldout_skip == 1500
    with pytest.raises(ValueError, match="heldout_skip=100 would evaluate on conversations"):
        resolve_heldout_skip(load_eval_config(["configs/eval/sharegpt.yaml"], ["heldout_skip=100"]), trained)
    with pytest.raises(ValueError, match="every ShareGPT conversation"):
        resolve_heldout_skip(cfg, {"train_data": {"source": "sharegpt", "max_records": None}})
    other = {"train_data": {"source": "my_chats.jsonl", "max_records": None}}
    assert resolve_heldout_skip(cfg, other).heldout_skip == 0
    assert resolve_heldout_skip(load_eval_config([], ["dataset=mtbench"]), trained).heldout_skip is None
