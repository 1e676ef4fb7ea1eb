"""The whole pipeline on the real SmolLM2 and ShareGPT packages (slow: ~2 min on 2 CPU cores)."""

import json

import pytest

from eval.harness.config import load_eval_config
from eval.harness.report import REPORT_KEYS
from eval.harness.runner import eval_export
from train.config import load_train_config

pytestmark = pytest.mark.slow


def test_train_then_eval_on_smollm2(tmp_path):
    from train.loop import train

    run_dir = tmp_path / "real"
    from cli.demo import RECIPE

    cfg = load_train_config([f"configs/{RECIPE}", "configs/demo.yaml"], [
        f"run_dir={run_dir}", "data.max_records=200", "data.max_length=256", "train.max_steps=3",
        "train.max_minutes=0", "train.save_every=0", "train.val_batches=2", "wandb.enabled=false"])
    train(cfg)
    heldout = json.loads((run_dir / "heldout.json").read_text())
    assert [d["depth"] for d in heldout["depths"]] == list(range(1, cfg.draft.num_heads + 1))
    assert heldout["depths"][0]["tokens"] > 100

    eval_cfg = load_eval_config(["configs/eval/mtbench.yaml"], ["num_prompts=2", "max_new_tokens=24",
                                                                "warmup_tokens=4", "name=real-smoke"])
    report, out_dir = eval_export(run_dir / "export", eval_cfg)
    assert set(report) - {"extra"} == set(REPORT_KEYS)
    assert report["base_model"] == "smollm2" and report["dataset"] == "mtbench" and report["num_prompts"] == 2
    # fp32, greedy: speculative output equals plain greedy decoding token for token.
    assert report["lossless_fraction"] == 1.0
    # Own AR and transformers generate agree too (same base, same greedy rule).
    assert report["extra"]["hf_matches_spec_fraction"] == 1.0
    assert (out_dir / "report.md").exists()
