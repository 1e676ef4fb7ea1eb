"""`specdraft eval` on a one-head Hydra export of the tiny base: when no tuning.json choice applies on this machine
(none, or one measured elsewhere), the summary's first line (printed, and in report.md / suite.md) says the speed
column is untuned, names the shape decoded and the `specdraft tune` command for this machine; a choice measured here,
or a shape the config names, gets no such line."""

from __future__ import annotations

import pytest
import torch

from eval.engine.drafters.registry import drafter_family
from eval.harness.config import load_eval_config
from eval.harness.runner import eval_export, format_summary

pytestmark = pytest.mark.usefixtures("one_thread")

SMOKE_EVAL = ["configs/eval/smoke.yaml"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from helpers.drafts import tiny_hydra_export

    return tiny_hydra_export(tmp_path_factory.mktemp("run"))


def run(export, overrides):
    cfg = load_eval_config(SMOKE_EVAL, ["hf_baseline=false", *overrides])
    report, out_dir = eval_export(export, cfg)
    return report, out_dir, format_summary(report, out_dir)


def _write_choice(export, cfg, **where):
    from eval.choice.apply import ours_here
    from eval.choice.record import write_tuning
    from eval.choice.stats import choose

    here = {**ours_here(cfg), **where}
    point = {"label": "top-1", "knobs": {"tree_choices": [[0]]}, "cost": 1.0, "status": "ok", "speedup": 1.3,
             "ratios": [1.3] * 3, "ar_null": [0.0, 0.0]}
    machine = {**{k: here[k] for k in ("device", "cpu", "avx512_bf16", "amx_bf16", "gpu")}, "cores": 2}
    write_tuning(export, {}, {"ours": {"engine": "ours", "dtype": here["dtype"], "threads": here["threads"],
                                       "version": here["version"], "machine": machine, "points": [point],
                                       "choice": choose([point])}})


def test_an_untuned_speed_column_is_said_in_the_first_line(export, tmp_path):
    import shutil

    export_dir = tmp_path / "export"
    shutil.copytree(export, export_dir)  # this test writes tuning.json files into it
    threads = torch.get_num_threads()
    tune = f"specdraft tune --draft {export_dir} --engine ours --threads {threads}"

    report, out_dir, summary = run(export_dir, ["dtype=fp32", "name=untuned"])  # no tuning.json at all
    first = summary.splitlines()[0]
    shape = drafter_family("hydra").shape(report["extra"])  # the shape the run decoded, as tables name it
    assert first.startswith("UNTUNED SPEED") and f"export's default shape ({shape})" in first
    assert first.endswith(tune) and "no tuning.json choice" in first
    assert (out_dir / "report.md").read_text().splitlines()[0] == f"**{first}**"

    cfg = load_eval_config(SMOKE_EVAL, ["dtype=fp32"])
    _write_choice(export_dir, cfg, cpu="Other CPU")  # measured on another machine
    _, _, summary = run(export_dir, ["dtype=fp32", "name=elsewhere"])
    first = summary.splitlines()[0]
    assert first.startswith("UNTUNED SPEED") and "cpu: measured Other CPU" in first and first.endswith(tune)
    # a bf16 run's command tunes in bf16, the dtype it would apply the choice in
    _, _, summary = run(export_dir, ["dtype=bf16", "name=elsewhere-bf16"])
    assert summary.splitlines()[0].endswith(f"{tune} dtype=bf16")

    _write_choice(export_dir, cfg)  # measured here: tuned, no such line
    report, out_dir, summary = run(export_dir, ["dtype=fp32", "name=tuned"])
    assert "UNTUNED" not in summary and "UNTUNED" not in (out_dir / "report.md").read_text()
    assert report["extra"]["tuning"].startswith("using tuning.json")
    # a shape the config names is the user's, not an untuned default
    _, _, summary = run(export_dir, ["dtype=fp32", "name=own", "tree_choices=[[0]]"])
    assert "UNTUNED" not in summary


def test_the_suite_table_starts_with_the_untuned_line():
    from eval.harness.suite_report import suite_markdown

    untuned = {"status": "untuned", "why": "the export has no tuning.json choice for our decoder",
               "retune_command": "specdraft tune --draft x/export --engine ours --threads 2",
               "shape": "tree16, 16 nodes"}
    row = {"set": "mtbench", "num_prompts": 4, "acceptance_length": 1.5, "speedup": 0.7, "tokens_per_second": 20.0,
           "ar_tokens_per_second": 28.0, "accept_rate_per_position": [0.4]}
    summary = {"suite": "default", "method": "eagle3", "num_prompts_per_set": 4, "sets": [row]}
    assert suite_markdown(summary).startswith("# Suite")
    first = suite_markdown({**summary, "untuned": untuned}).splitlines()[0]
    assert first.startswith("**UNTUNED SPEED") and "tree16, 16 nodes" in first and first.endswith("--threads 2**")
