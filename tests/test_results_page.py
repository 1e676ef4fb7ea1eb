"""docs/results.md is generated from the files kept in the repository (recipes/results_page.py, `make results`):
the checked-in page must be what those files give now, so no figure on it is pasted or stale."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _page_module():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "recipes" / "results_page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_checked_in_results_page_is_what_the_kept_reports_give(monkeypatch):
    mod = _page_module()
    monkeypatch.chdir(ROOT)
    text = mod.build_page(mod.ff.REPORTS, mod.DRAFTS, mod.ff.reference_run())
    assert (ROOT / "docs" / "results.md").read_text() == text, "docs/results.md lags behind: run `make results`"


def test_the_page_has_a_row_for_every_shipped_draft_and_every_kept_run(monkeypatch):
    mod = _page_module()
    monkeypatch.chdir(ROOT)
    text = mod.build_page(mod.ff.REPORTS, mod.DRAFTS, mod.ff.reference_run())
    for d in (ROOT / "drafts").iterdir():
        if (d / "field").is_dir():
            assert f"[`{d.name}`](../drafts/{d.name}/README.md)" in text
    for name, run in mod.ff.load_runs(mod.ff.REPORTS).items():
        assert re.search(rf"^\| {re.escape(mod.ff._label(run))} \|", text, re.M), name


def test_the_readme_links_the_results_page_before_the_lab_notebook():
    readme = (ROOT / "README.md").read_text()
    assert "docs/results.md" in readme
    lab = readme.find("docs/lab/")
    assert lab == -1 or readme.find("docs/results.md") < lab


def test_the_page_names_every_machine_kind_the_families_trained_on():
    """Families trained on two kinds of CPU: the page names both and which family trained where, not the first."""
    page = _page_module()
    runs = {n: {"family": f, "train": {"machine": {"kind": k}, "label": lab}, "fields": {}}
            for n, f, k, lab in [("ff-ctc", "ctc", "2-core Xeon (AMX)", "CTC"),
                                 ("ff-hydra", "hydra", "2-core EPYC (AVX512-BF16)", "Hydra"),
                                 ("ff-medusa", "medusa", "2-core Xeon (AMX)", "Medusa")]}
    runs["ff-ngram"] = {"family": "ngram", "train": None, "fields": {}}
    assert page.machine_kinds(runs) == ("on a 2-core EPYC (AVX512-BF16) (Hydra); a 2-core Xeon (AMX) (CTC, Medusa)")
    assert page.machine_kinds({k: runs[k] for k in ("ff-hydra", "ff-ngram")}) == "on a 2-core EPYC (AVX512-BF16)"


def test_a_tune_that_keeps_ar_says_how_far_the_best_setting_fell_short():
    """A sweep where no setting beats AR chooses AR; the cell gives the best setting's ratio and bound (a bare
    "1.00x" would read as a draft that costs nothing), and a loaded sweep stays marked."""
    mod = _page_module()
    points = [{"label": "chain 1", "speedup": 0.864, "lower_bound": 0.701},
              {"label": "chain 2", "speedup": 0.706, "lower_bound": 0.572}]
    tuning = {"load": {"loaded": True}, "engines": {"ours": {"points": points, "choice": {
        "label": "AR (no speculation)", "speculate": False, "speedup_vs_ar": 1.0, "runner_up": "chain 1"}}}}
    assert mod._speed(tuning) == "slower than AR: best chain 1 0.86x, lower bound 0.70x loaded"
    chosen = {"engines": {"ours": {"points": [{"label": "chain 2", "same_tokens_as_ar": 1.0}], "choice": {
        "label": "chain 2", "speculate": True, "speedup_vs_ar": 1.31, "interval": [1.12, 1.53]}}}}
    assert mod._speed(chosen).startswith("1.31x") and "chain 2 lossless" in mod._speed(chosen)
    assert mod._speed(None) == "not measured"
