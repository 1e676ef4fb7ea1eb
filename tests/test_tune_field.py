"""`specdraft tune` reads the acceptance side from the field benchmark (eval/tune/field.py): on the smoke-trained
Medusa and stored answers of the tiny base, every simulated setting's field acceptance length equals what
`specdraft field` computes for the same shape and prompts; stored answers of another base are one note and tune
completes; `--field-prompts 0` leaves no field columns; which settings are simulated, and the ranking note."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.stored_answers import write_tiny_refs
from test_tune_cli import SMOKE, tune

from eval.tune.field import FIELD_KEYS

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = [*SMOKE, "--num-prompts", "2", "--max-new-tokens", "8", "--budget-minutes", "5", "--repeats", "3"]


def _export(smoke_run, tmp_path):
    """A copy of the session's smoke export (tune writes tuning.json and NOTES.md into it)."""
    run_dir, _ = smoke_run
    shutil.copytree(run_dir / "export", tmp_path / "run" / "export")
    return tmp_path / "run" / "export"


def _ours(export) -> dict:
    return json.loads((export / "tuning.json").read_text())["engines"]["ours"]


def _shape_overrides(knobs: dict) -> list[str]:
    """The eval overrides that name a setting's shape, as a user passes them to `specdraft field`."""
    out = []
    for key, value in knobs.items():
        if key == "extra":
            out += [f"extra.{k}={v}" for k, v in value.items()]
        elif value is not None:
            out.append(f"{key}={json.dumps(value, separators=(',', ':')) if isinstance(value, list) else value}")
    return out


def test_field_columns_equal_what_specdraft_field_computes(smoke_run, tmp_path, capsys):
    """--field-all: every measured setting simulated on each set's first 2 stored answers; each one's field AL (mean
    over sets, per set, interval) equals `specdraft field --num-prompts 2` with the setting's shape, exactly."""
    from cli.main import main

    export = _export(smoke_run, tmp_path)
    refs = write_tiny_refs(tmp_path / "refs")
    assert tune(["--draft", str(export), *FAST, "--field-refs", str(refs), "--field-prompts", "2",
                 "--field-all"]) == 0
    out = capsys.readouterr()
    assert "ours: field acceptance simulated for" in out.out and "field: simulated decoding" in out.err
    rec = _ours(export)
    ok = [p for p in rec["points"] if p["status"] == "ok"]
    assert len(ok) >= 4 and rec["field"]["simulated"] == [p["label"] for p in ok]
    report_dir = export.parent / "tune" / "tune"
    report = json.loads((report_dir / "report.json").read_text())["engines"]["ours"]
    assert {p["label"]: {k: p[k] for k in FIELD_KEYS} for p in report["points"] if p["status"] == "ok"} == \
        {p["label"]: {k: p[k] for k in FIELD_KEYS} for p in ok}  # the report and tuning.json carry the same
    als = set()
    for p in ok:
        assert p["field_prompts"] == 4 and p["field_sets"] == ["set-a", "set-b"]
        lo, hi = p["field_interval"]
        assert lo <= p["field_acceptance_length"] <= hi
        assert p["speedup_at_field_acceptance"] == pytest.approx(
            p["speedup"] * p["field_acceptance_length"] / p["acceptance_length"])
        mine = json.loads((report_dir / p["field_report"] / "field.json").read_text())
        # the same shape through `specdraft field` (its own directory, the shared base-pass cache)
        out_dir = tmp_path / "field" / p["field_report"].split("/")[-1]
        assert main(["field", "--draft", str(export), "--refs", str(refs), "--num-prompts", "2", "--out",
                     str(out_dir), *_shape_overrides(p["knobs"])]) == 0, p["label"]
        theirs = json.loads((out_dir / "field.json").read_text())
        assert p["field_acceptance_length"] == theirs["mean_over_sets"], p["label"]
        assert p["field_interval"] == theirs["mean_interval"], p["label"]
        assert [t["acceptance_length"] for t in mine["sets"]] == [t["acceptance_length"] for t in theirs["sets"]]
        als.add(round(p["field_acceptance_length"], 6))
    assert len(als) > 1  # the shapes differ on these answers: a simulation that ignored the knobs would show
    text = (report_dir / "report.md").read_text()
    assert "| field AL, simulated (95 % interval) |" in text and "acceptance length (decoded)" in text
    assert "Simulated (every measured setting (--field-all)): " in text and "not simulated: none." in text


def test_stored_answers_of_another_base_are_one_note_and_tune_completes(smoke_run, tmp_path, capsys):
    export = _export(smoke_run, tmp_path)
    refs = write_tiny_refs(tmp_path / "refs", fingerprint="0" * 16)
    assert tune(["--draft", str(export), *FAST, "--field-refs", str(refs)]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("field: ")]
    assert len(notes) == 1 and "are of base 'tiny' (fingerprint 0000000000000000), not this draft's" in notes[0]
    rec = _ours(export)
    assert notes[0] in rec["notes"] and "field" not in rec and rec["choice"]["reason"]
    assert not any(k in p for p in rec["points"] for k in FIELD_KEYS)
    text = (export.parent / "tune" / "tune" / "report.md").read_text()
    assert f"- {notes[0]}" in text and "field AL" not in text


def test_field_prompts_0_leaves_no_field_columns(smoke_run, tmp_path, capsys):
    export = _export(smoke_run, tmp_path)
    refs = write_tiny_refs(tmp_path / "refs")
    assert tune(["--draft", str(export), *FAST, "--field-refs", str(refs), "--field-prompts", "0"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("field")]
    rec = _ours(export)
    assert "field" not in rec and not any(k in p for p in rec["points"] for k in FIELD_KEYS)
    assert not any(k in rec["choice"] for k in FIELD_KEYS)
    text = (export.parent / "tune" / "tune" / "report.md").read_text()
    assert "field AL" not in text and "Field (simulated)" not in text and "(decoded)" not in text
    assert not (export.parent / "tune" / "tune" / "field").exists()


@pytest.mark.parametrize("flags,says", [(["--field-refs", "NOWHERE"], "holds no stored answers (card.json missing)"),
                                        (["--field-prompts", "-1"], "--field-prompts -1")])
def test_bad_field_flags_are_one_line_before_any_model_work(tmp_path, capsys, flags, says):
    from cli.main import main

    flags = [str(tmp_path / "nowhere") if f == "NOWHERE" else f for f in flags]
    assert main(["tune", "--draft", str(tmp_path / "no-export-needed"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("specdraft tune: error: ") and says in err, err


def _point(label, speedup, beats, al=2.0, field_al=None):
    p = {"label": label, "knobs": {"tree": label}, "cost": 1.0, "status": "ok", "speedup": speedup,
         "beats_ar": beats, "acceptance_length": al}
    if field_al is not None:
        p.update(field_acceptance_length=field_al, speedup_at_field_acceptance=speedup * field_al / al)
    return p


def test_the_settings_that_matter_are_simulated():
    """Each that beats AR, the choice (and one whose confirmation failed), the decoded fastest; not the rest, not a
    failed point, not AR."""
    from eval.tune.field import settings_to_simulate

    points = [_point("a", 1.3, True), _point("b", 1.1, False), _point("c", 1.2, True), _point("d", 1.4, False),
              {"label": "e", "knobs": {"tree": "e"}, "status": "failed"}, _point("f", 0.9, False)]
    rec = {"points": points, "choice": {"label": "c", "fastest": "d", "unconfirmed": None}}
    assert [p["label"] for p in settings_to_simulate(rec)] == ["a", "c", "d"]
    rec["choice"] = {"label": "AR (no speculation)", "knobs": {}, "unconfirmed": "b", "fastest": "d"}
    assert [p["label"] for p in settings_to_simulate(rec)] == ["a", "b", "c", "d"]
    assert [p["label"] for p in settings_to_simulate(rec, every=True)] == ["a", "b", "c", "d", "f"]


def test_a_field_ranking_that_differs_is_one_line_in_the_report():
    from eval.choice.record import machine_info
    from eval.tune.field import ranking_note
    from eval.tune.report import markdown

    same = [_point("a", 1.3, True, 2.0, 2.2), _point("b", 1.2, True, 2.0, 2.1), _point("c", 1.5, False, 2.0, 1.0)]
    assert ranking_note(same) is None  # c does not beat AR: not ranked
    flipped = [_point("a", 1.3, True, 2.0, 1.8), _point("b", 1.2, True, 2.0, 2.4)]
    note = ranking_note(flipped)
    assert note == ("At field acceptance the settings that beat AR would rank b > a; decoded they rank a > b. The "
                    "choice stays on the decoded paired statistics.")
    for p in flipped:
        p.update(field_interval=[1.0, 3.0], field_prompts=4, field_sets=["s"], lower_bound=1.1,
                 tokens_per_second=10.0, ar_tokens_per_second=8.0, accepted_per_drafted=0.5, same_tokens_as_ar=1.0)
    rec = {"dtype": "float32", "points": flipped, "ar": {"tokens_per_second": 8.0}, "choice": None,
           "field": {"refs": "datasets/x", "base": "b", "per_set": 2, "prompts": 4, "sets": ["s"], "rule": "r",
                     "simulated": ["a", "b"], "not_simulated": [], "max_new_tokens": 20, "seconds": 1.0,
                     "ranking": note}}
    context = {"export": "x", "machine": machine_info(), "num_prompts": 4, "max_new_tokens": 64, "dataset": "d",
               "repeats": 3, "alpha": 0.05, "min_gain": 0.0, "budget_minutes": 60, "wall_seconds": 60}
    text = markdown(context, {"ours": rec})
    assert text.count(note) == 1
    assert "| a | 10.0 | 8.0 | 1.300x | 1.100x | yes | 2.00 | 1.800 (1.000-3.000) | 1.170x |" in text


def test_field_columns_in_bf16_against_fp32_answers_are_marked_everywhere(smoke_run, tmp_path, capsys):
    """tune in bf16 replays bf16 hidden states against the stored fp32 answers: the field columns are kept (the
    choice never rests on them) but every output says so: the record, report.md, NOTES.md and the printed line."""
    export = _export(smoke_run, tmp_path)
    refs = write_tiny_refs(tmp_path / "refs")
    assert tune(["--draft", str(export), *FAST, "--field-refs", str(refs), "--field-prompts", "2", "dtype=bf16"]) == 0
    mark = "bf16 draft and base against fp32 answers"
    assert f"(MARKED: {mark})" in capsys.readouterr().out
    rec = _ours(export)
    assert rec["field"]["dtype_mark"] == mark
    simulated = [p for p in rec["points"] if p.get("field_acceptance_length") is not None]
    assert simulated and all(p["field_dtype_mark"] == mark for p in simulated)
    assert f"MARKED: {mark}" in (export.parent / "tune" / "tune" / "report.md").read_text()
    if rec["choice"].get("field_acceptance_length") is not None:
        assert f"(MARKED: {mark})" in (export / "NOTES.md").read_text()
    for p in simulated:
        meta = json.loads((export.parent / "tune" / "tune" / p["field_report"] / "field.json").read_text())["meta"]
        assert meta["dtype_mark"] == mark and meta["dtype"] == "bfloat16"
