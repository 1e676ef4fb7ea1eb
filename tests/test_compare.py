"""`specdraft compare` (eval/harness/compare.py) on the tiny base: shared baselines, losslessness, exact resume,
config errors, and docs/lab/results.md generation that keeps the hand-written text."""

import json
from pathlib import Path

import pytest
import yaml

from core.config_loader import ConfigError
from eval.harness.compare import run_compare
from eval.harness.compare_config import load_compare_config
from eval.harness.report import REPORT_KEYS
from eval.harness.results_doc import (
    RESULTS_BEGIN,
    RESULTS_END,
    Targets,
    _shape,
    markers,
    setting_table,
    splice,
    target_table,
    write_results,
)

# The targets configs/compare.yaml sets (the library sets none).
PROJECT_TARGETS = Targets.from_config(yaml.safe_load(Path("configs/compare.yaml").read_text())["targets"])


def _config(tmp_path, export, **extra) -> str:
    cfg = {"out_dir": str(tmp_path / "cmp"), "base_path": "tiny",
           "eval": {"dataset": "tests/fixtures/eval_prompts.jsonl", "num_prompts": 3, "max_new_tokens": 10,
                    "dtype": "fp32", "backend": "fast", "warmup_tokens": 2},
           "settings": [{"name": "greedy", "acceptance": "greedy", "temperature": 0.0},
                        {"name": "t0.7", "acceptance": "rejection", "temperature": 0.7, "hf_baseline": False}],
           "drafts": [{"label": "Medusa", "export": str(export)},
                      {"label": "N-gram", "method": "ngram",
                       "eval": {"extra": {"k": 2, "w": 2, "strategy": "context"}}},
                      {"label": "Medusa-chain", "export": str(export), "eval": {"tree": "chain4"},
                       "settings": ["greedy"]}], **extra}
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _rows(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_compare_runs_every_method_on_shared_baselines_and_resumes_exactly(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    cfg = load_compare_config([_config(tmp_path, run_dir / "export")])
    summary = run_compare(cfg)
    out = tmp_path / "cmp"
    greedy, sampled = summary["settings"]["greedy"], summary["settings"]["t0.7"]
    assert set(greedy["reports"]) == {"Medusa", "N-gram", "Medusa-chain"}
    assert set(sampled["reports"]) == {"Medusa", "N-gram"}  # Medusa-chain is greedy-only
    # 3 prompts x (AR + generate + 3 drafts) greedy; 3 x (AR + 2 drafts) sampled (no generate at T > 0)
    assert len(_rows(out / "greedy" / "prompts.jsonl")) == 15
    assert len(_rows(out / "t0.7" / "prompts.jsonl")) == 9
    for name, st in summary["settings"].items():
        for label, rep in st["reports"].items():
            assert set(rep) - {"extra"} == set(REPORT_KEYS)
            assert rep["ar_tokens_per_second"] == st["ar_tokens_per_second"]  # one shared AR baseline
            assert rep["acceptance_length"] >= 1.0 and rep["num_prompts"] == 3
            on_disk = json.loads((out / name / label / "report.json").read_text())
            assert on_disk["acceptance_length"] == rep["acceptance_length"]
    assert greedy["ar_matches_generate_fraction"] == 1.0 and sampled["ar_matches_generate_fraction"] is None
    for rep in greedy["reports"].values():  # fp32 greedy: token-identical to own AR decoding
        assert rep["lossless_fraction"] == 1.0 and rep["speedup_vs_hf"] is not None
        # tie-aware verdict (eval/harness/lossless.py): fp32 = exact, tolerance 0, every prompt identical
        ex = rep["extra"]
        assert ex["tie_tolerance"] == 0.0 and ex["lossless_up_to_ties"] is True and ex["lossless_identical"] == 3
    ar_rows = [r for r in _rows(out / "greedy" / "prompts.jsonl") if r["method"] == "ar"]
    assert all(len(r["top2_gaps"]) == len(r["runner_up"]) == len(r["tokens"]) for r in ar_rows)
    for rep in sampled["reports"].values():
        assert rep["lossless_fraction"] is None and rep["speedup_vs_hf"] is None

    # Kill simulation: drop the last 4 finished runs of the sampled setting (one cut mid-line), rerun.
    store = out / "t0.7" / "prompts.jsonl"
    lines = store.read_text().splitlines()
    store.write_text("\n".join(lines[:-4]) + "\n" + lines[-4][: len(lines[-4]) // 2])
    kept = {(r["prompt"], r["method"]): r["wall"] for r in _rows_ok(store)}
    samples = {lab: [r["tokens"] for r in _rows(out / "t0.7" / lab / "samples.jsonl")] for lab in sampled["reports"]}
    again = run_compare(cfg)["settings"]["t0.7"]
    rows = _rows_ok(store)
    # The cut line was dropped; the second prompt, whose N-gram run was cut, gets its AR timed again beside it
    # (10 rows).
    assert len({(r["prompt"], r["method"]) for r in rows}) == 9 and len(rows) == 10
    assert all(r["wall"] == kept[(r["prompt"], r["method"])] for r in rows[:5])  # finished runs not redone
    assert len(kept) == 5
    p2 = rows[3]["prompt"]
    assert [r["method"] for r in rows[5:7]] == ["ar", "N-gram"] and rows[5]["prompt"] == p2
    assert rows[5]["pass"] == rows[6]["pass"] != rows[3]["pass"] == rows[4]["pass"]  # same pass, side by side
    # Sampling is seeded per (prompt, method), so the redone runs draw exactly what they drew before.
    for label, rep in again["reports"].items():
        assert [r["tokens"] for r in _rows(out / "t0.7" / label / "samples.jsonl")] == samples[label]
        assert rep["acceptance_length"] == sampled["reports"][label]["acceptance_length"]


def _tps(rows):
    return sum(len(r["tokens"]) - 1 for r in rows) / sum(r["decode_time"] for r in rows)


def test_rows_added_later_are_timed_against_baselines_of_their_own_pass(smoke_run, tmp_path):
    """A draft added to the config after a first run, and a `redo`ne one, run beside freshly timed baselines and
    are divided by those, not by the first run's (which another session's machine speed may have set)."""
    run_dir, _ = smoke_run
    path = _config(tmp_path, run_dir / "export", settings=[{"name": "greedy", "acceptance": "greedy",
                                                             "temperature": 0.0, "hf_baseline": False}])
    cfg = yaml.safe_load(open(path))
    first, later = cfg["drafts"][:1], cfg["drafts"][1:2]  # Medusa, then N-gram
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({**cfg, "drafts": first}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({**cfg, "drafts": first + later}))
    store = tmp_path / "cmp" / "greedy" / "prompts.jsonl"
    run_compare(load_compare_config([str(tmp_path / "a.yaml")]))
    one = _rows(store)
    assert [r["method"] for r in one] == ["ar", "Medusa"] * 3 and len({r["pass"] for r in one}) == 1

    st = run_compare(load_compare_config([str(tmp_path / "b.yaml")]))["settings"]["greedy"]
    rows = _rows(store)
    assert rows[:6] == one  # nothing stored is redone
    two = rows[6:]
    assert [r["method"] for r in two] == ["ar", "N-gram"] * 3 and len({r["pass"] for r in two}) == 1
    assert two[0]["pass"] != one[0]["pass"]
    old_ar, new_ar = [r for r in one if r["method"] == "ar"], [r for r in two if r["method"] == "ar"]
    assert [r["tokens"] for r in old_ar] == [r["tokens"] for r in new_ar]  # the same decoding, timed again
    assert st["reports"]["Medusa"]["ar_tokens_per_second"] == pytest.approx(_tps(old_ar))
    assert st["reports"]["N-gram"]["ar_tokens_per_second"] == pytest.approx(_tps(new_ar))
    assert st["ar_tokens_per_second"] == pytest.approx(_tps(new_ar))  # the setting's own figure: the latest pass
    rep = st["reports"]["N-gram"]
    assert rep["speedup"] == pytest.approx(rep["tokens_per_second"] / _tps(new_ar))

    redo = load_compare_config([str(tmp_path / "b.yaml")], ["redo=[Medusa]"])
    st = run_compare(redo)["settings"]["greedy"]
    three = _rows(store)[12:]
    assert [r["method"] for r in three] == ["ar", "Medusa"] * 3
    assert st["reports"]["Medusa"]["ar_tokens_per_second"] == pytest.approx(_tps(three[::2]))
    assert st["reports"]["N-gram"]["ar_tokens_per_second"] == pytest.approx(_tps(new_ar))  # kept its own pass
    with pytest.raises(ValueError, match=r"redo.*'Nope'.*labels"):
        run_compare(load_compare_config([str(tmp_path / "b.yaml")], ["redo=[Nope]"]))


def test_setting_table_shows_each_rows_baseline_when_passes_differ():
    rep = {"acceptance_length": 1.5, "accept_rate_per_position": [0.5], "tokens_per_second": 20.0,
           "speedup": 1.0, "speedup_vs_hf": None, "draft_time_fraction": 0.1, "lossless_fraction": 1.0,
           "ar_tokens_per_second": 20.0, "extra": {}}
    st = {"config": {"temperature": 0.0, "dataset": "mtbench", "dtype": "fp32", "max_new_tokens": 8},
          "num_prompts": 2, "ar_tokens_per_second": 25.0, "hf_tokens_per_second": None,
          "reports": {"A": rep, "B": {**rep, "speedup": 0.8, "ar_tokens_per_second": 25.0}}}
    lines = setting_table("s", st)
    assert "timed beside it in its own pass" in lines[2] and lines[4].endswith("own AR tok/s, its pass |")
    assert lines[6].endswith("| 20.0 |") and lines[7].endswith("| 25.0 |")
    st["reports"]["A"] = {**rep, "ar_tokens_per_second": 25.0}
    lines = setting_table("s", st)
    assert "its own pass" not in lines[2] and lines[4].endswith("| draft shape |")
    st["ar_tokens_per_second"] = 20.0  # rows agree with each other but not with the header: still shown
    assert setting_table("s", st)[4].endswith("own AR tok/s, its pass |")


def _rows_ok(path):
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError:
            pass
    return out


def test_results_doc_keeps_hand_written_text_and_reports_targets(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    cfg = load_compare_config([_config(tmp_path, run_dir / "export")])
    run_compare(cfg)
    md = tmp_path / "docs" / "results.md"
    md.parent.mkdir()
    md.write_text("# Results\n\nMy analysis above.\n\n" + RESULTS_BEGIN + "\nstale\n" + RESULTS_END + "\n\nBelow.\n")
    write_results(tmp_path / "cmp", md, tmp_path / "docs" / "img" / "results")
    text = md.read_text()
    assert text.startswith("# Results\n\nMy analysis above.") and text.rstrip().endswith("Below.")
    assert "stale" not in text and text.count(RESULTS_BEGIN) == 1
    assert "### `greedy`" in text and "### `t0.7`" in text and "| Medusa-chain |" in text
    assert "rejection sampling, T=0.7" in text
    # the setting heading names the dtype the base ran in, not only the setting as written ("fast", "auto")
    heading = next(line for line in text.splitlines() if line.startswith("### `greedy`"))
    assert heading.endswith(", float32 base")  # dtype fp32 (an alias: no "(dtype: ...)" note)
    for png in ("results_acceptance.png", "results_speedup.png", "results_depth.png", "results_speed_vs_nodes.png"):
        assert (tmp_path / "docs" / "img" / png).read_bytes()[:4] == b"\x89PNG"
        assert f"](img/{png})" in text
    # A second compare config writes its own part (results_section) and leaves the default part alone.
    begin, end = markers("best")
    write_results(tmp_path / "cmp", md, tmp_path / "docs" / "img" / "best", section="best",
                  training_title="best recipe per family")
    both = md.read_text()
    assert both.startswith(text.rstrip()) and both.count(begin) == 1 and both.count(end) == 1
    assert "### Training (best recipe per family)" in both.split(begin, 1)[1]
    assert "### Training (best recipe" not in both.split(begin, 1)[0]
    write_results(tmp_path / "cmp", md, tmp_path / "docs" / "img" / "best", section="best")  # replaced in place
    assert md.read_text().count(begin) == 1 and md.read_text().split(begin, 1)[0] == both.split(begin, 1)[0]
    with pytest.raises(ConfigError, match="results_section"):
        load_compare_config([_config(tmp_path, run_dir / "export")], ["results_section=best--x"])


def test_target_table_and_splice():
    def rep(method, label, acc, hf=None):
        return {"method": method, "acceptance_length": acc, "speedup_vs_hf": hf, "extra": {"label": label}}

    st = {"reports": {"Medusa": rep("medusa", "Medusa", 2.1, 1.2), "Hydra++": rep("hydra", "Hydra++", 2.0, 2.5),
                      "Hydra": rep("hydra", "Hydra", 3.0)}}
    rows = "\n".join(target_table(st, PROJECT_TARGETS))
    assert "| medusa | ≥ 2.0 | 2.10 (Medusa) | yes |" in rows
    assert "| hydra++ | ≥ 2.6 | 2.00 (Hydra++) | no |" in rows  # plain Hydra's 3.0 is not Hydra++
    assert "| ctc | ≥ 2.4 | not measured (no row) | — |" in rows  # no CTC row: neither met nor missed
    assert "2.50× (Hydra++) | yes |" in rows
    assert splice("", "S").startswith("# Results") and splice("x", "S") == "x\n\nS\n"


@pytest.mark.parametrize("method, extra, shape", [
    ("eagle3", {"eagle3_mode": "chain", "num_speculative_tokens": 4, "max_nodes": 5}, "chain of 4"),
    ("eagle3", {"eagle3_mode": "tree", "max_nodes": 16}, "dynamic tree, 16 nodes"),
    ("hydra", {"tree": "custom", "tree_nodes": 17, "tree_search_nodes": 16}, "searched, 16 nodes"),
    ("medusa", {"tree": "export", "tree_nodes": 2}, "export's tree, 2 nodes"),
    ("medusa", {"tree": "chain4", "tree_nodes": 5}, "chain4, 5 nodes"),
    ("redrafter", {"beam_width": 8, "beam_length": 3}, "8 beams × 3"),
    ("ctc", {"ctc_num_paths": 8}, "8 CTC paths"),
    ("ngram", {"k": 4, "w": 4}, "k=4 w=4"),
])
def test_draft_shape_column_names_each_drafts_shape(method, extra, shape):
    assert _shape({"method": method, "extra": extra}) == shape


@pytest.mark.parametrize("patch, message", [
    ({"drafts": [{"label": "a", "export": "/nope"}]}, "config.json not found"),
    ({"drafts": [{"label": "a b", "method": "ngram"}]}, "directory-safe"),
    ({"drafts": [{"label": "a", "method": "ngram"}, {"label": "a", "method": "ngram"}]}, "duplicate label"),
    ({"drafts": [{"label": "a", "method": "ngram", "eval": {"dtype": "bf16"}}]}, "unfair"),
    ({"drafts": [{"label": "a", "method": "ngram", "settings": ["nope"]}]}, "unknown setting"),
    ({"settings": [{"name": "g", "temperature": 0.7}]}, "greedy acceptance needs temperature=0"),
    ({"settings": [{"name": "g", "bogus": 1}]}, "unknown eval key"),
    ({"settings": []}, "`settings` is empty"),
])
def test_compare_config_errors_are_clear(tmp_path, patch, message):
    from eval.harness.compare_config import draft_entries, setting_configs

    cfg = load_compare_config([_config(tmp_path, tmp_path / "no-export")])
    for k, v in patch.items():
        setattr(cfg, k, v)
    with pytest.raises(ConfigError, match=message):
        draft_entries(cfg, list(setting_configs(cfg)))


def test_compare_cli_errors_are_clear(tmp_path, clean_env):
    import subprocess
    import sys

    cfg = {"out_dir": str(tmp_path / "none"), "settings": [{"name": "g"}],
           "drafts": [{"label": "N-gram", "method": "ngram"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "cli.main", "compare", "--config", str(path)]
    proc = subprocess.run(cmd + ["--only", "Nope"], capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 2 and "no such draft label" in proc.stderr and "N-gram" in proc.stderr
    proc = subprocess.run(cmd + ["--results-only"], capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 2 and "summary.json not found" in proc.stderr
    proc = subprocess.run(cmd + ["--results-only", "--redo", "N-gram"], capture_output=True, text=True, timeout=300,
                          env=clean_env())
    assert proc.returncode == 2 and "--results-only runs nothing" in proc.stderr
    proc = subprocess.run(cmd + ["--only", "N-gram", "--redo", "Other"], capture_output=True, text=True, timeout=300,
                          env=clean_env())
    assert proc.returncode == 2 and "not among the --only rows" in proc.stderr


@pytest.mark.parametrize("path", ["configs/compare.yaml", "configs/compare_best.yaml",
                                  "configs/compare_self_distill.yaml", "configs/compare_onpolicy_best.yaml",
                                  "configs/compare_store_eagle3.yaml"])
def test_shipped_compare_configs_parse(path):
    """The settings and vLLM settings of every shipped compare config validate (the drafts' exports are built by
    the recipes/ scripts, so they are not checked here)."""
    from eval.harness.compare_config import setting_configs, vllm_setting_names

    cfg = load_compare_config([path] if "self_distill" not in path else ["configs/compare.yaml", path])
    settings = setting_configs(cfg)
    assert "mtbench-greedy" in settings
    assert set(vllm_setting_names(cfg, settings)) <= set(settings)
    labels = [d["label"] for d in [*cfg.drafts, *cfg.extra_drafts]]
    assert labels and len(labels) == len(set(labels))


def test_sharegpt_skip_counts_only_the_drafts_of_that_setting(tmp_path):
    """A draft trained on every ShareGPT conversation (the GPU full-data run) may sit in a compare whose other
    drafts also run a held-out ShareGPT setting, as long as its own `settings` leave that one out: it must not
    decide (or break) that setting's skip, and it still breaks a setting it does run in."""
    import json

    from eval.harness.compare import _heldout_skip
    from eval.harness.compare_config import DraftEntry
    from eval.harness.config import EvalConfig

    def export(name: str, max_records):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({
            "format": "specdraft", "family": "medusa", "base_model": "tiny", "hidden_size": 64, "vocab_size": 320,
            "num_heads": 2, "num_layers": 1, "train_data": {"source": "sharegpt", "max_records": max_records}}))
        return d

    cpu = DraftEntry("cpu", export("cpu", 2400), None, None, None, {})
    full = DraftEntry("full", export("full", None), None, ["mtbench-greedy"], None, {})
    ecfg = EvalConfig(dataset="sharegpt")
    assert _heldout_skip([cpu, full], "sharegpt-greedy", ecfg).heldout_skip == 2400
    assert _heldout_skip([cpu, full], "mtbench-greedy", EvalConfig(dataset="mtbench")).heldout_skip is None
    everywhere = DraftEntry("full", full.export, None, None, None, {})
    with pytest.raises(ValueError, match="none is held out"):
        _heldout_skip([cpu, everywhere], "sharegpt-greedy", ecfg)


def test_compare_writes_its_tables_under_its_out_dir_unless_asked_to_update_docs(tmp_path):
    from eval.harness.compare_config import CompareConfig, results_paths

    cfg = CompareConfig(out_dir=str(tmp_path / "cmp"))
    assert results_paths(cfg) == (tmp_path / "cmp" / "results.md", tmp_path / "cmp" / "img" / "results")
    with pytest.raises(ConfigError, match="names no results document"):
        results_paths(cfg, update_docs=True)
    cfg.docs_md, cfg.docs_img = "docs/lab/results.md", "docs/lab/img/results"
    assert results_paths(cfg, update_docs=True) == (Path("docs/lab/results.md"), Path("docs/lab/img/results"))
    with pytest.raises(ValueError, match="unknown key"):
        Targets.from_config({"speedup": 1.5})
    assert not Targets() and Targets.from_config({"speedup_vs_ar": 1.5})


def test_a_tie_tolerance_measured_at_other_widths_is_measured_again(tmp_path, monkeypatch, capsys):
    """compare keeps each setting's tolerance in tie_tolerance.json; one written before every verify width was
    measured (width 16 only) must not judge today's reports."""
    import json

    from eval.harness import compare

    calls = []

    def measure(ecfg, backend, model, prompts):
        calls.append(1)
        return 0.5, {"tolerance": 0.5, "widths": [2, 4, 8, 16, 32, 64]}

    monkeypatch.setattr(compare, "tie_tolerance", measure)
    path = tmp_path / "tie_tolerance.json"
    path.write_text(json.dumps({"tolerance": 0.0, "measure": {"tolerance": 0.0, "widths": [16]}}))
    assert compare._tolerance(None, None, None, [], tmp_path) == (0.5, {"tolerance": 0.5,
                                                                         "widths": [2, 4, 8, 16, 32, 64]})
    assert len(calls) == 1 and "measuring it again" in capsys.readouterr().out
    assert compare._tolerance(None, None, None, [], tmp_path)[0] == 0.5 and len(calls) == 1  # now reused
    path.write_text(json.dumps({"tolerance": 0.0, "measure": {"exact_dtype": True}}))
    assert compare._tolerance(None, None, None, [], tmp_path)[0] == 0.0 and len(calls) == 1  # fp32: exact, kept


def test_compare_judges_low_precision_differences_by_an_fp32_redecode(smoke_run, tmp_path, monkeypatch):
    """A setting whose verify forwards flip near ties (a rounding backend, the base treated as bf16): every draft
    output that differs from own AR is decoded again on the fp32 base and judged numeric there, kept in
    fp32_redecode.jsonl (the measured tolerance, 0 here, would have called them real mismatches)."""
    from test_eval_lossless import RoundingBackend

    import eval.harness.compare as compare
    from eval.engine.backends.hf import HFBackend
    from models.base import load_base

    run_dir, _ = smoke_run
    twin = load_base("tiny")
    monkeypatch.setattr(compare, "is_exact_dtype", lambda dtype: False)
    monkeypatch.setattr(compare, "make_backend",
                        lambda kind, model: HFBackend(model) if model is twin.model else RoundingBackend(model, 0.5))
    monkeypatch.setattr(compare, "_tolerance", lambda *a: (0.0, {}))  # the AMX case: a tolerance sample of 0
    cfg = load_compare_config([_config(tmp_path, run_dir / "export", settings=[
        {"name": "greedy", "acceptance": "greedy", "temperature": 0.0, "hf_baseline": False}],
        drafts=[{"label": "Medusa-chain", "export": str(run_dir / "export"), "eval": {"tree": "chain4"}}])])
    base = load_base("tiny")
    from eval.harness.compare import run_setting
    from eval.harness.compare_config import draft_entries, setting_configs

    settings = setting_configs(cfg)
    entries = draft_entries(cfg, list(settings))
    res = run_setting("greedy", settings["greedy"], entries, base, tmp_path / "cmp", fp32_base=lambda: twin)
    ex = res["reports"]["Medusa-chain"]["extra"]
    differ = ex["lossless_differing"]
    assert differ >= 1 and ex["lossless_numeric"] == differ and ex["lossless_mismatches"] == 0
    assert len(_rows(tmp_path / "cmp" / "greedy" / "fp32_redecode.jsonl")) == differ


def test_compare_judges_every_row_on_stored_answers_when_asked(smoke_run, tmp_path):
    """field_refs: each export row is judged with its own shape (Medusa's tree, Medusa-chain's chain4) on the
    stored answers, paired against the first row; the n-gram method row is not; the results doc has the table."""
    from helpers.stored_answers import write_tiny_refs

    from eval.field.compare import judge_rows
    from eval.field.report import read_rows

    run_dir, _ = smoke_run
    refs = write_tiny_refs(tmp_path / "refs")
    cfg = load_compare_config([_config(tmp_path, run_dir / "export", field_refs=str(refs), field_prompts=2)])
    field = run_compare(cfg, field_rows=judge_rows)["field"]
    assert list(field) == ["Medusa", "Medusa-chain"] and field["Medusa-chain"]["shape"] == "chain4"
    assert field["Medusa"]["prompts"] == 4 and field["Medusa"]["shape"] != "chain4"
    chain_rows = read_rows(tmp_path / "cmp" / "field" / "Medusa-chain")
    assert all(len(r["proposed_per_depth"]) <= 4 for r in chain_rows)
    pair = field["Medusa-chain"]["paired"]
    assert pair["against"] == "Medusa" and pair["prompts"] == 4
    assert abs(pair["mean_diff"] - (field["Medusa-chain"]["mean_over_sets"] - field["Medusa"]["mean_over_sets"])) < 1e-9
    md = write_results(tmp_path / "cmp", tmp_path / "r.md", tmp_path / "img" / "r")
    assert "### Field benchmark (simulated" in md.read_text() and "| Medusa-chain | chain4 | 4 |" in md.read_text()
    # each row names the path its figures took: Medusa's batched one, with its agreement measured on its own prompts
    assert "- Medusa-chain: path batched (lockstep" in md.read_text() and "measured agreement" in md.read_text()
