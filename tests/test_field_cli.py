"""`specdraft field` end to end on the tiny base: stored answers written with write_refs, the smoke run's draft
judged on them (cache built once, report with per-set intervals, resumable rows), a refusal for another base, and
paired intervals of a draft against itself (zero)."""

from __future__ import annotations

import json

import pytest
from helpers.stored_answers import write_tiny_refs

from eval.field.refs import RefsError, read_refs
from eval.field.report import paired, read_rows
from eval.field.simulation import judge_export
from eval.harness.config import load_eval_config


def _refs(tmp_path, fingerprint=None):
    return write_tiny_refs(tmp_path / "refs", fingerprint)


def test_field_judges_a_draft_on_stored_answers(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    refs = _refs(tmp_path)
    cfg = load_eval_config([], ["tree=chain4"])
    report, out = judge_export(run_dir / "export", refs, cfg, out_dir=tmp_path / "f", label="smoke")
    assert report["prompts"] == 6 and [t["set"] for t in report["sets"]] == ["set-a", "set-b"]
    for t in report["sets"]:
        lo, hi = t["interval"]
        assert 1.0 <= lo <= t["acceptance_length"] <= hi and len(t["accept_rate_per_depth"]) == 4
    assert (out / "field.md").is_file() and (out / "field.png").is_file()
    # resumable: a rerun reads the rows written and simulates nothing again
    rows_before = (out / "rows-0.jsonl").read_text()
    again, _ = judge_export(run_dir / "export", refs, cfg, out_dir=out, label="smoke")
    assert (out / "rows-0.jsonl").read_text() == rows_before and again["sets"] == report["sets"]
    short, _ = judge_export(run_dir / "export", refs, load_eval_config([], ["tree=chain4", "max_new_tokens=8"]),
                            out_dir=tmp_path / "short", label="smoke")
    assert all(r["new_tokens"] <= 8 for r in read_rows(tmp_path / "short")) and short["meta"]["max_new_tokens"] == 8
    pair = paired(read_rows(out), read_rows(out))
    assert pair["mean_diff"] == 0 and pair["mean_interval"] == [0, 0]


def test_stored_answers_of_another_base_are_refused(tmp_path):
    refs = _refs(tmp_path, fingerprint="0" * 16)
    with pytest.raises(RefsError, match="made with base 'tiny'"):
        read_refs(refs, base_fingerprint="1" * 16)
    card = json.loads((refs / "card.json").read_text())
    (refs / "answers.jsonl.xz").write_bytes(b"x")
    with pytest.raises(RefsError, match="does not match its card"):
        read_refs(refs)
    assert card["counts"] == {"set-a": 3, "set-b": 3}


def test_rows_cut_by_a_kill_are_redone_not_fatal(tmp_path):
    """A kill mid-write leaves a cut last line: the writer drops it (and appends on a fresh line), a reader of
    another rank's file ignores it without touching the file."""
    from core.jsonl import read_finished_rows

    path = tmp_path / "rows-0.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "accept')
    assert [r["id"] for r in read_finished_rows(path, repair=False)] == ["a", "b"]
    assert path.read_text().endswith('"accept')  # untouched
    assert [r["id"] for r in read_finished_rows(path)] == ["a", "b"]
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'
