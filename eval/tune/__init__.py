"""`specdraft tune`: the fastest speculation setting of a draft on each engine, measured against that engine's own
AR on this machine, and kept in the export (docs/howto/serve.md, "Tune"). The choice itself (its statistics,
tuning.json, applying it where it was measured) is eval/choice/, below the layers this package drives.

    sweep.py       the engine-agnostic sweep: settings paired with AR, the choice, its confirmation, the budget
    concurrency.py the sweep at several requests in flight, vLLM's per-batch-size schedule; `run_sweeps`
    ours.py        our decoder as a tune engine (chains, the family's shapes, searched trees)
    field.py       our decoder's acceptance side from the field benchmark (stored base answers), simulated
    serving.py     vLLM and llama.cpp as tune engines, and the serving lines tune writes (placeholders)
    report.py      report.json / report.md / tune.png, and what tune writes into the export (NOTES.md, config.json)
    command.py     the `specdraft tune` parser and command (cli/main.py adds it)

Import from the modules: `from eval.tune.sweep import sweep_engine`.
"""
