"""One repeat rule for every chooser (eval/choice/record.py): a choice made from at least MIN_REPEATS paired
passes per setting is tuned; one made from fewer (the demo's tree sweep, eval's shape probe) is marked quick with
its repeats and the run that made it, and `specdraft eval` applies it only in that run: elsewhere one line says why
and the eval decodes its untuned default."""

from __future__ import annotations

import json

import pytest

from eval.choice.apply import tuned_eval_config
from eval.choice.record import MIN_REPEATS, RUN_ID, applicable, repeats_mark
from eval.harness.config import load_eval_config
from eval.harness.runner import eval_export, format_summary

pytestmark = pytest.mark.usefixtures("one_thread")

SMOKE_EVAL = ["configs/eval/smoke.yaml"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from helpers.drafts import tiny_hydra_export

    return tiny_hydra_export(tmp_path_factory.mktemp("run"))


def _write_choice(export, cfg, **mark):
    """A tuning.json whose choice for ours (the top-1 tree) was measured here, with the repeat rule's `mark`."""
    from eval.choice.apply import ours_here
    from eval.choice.record import write_tuning
    from eval.choice.stats import choose

    here = ours_here(cfg)
    point = {"label": "top-1", "knobs": {"tree_choices": [[0]]}, "cost": 1.0, "status": "ok", "speedup": 1.3,
             "ratios": [1.3] * 3, "ar_null": [0.0, 0.0]}
    machine = {**{k: here[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}, "cores": 2}
    write_tuning(export, {}, {"ours": {"engine": "ours", "dtype": here["dtype"], "threads": here["threads"],
                                       "version": here["version"], "machine": machine, "points": [point],
                                       "choice": choose([point]), **mark}})


def test_the_rule_is_tunes_own():
    from eval.tune.command import MIN_REPEATS as tune_min

    assert tune_min is MIN_REPEATS == 3
    assert repeats_mark(3) == {"repeats": 3, "quick": False}
    assert repeats_mark(2) == {"repeats": 2, "quick": True, "run": RUN_ID}


def test_a_quick_choice_applies_only_in_the_run_that_made_it(export, tmp_path):
    import shutil

    export_dir = tmp_path / "export"
    shutil.copytree(export, export_dir)
    cfg = load_eval_config(SMOKE_EVAL, ["hf_baseline=false", "dtype=fp32"])

    _write_choice(export_dir, cfg, **repeats_mark(2))  # this run's quick choice: applied
    applied, line = tuned_eval_config(cfg, export_dir, "hydra")
    assert applied.tree_choices == [[0]] and line.startswith("using tuning.json") and "quick choice, 2 repeats" in line

    _write_choice(export_dir, cfg, repeats=2, quick=True, run="another-run")  # e.g. an earlier `specdraft demo`
    kept, line = tuned_eval_config(cfg, export_dir, "hydra")
    assert kept == cfg, "a quick choice of another run was applied as tuned"
    assert "not applied: a quick choice (2 repeats, fewer than the 3 a tuned choice needs) made by another run" in line
    assert "\n" not in line and "specdraft tune --draft" in line

    _write_choice(export_dir, cfg, repeats=3, quick=False)  # a tuned choice: applied wherever it was measured
    applied, line = tuned_eval_config(cfg, export_dir, "hydra")
    assert applied.tree_choices == [[0]] and "tuned" in line


def test_eval_decodes_its_untuned_default_beside_another_runs_quick_choice(export, tmp_path):
    import shutil

    export_dir = tmp_path / "export"
    shutil.copytree(export, export_dir)
    cfg = load_eval_config(SMOKE_EVAL, ["hf_baseline=false", "dtype=fp32", "name=quick-elsewhere"])
    _write_choice(export_dir, cfg, repeats=2, quick=True, run="another-run")
    report, out_dir = eval_export(export_dir, cfg)
    summary = format_summary(report, out_dir)
    assert summary.splitlines()[0].startswith("UNTUNED SPEED") and "quick choice" in summary.splitlines()[0]
    assert report["extra"]["tree_nodes"] > 2  # the export's default tree, not the quick top-1
    tuning = json.loads((export_dir / "tuning.json").read_text())["engines"]["ours"]
    assert applicable({**tuning["choice"], **{k: tuning[k] for k in ("repeats", "quick", "run")}}, {})[0] is False
