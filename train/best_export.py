"""Which snapshot becomes the run's export when training decodes at its snapshots (train.decode_eval_prompts > 0).

Every decoded snapshot directory (exports/step<N>/ during the run, export_last/ for the final state) holds a
`decoded.json` (DECODED_FILE): the step, decoded_al and the teacher-forced estimates on the same prompts. At the end,
the directory with the highest decoded_al (the later step on a tie) is copied to export/, with `selection.json`
(SELECTION_FILE) saying which step it came from and both acceptance lengths, the chosen one's and the last one's.
Reading the decoded.json files from disk (not a running maximum) keeps the choice right across resumes.
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
    """(directory, its decoded.json) for every decoded snapshot of the run and its last export, by step."""
    dirs = sorted((run_dir / "exports").glob("step*")) + [run_dir / LAST_DIR]
    out = []
    for d in dirs:
        f = d / DECODED_FILE
        if d.is_dir() and f.is_file():
            out.append((d, json.loads(f.read_text())))
    return sorted(out, key=lambda pair: pair[1]["step"])


def select_best_export(run_dir: Path) -> dict:
    """Copy the best-by-decoded-AL directory to run_dir/export (through a temporary directory, renamed into place)
    and write its selection.json; returns that record. Needs run_dir/export_last/decoded.json."""
    candidates = decoded_candidates(run_dir)
    last = [rec for d, rec in candidates if d.name == LAST_DIR]
    if not last:
        raise FileNotFoundError(f"{run_dir / LAST_DIR / DECODED_FILE} is missing: the final state was not decoded")
    # max over (AL, step): ties go to the later (longer trained) snapshot
    best_dir, best = max(candidates, key=lambda pair: (pair[1]["decoded_al"], pair[1]["step"]))
    record = {"step": best["step"], "decoded_al": best["decoded_al"], "source": str(best_dir.relative_to(run_dir)),
              "last_step": last[0]["step"], "last_decoded_al": last[0]["decoded_al"],
              "estimates": {k: v for k, v in best.items() if k.startswith("est_accept_len")},
              "candidates": [{"step": rec["step"], "decoded_al": rec["decoded_al"], "dir": d.name}
                             for d, rec in candidates],
              "rule": "highest decoded_al over the snapshots and the final state (later step on a tie)"}
    final = run_dir / "export"
    tmp = run_dir / "export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(best_dir, tmp)
    write_text_atomic(tmp / SELECTION_FILE, json.dumps(record, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return record
