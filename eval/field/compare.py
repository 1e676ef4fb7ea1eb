"""The field benchmark as a column of `specdraft compare`: every row's exact simulated greedy acceptance on the
base's stored answers (eval/field/simulation.py), beside the decoded figures of the compare tables.

With `field_refs` set in a compare config, each draft row with an export is judged with its own shape (the first
greedy setting's eval keys, then the row's `eval` overrides, as the row decodes there) on `field_prompts` prompts of
each of `field_sets` (all stored sets by default): <out_dir>/field/<label>/ holds its field report (resumable rows),
and paired.json its difference to the first judged row on the same prompts. Rows without an export (n-gram
methods) and rows that decode by sampling are not judged: the stored answers are greedy.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


def judge_rows(cfg, settings: dict, entries: list, out_dir: Path) -> dict:
    """{label: summary of its field report (+ "paired" against the first judged row)}; cfg: a CompareConfig,
    settings: {name: EvalConfig}, entries: its DraftEntry rows."""
    from eval.field.report import paired, read_rows
    from eval.field.simulation import judge_export

    greedy = [(n, e) for n, e in settings.items() if e.temperature == 0]
    if not greedy:
        raise ValueError("compare field_refs: the stored answers are greedy, but no setting of this compare config "
                         "is (temperature 0)")
    setting, ecfg = greedy[0]
    out: dict = {}
    first = None
    for e in entries:
        if e.export is None or not e.runs_in(setting):
            continue
        row_cfg = dataclasses.replace(ecfg, **{k: ({**ecfg.extra, **v} if k == "extra" else v)
                                               for k, v in e.eval.items()})
        if e.tree_nodes is not None:
            from eval.harness.compare_config import searched_tree

            row_cfg = dataclasses.replace(row_cfg, tree_choices=searched_tree(e.export, e.tree_nodes))
        row_dir = Path(out_dir) / "field" / e.label
        # compare's greedy setting may decode in bf16 (dtype=fast): judged anyway, marked in its row
        report, _ = judge_export(Path(e.export), Path(cfg.field_refs), row_cfg, sets=cfg.field_sets or None,
                                 num_prompts=cfg.field_prompts, out_dir=row_dir, label=e.label, mixed_dtype=True)
        row = summarize(report)
        row["setting"] = setting
        if first is None:
            first = (e.label, row_dir)
        else:
            pair = paired(read_rows(row_dir), read_rows(first[1]))
            (row_dir / "paired.json").write_text(json.dumps({"against": first[0], **pair}, indent=1) + "\n")
            row["paired"] = {"against": first[0], "mean_diff": pair["mean_diff"],
                             "mean_interval": pair["mean_interval"], "prompts": pair["prompts"]}
        out[e.label] = row
    return out


def summarize(report: dict) -> dict:
    """What the compare tables show of one field report."""
    from eval.field.report import path_label

    m = report["meta"]
    return {"shape": m["shape"], "family": m["family"], "prompts": report["prompts"], "path": path_label(m),
            "dtype": m["dtype"], "dtype_mark": m.get("dtype_mark"),
            "mean_over_sets": report["mean_over_sets"], "mean_interval": report["mean_interval"],
            "sets": {t["set"]: t["acceptance_length"] for t in report["sets"]}, "seconds": m["seconds"],
            "simulated": True}
