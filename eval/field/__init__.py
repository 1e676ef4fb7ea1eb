"""The field benchmark (`specdraft field-refs`, `field`, `field-paired`, compare's field column): a draft's exact
simulated greedy acceptance on the base's stored answers (docs/howto/evaluate.md, "The field benchmark").

    refs.py        the stored base answers (datasets/<name>/: card + xz token ids), built and read back
    sets.py        the field sets, read from the one set registry (eval/harness/eval_sets.py)
    simulation.py  the field cache, simulated acceptance per prompt (exact, or batched), `judge_export`
    report.py      per-set and paired intervals, the table and plot, the path each figure took
    compare.py     the field column of `specdraft compare` (the CLI hands it to the harness's compare)

Above the harness (it reads its prompt sets and configs), beside the serving layer (docs/architecture.md).
"""
