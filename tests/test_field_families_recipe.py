"""recipes/field_families.sh's control flow, run for real with a stub `specdraft` (SPECDRAFT): which runs it trains,
judges and tunes given the reports kept in REPORTS. The tree is a temporary copy (links to the repository's files,
its own runs/ and reports), so the repository's runs/ is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The stub: records its arguments, and for `train` / `tune` writes the few files the recipe and
# field_families_table.py collect read (an export's config.json, metrics.jsonl, tuning.json).
STUB = '''#!{python}
import json, os, sys
from pathlib import Path
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
cmd = sys.argv[1]
if cmd == "field" and "--help" in sys.argv:
    print("--full")
elif cmd == "train":
    run = Path("runs") / next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run_name="))
    (run / "export").mkdir(parents=True, exist_ok=True)
    (run / "export" / "config.json").write_text(json.dumps(
        {{"family": "hydra", "trained_steps": 1880, "train_seconds": 600.0, "train_cpu_seconds": 590.0}}))
    (run / "metrics.jsonl").write_text(json.dumps({{"tokens_per_s": 900.0}}) + "\\n")
elif cmd == "tune":
    draft = Path(sys.argv[sys.argv.index("--draft") + 1])
    (draft / "tuning.json").write_text(json.dumps({{"engines": {{"ours": {{"stub": True}}}}}}))
elif cmd == "field":
    sys.exit("the stub does not judge")
'''


def _tree(tmp: Path) -> Path:
    """A copy of the repository to run the recipe in: every top-level entry linked, recipes/ copied (the script
    cds to its own parent), no runs/."""
    tree = tmp / "tree"
    tree.mkdir(parents=True)
    for p in ROOT.iterdir():
        if p.name in {"runs", "recipes", ".git"}:
            continue
        (tree / p.name).symlink_to(p)
    shutil.copytree(ROOT / "recipes", tree / "recipes", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def _run(tmp: Path, **env) -> tuple[list[str], Path, Path]:
    tree = _tree(tmp)
    reports = tmp / "reports"
    reports.mkdir()
    shutil.copytree(ROOT / "docs/lab/field_families/ff-hydra", reports / "ff-hydra")  # judged on every answer
    stub = tmp / "specdraft"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    log = tmp / "calls.log"
    r = subprocess.run(["bash", str(tree / "recipes/field_families.sh")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "SPECDRAFT": str(stub), "PYTHON": sys.executable, "STUB_LOG": str(log),
                            "FAMILIES": "hydra", "REPORTS": str(reports), "JOBS": "1", **env})
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines() if log.is_file() else []
    return [c.split()[0] for c in calls if not c.startswith("field --help")], reports, tree


def test_a_judged_family_is_skipped_unless_tune_2_asks_for_its_speed(tmp_path):
    calls, reports, _ = _run(tmp_path / "a", TUNE="1")
    assert calls == ["cache"] and not (reports / "ff-hydra" / "tuning.json").exists()


def test_tune_2_retrains_a_judged_family_and_tunes_it_without_judging_it_again(tmp_path):
    calls, reports, tree = _run(tmp_path / "b", TUNE="2")
    assert calls == ["cache", "train", "tune"]  # no `field`: the kept reports stand
    assert (reports / "ff-hydra" / "tuning.json").is_file()  # kept where a machine swap cannot take it
    assert (reports / "ff-hydra" / "field-chain4" / "field.json").is_file()
    # and the next run has nothing left to do
    calls2 = subprocess.run(["bash", str(tree / "recipes/field_families.sh")], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "SPECDRAFT": str(tmp_path / "b" / "specdraft"),
                                              "PYTHON": sys.executable, "STUB_LOG": str(tmp_path / "b" / "c2.log"),
                                              "FAMILIES": "hydra", "REPORTS": str(reports), "TUNE": "2"})
    assert calls2.returncode == 0 and "skip hydra" in calls2.stdout
