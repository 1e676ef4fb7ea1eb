"""`specdraft tune`: the fastest speculation setting of a draft on each engine, measured against that engine's own
AR on this machine, and kept in the export (docs/howto/serve.md, "Tune").

    choice/        a tuned choice: made (stats.py), kept in the export's tuning.json (record.py), applied where
                   it was measured (apply.py: eval, field, serve-check, export --format vllm); below the harness
    sweep.py       the engine-agnostic sweep: settings paired with AR, the choice, its confirmation, the budget
    concurrency.py the sweep at several requests in flight, vLLM's per-batch-size schedule; `run_sweeps`
    ours.py        our decoder as a tune engine (chains, the family's shapes, searched trees)
    field.py       our decoder's acceptance side from the field benchmark (stored base answers), simulated
    serving.py     vLLM and llama.cpp as tune engines, and the serving lines tune writes (placeholders)
    report.py      report.json / report.md / tune.png, and what tune writes into the export (NOTES.md, config.json)
    command.py     the `specdraft tune` parser and command (cli/main.py adds it)

The names below are the package's public surface: `from eval.tune import sweep_engine`. Each is loaded from its
module on first use, so importing one module (the harness imports eval.tune.choice) loads nothing above it: the
package spans two layers (docs/architecture.md) and this file must not pull the upper one into the lower.
"""

from __future__ import annotations

import importlib

from eval.tune.choice import __all__ as _CHOICE

_PUBLIC = {
    "eval.tune.choice": tuple(_CHOICE),
    "eval.tune.sweep": ("AR", "DEFAULT_REPEATS", "BudgetTooSmall", "Clock", "Engine",
                        "EngineUnavailable", "Measurement", "PointFailed", "Session", "Setting", "check_budget",
                        "confirm", "judge_confirmation", "min_seconds", "sweep_engine"),
    "eval.tune.concurrency": ("SCHEDULE_KEY", "parse_concurrency", "run_sweeps", "speculation_schedule",
                              "sweep_concurrencies"),
    "eval.tune.ours": ("OursEngine",),
    "eval.tune.field": ("DEFAULT_FIELD_PROMPTS", "DEFAULT_REFS", "FIELD_KEYS", "FieldPlan", "add_field_columns",
                        "check_field_args", "field_columns", "field_point", "plan_field", "ranking_note",
                        "settings_to_simulate", "simulate_setting"),
    "eval.tune.serving": ("LlamaCppEngine", "VllmEngine", "placeholders", "vllm_serve_command"),
    "eval.tune.report": ("field_line", "field_lines", "markdown", "notes_section", "plot", "schedule_line",
                         "write_export", "write_report"),
    "eval.tune.command": ("add_tune_parser", "apply_threads", "cmd_tune", "progress_bar", "tune_eval_config"),
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'eval.tune' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
