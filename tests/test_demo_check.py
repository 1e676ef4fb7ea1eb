"""The demo's exact fp32 check (cli/demo.py, step 5) decodes the run's own tree at the run's own length: a check
on another tree or a shorter length proves nothing about the prompts the bf16 run decoded."""

from __future__ import annotations

import torch
from helpers.reports import fake_hydra_report

import cli.demo as demo
import eval.harness.runner as runner


def test_the_fp32_check_uses_the_runs_tree_and_length(monkeypatch, tmp_path, capsys):
    seen = []

    def fake_eval_export(export_dir, cfg):
        seen.append(cfg)
        extra = {"dtype": cfg.dtype, "lossless_identical": cfg.num_prompts, "lossless_redecoded": 1}
        return fake_hydra_report(cfg, extra), tmp_path

    monkeypatch.setattr(runner, "eval_export", fake_eval_export)
    monkeypatch.setattr("core.hardware.resolve_dtype", lambda name, device: torch.bfloat16)
    demo.evaluate_demo_run(tmp_path, ["dtype=bf16", "num_prompts=8", "tree_choices=null"],
                           check_overrides=["tree_choices=[[0],[1]]", "use_tuning=false"])
    run, check = seen
    assert check.dtype == "fp32" and check.num_prompts == 2
    assert check.max_new_tokens == run.max_new_tokens  # the run's length, not a shorter one
    assert check.tree_choices == [[0], [1]] and check.use_tuning is False  # the run's tuned tree, fixed
    assert "were re-decoded in fp32 in step 4" in capsys.readouterr().out
