"""The demo's plan against what it took (cli/demo.py: actual_phases, phase_table, format_phase_table, _save_phases;
cli/demo_plan.py: Plan.phases, cost_kind): every phase's planned and actual minutes and the error, printed at the end
and kept in the report; and the cost model priced from a timed AMX demo within 10 % per phase."""

from __future__ import annotations

import json

import pytest

from cli.demo import _save_phases, actual_phases, format_phase_table, phase_table
from cli.demo_plan import PHASES, Shape, cost_kind, estimate, make_plan

AMX_CPU = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
EPYC_CPU = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


def test_each_phase_is_timed_and_compared_with_its_plan(tmp_path):
    plan = make_plan(1328.0, "bf16", decode_tok_s=35.0, decode_dtype="fp32")
    assert list(plan.phases()) == list(PHASES) and sum(plan.phases().values()) == pytest.approx(plan.total_s)
    (tmp_path / "phase_seconds.json").write_text(json.dumps({"cache": 300.0, "loop": 150.0, "finish": 12.0}))
    actual = actual_phases(tmp_path, total_s=700.0, tune_s=80.0, eval_s=90.0)
    assert actual == {"set-up": pytest.approx(68.0), "cache": 300.0, "training": 162.0, "tree sweep": 80.0,
                      "decoding": 90.0}
    rows = phase_table(plan, actual)
    cache = next(r for r in rows if r["phase"] == "cache")
    assert cache["actual_min"] == 5.0 and cache["planned_min"] == round(plan.cache_s / 60, 2)
    assert cache["error_pct"] == round(100 * (300.0 - plan.cache_s) / plan.cache_s, 1)
    text = format_phase_table(rows, plan.total_s, 700.0)
    assert text.splitlines()[0].startswith("[demo plan vs actual]") and len(text.splitlines()) == 2 + len(PHASES)
    assert f"{cache['error_pct']:+6.1f} %" in text and "actual  11.7" in text.splitlines()[-1]

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"method": "hydra"}))
    _save_phases(report, rows, plan, 700.0)
    saved = json.loads(report.read_text())
    assert saved["method"] == "hydra" and saved["demo_plan"]["phases"] == rows
    assert saved["demo_plan"]["actual_total_min"] == round(700 / 60, 2) and saved["demo_plan"]["line"] == plan.line()


def test_a_run_without_phase_seconds_says_so(tmp_path):
    actual = actual_phases(tmp_path, total_s=700.0, tune_s=80.0, eval_s=90.0)
    assert actual["cache"] is None and actual["training"] is None and actual["set-up"] is None
    rows = phase_table(make_plan(1328.0, "bf16"), actual)
    assert "actual     ?" in format_phase_table(rows, 600.0, 700.0)


def test_amx_is_priced_as_its_own_kind():
    assert cost_kind("bf16", "cpu", AMX_CPU) == "bf16-amx"
    assert cost_kind("bf16", "cpu", EPYC_CPU) == "bf16"
    assert cost_kind("fp32", "cpu", AMX_CPU) == "fp32"
    assert cost_kind("bf16", "cuda", AMX_CPU) == "bf16"


# The timed AMX demo (2-core Xeon with AMX-BF16, idle): its probe's speed class 3,158 tok/s, decoding ~24.7 tok/s in
# bf16; 8,400 conversations cut at 128 tokens: the cache took 4.3 min, training (2,220 steps, the held-out table)
# 4.5 min; the whole demo 13.9 min, the tree sweep with its confirmation 1.3 of it.
AMX_RUN = {"cache": 4.3, "training": 4.5}


def test_the_amx_demo_is_priced_within_ten_percent_per_phase():
    plan = estimate(Shape(8400, 128, 3, 8), 3158.0, cost_kind("bf16", "cpu", AMX_CPU), 12.0, decode_tok_s=24.7,
                    decode_dtype="bf16")
    for phase, minutes in AMX_RUN.items():
        planned = plan.phases()[phase] / 60
        assert abs(planned - minutes) <= 0.1 * minutes, f"{phase}: planned {planned:.2f} min, took {minutes}"
    assert abs(plan.total_s / 60 - 13.9) <= 0.1 * 13.9
    # and the plan it now makes there fits the budget with a smaller shape: <= 15 min with ~2 min of set-up
    chosen = make_plan(3158.0, cost_kind("bf16", "cpu", AMX_CPU), decode_tok_s=24.7, decode_dtype="bf16")
    assert chosen.fits and chosen.shape.max_records < 8400 and chosen.total_s / 60 * 1.1 + 2 <= 15.0
