"""recipes/field_families_table.py: the lab table regenerates from the kept reports, and the seed papers' claims are
answered by paired differences of two kept reports (holds / fails / not resolved / not judged yet)."""

from __future__ import annotations

import importlib.util
import json
import lzma
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _table():
    spec = importlib.util.spec_from_file_location("field_families_table", ROOT / "recipes" / "field_families_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kept(reports: Path, run: str, shape: str, mean_al: float) -> None:
    """A kept report of 2 sets x 30 prompts whose steps accept `mean_al` tokens on average (1 or 2 a step)."""
    d = reports / run / f"field-{shape}"
    d.mkdir(parents=True)
    rng, rows = random.Random(run), []
    for s in ("mtbench", "gsm8k"):
        for i in range(30):
            rows.append({"id": f"{s}-{i}", "set": s,
                         "accept_lengths": [2 if rng.random() < mean_al - 1 else 1 for _ in range(40)]})
    with lzma.open(d / "rows-0.jsonl.xz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    (d / "field.json").write_text(json.dumps({"prompts": len(rows), "sets": [], "meta": {}}))


def _claims(reports: Path, *claims: dict) -> None:
    (reports / "paper_claims.json").write_text(json.dumps({"note": "test", "claims": list(claims)}))


def test_a_claim_holds_fails_or_waits_for_its_reports(tmp_path):
    ff = _table()
    _kept(tmp_path, "ff-good", "tree16", 1.8)
    _kept(tmp_path, "ff-poor", "tree16", 1.3)
    _claims(tmp_path,
            {"claim": "good >= poor", "paper": "p", "a": ["ff-good", "tree16"], "b": ["ff-poor", "tree16"],
             "test": "a_ge_b"},
            {"claim": "poor >= good", "paper": "p", "a": ["ff-poor", "tree16"], "b": ["ff-good", "tree16"],
             "test": "a_ge_b"},
            {"claim": "good near poor", "paper": "p", "a": ["ff-good", "tree16"], "b": ["ff-poor", "tree16"],
             "test": "within", "margin": 0.1, "set": "mtbench"},
            {"claim": "absent >= good", "paper": "p", "a": ["ff-absent", "tree16"], "b": ["ff-good", "tree16"],
             "test": "a_ge_b"})
    rows = [line for line in ff.claims_section(tmp_path, ff.load_runs(tmp_path)) if line.startswith("| ")][1:]
    verdicts = [r.rstrip(" |").rsplit("| ", 1)[-1] for r in rows]
    assert verdicts[0] == "holds (beyond the interval)", rows[0]
    assert verdicts[1] == "fails (beyond the interval)", rows[1]
    assert verdicts[2].startswith("fails: +0.") and verdicts[2].endswith("beyond ±0.1 on mtbench"), rows[2]
    assert verdicts[3] == "not judged yet (ff-absent tree16)", rows[3]


def test_the_checked_in_lab_table_is_what_the_kept_reports_give(monkeypatch):
    ff = _table()
    monkeypatch.chdir(ROOT)
    text = ff.build_table(ff.REPORTS, "python recipes/field_families_table.py", ff.reference_run())
    assert (ROOT / "docs" / "lab" / "field_families.md").read_text() == text, \
        "docs/lab/field_families.md lags behind the kept reports: run `python recipes/field_families_table.py`"


def test_a_recorded_command_names_no_machine_path(tmp_path):
    from core.paths import repo_relative

    checkout = tmp_path / "elsewhere" / "checkout"
    (checkout / ".git").mkdir(parents=True)
    assert repo_relative(str(checkout / "docs" / "lab" / "x.json")) == "docs/lab/x.json"
    assert repo_relative("runs/ff-ctc/export") == "runs/ff-ctc/export"
    assert repo_relative("--num-prompts") == "--num-prompts"


def test_the_cpu_minutes_rest_on_the_trainer_then_time_then_the_loop_clock():
    """The trainer's own count wins; `time`'s records count only when they cover the loop (a start killed with
    its session leaves none); else the loop's wall clock, marked as the bound it is."""
    t = _table()
    killed = [{"wall_s": 600.0, "user_s": 540.0, "sys_s": 6.0}]  # 10 of the loop's 150 minutes recorded
    assert t.cpu_cost({"train_seconds": 9000, "train_cpu_seconds": 7200.0}, killed) == {
        "cpu_minutes": 120.0, "cpu_basis": "trainer"}
    covered = [{"wall_s": 5000.0, "user_s": 4000.0, "sys_s": 20.0}, {"wall_s": 4100.0, "user_s": 3900.0, "sys_s": 40.0}]
    assert t.cpu_cost({"train_seconds": 9000, "train_cpu_seconds": None}, covered) == {
        "cpu_minutes": 132.7, "cpu_basis": "time"}
    bound = t.cpu_cost({"train_seconds": 9000}, killed)
    assert bound == {"cpu_minutes": 150.0, "cpu_basis": "loop wall (upper bound)"}
    assert t.cpu_cell(bound) == "≤ 150" and t.cpu_cell({"cpu_minutes": 132.7, "cpu_basis": "time"}) == "133"
    assert t.cpu_cell({"cpu_minutes": 154.5, "cpu_basis": "loop wall (upper bound)"}) == "≤ 155"  # a bound rounds up


def test_an_older_train_json_gets_its_cpu_basis_by_the_same_rule(tmp_path):
    """A train.json collected before the basis was kept (its cpu_minutes summed over killed starts only) is read
    with the bound, not the partial sum."""
    t = _table()
    run = tmp_path / "ff-x"
    run.mkdir()
    (run / "train.json").write_text(json.dumps({"family": "dflash", "train_minutes": 154.5, "cpu_minutes": 9.3,
                                                "invocations": [{"wall_s": 637.0, "user_s": 543.0, "sys_s": 7.0}]}))
    got = t.load_runs(tmp_path)["ff-x"]["train"]
    assert (got["cpu_minutes"], got["cpu_basis"]) == (154.5, "loop wall (upper bound)")
