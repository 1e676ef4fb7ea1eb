"""Which snapshot becomes the run's export when training scores its snapshots (train.decode_eval_prompts > 0).

Every scored snapshot directory (exports/step<N>/ during the run, export_last/ for the final state) holds a
`decoded.json` (DECODED_FILE): the step, its score (`score_key` names it: `simulated_al` on the stored base answers,
or `decoded_al` from decoding; cli/train_decode.py) and the teacher-forced estimates on the same texts. At the end,
the directory with the highest score (the later step on a tie) is copied to export/, with `selection.json`
(SELECTION_FILE) saying which step it came from and both scores, the chosen one's and the last one's. Reading the
decoded.json files from disk (not a running maximum) keeps the choice right across resumes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from core.atomic import write_text_atomic

DECODED_FILE = "decoded.json"
SELECTION_FILE = "selection.json"
LAST_DIR = "export_last"


def decoded_candidates(run_dir: Path) -> list[tuple[Path, dict]]:
    """(directory, its decoded.json) for every scored snapshot of the run and its last export, by step."""
    dirs = sorted((run_dir / "exports").glob("step*")) + [run_dir / LAST_DIR]
    out = []
    for d in dirs:
        f = d / DECODED_FILE
        if d.is_dir() and f.is_file():
            out.append((d, json.loads(f.read_text())))
    return sorted(out, key=lambda pair: pair[1]["step"])


def score_key(record: dict) -> str:
    """The score a decoded.json record carries: `simulated_al` or `decoded_al` (records from before the key)."""
    return record.get("score_key", "decoded_al")


def select_best_export(run_dir: Path) -> dict:
    """Copy the best-scored directory to run_dir/export (through a temporary directory, renamed into place)
    and write its selection.json; returns that record. Needs run_dir/export_last/decoded.json."""
    candidates = decoded_candidates(run_dir)
    last = [rec for d, rec in candidates if d.name == LAST_DIR]
    if not last:
        raise FileNotFoundError(f"{run_dir / LAST_DIR / DECODED_FILE} is missing: the final state was not decoded")
    key = score_key(last[0])
    if any(score_key(rec) != key for _d, rec in candidates):  # a resume that changed train.snapshot_eval
        raise ValueError(f"the snapshots of {run_dir} were scored in different ways "
                         f"({sorted({score_key(rec) for _d, rec in candidates})}): rescore them alike")
    # max over (AL, step): ties go to the later (longer trained) snapshot
    best_dir, best = max(candidates, key=lambda pair: (pair[1][key], pair[1]["step"]))
    record = {"step": best["step"], "score_key": key, key: best[key], "source": str(best_dir.relative_to(run_dir)),
              "last_step": last[0]["step"], f"last_{key}": last[0][key],
              "estimates": {k: v for k, v in best.items() if k.startswith("est_accept_len")},
              "candidates": [{"step": rec["step"], key: rec[key], "dir": d.name} for d, rec in candidates],
              "rule": f"highest {key} over the snapshots and the final state (later step on a tie)"}
    final = run_dir / "export"
    tmp = run_dir / "export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(best_dir, tmp)
    write_text_atomic(tmp / SELECTION_FILE, json.dumps(record, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return record
