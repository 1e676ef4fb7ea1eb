"""What `specdraft field` says about its own figures (eval/field/simulation.py, report.py, refs.py): the path
each report took (`exact`, or `batched` with its measured agreement), a dtype other than the stored answers' refused
with the fix or, when asked for, marked in every output; the default run is a fixed subset of every set, the full
store one flag away, and the cost is said before the run starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.stored_answers import write_tiny_refs

from eval.field.refs import RefsError, dtype_mark, read_refs
from eval.field.report import EXACT, field_markdown, path_label
from eval.field.simulation import DEFAULT_PER_SET, default_subset, estimate_cost, judge_export
from eval.harness.config import load_eval_config

STORE = Path("datasets/smollm2-field-refs")
MARK = "bf16 draft and base against fp32 answers"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_report_of_the_exact_path_says_exact(smoke_run, tmp_path):
    """One prompt at a time (lockstep 0, `--no-lockstep`; a Medusa draft has a batched path too): every output says
    `exact`, and no agreement is claimed."""
    run_dir, _ = smoke_run
    refs = write_tiny_refs(tmp_path / "refs")
    report, out = judge_export(run_dir / "export", refs, load_eval_config([], ["tree=chain4"]), out_dir=tmp_path / "f",
                               label="smoke", lockstep=0)
    assert report["meta"]["path"] == "exact" and report["meta"]["agreement"] is None
    assert f"path: {EXACT}" in (out / "field.md").read_text()
    assert report["meta"]["dtype_mark"] is None and "MARKED" not in field_markdown(report)


def test_old_reports_say_what_their_lockstep_width_implies():
    assert path_label({"lockstep": 0}) == EXACT
    assert path_label({"lockstep": 64}) == ("batched (lockstep 64; agreement with the exact path not measured in "
                                             "this run)")
    a = {"prompts": ["a", "b"], "steps": 40, "identical_steps": 39, "rows": 2, "identical_rows": 1,
         "max_set_al_diff": 0.025, "max_set_al_diff_set": "mtbench"}
    label = path_label({"lockstep": 64, "path": "batched", "agreement": a})
    assert label.startswith("batched (lockstep 64; measured agreement: 39 of 40 steps identical, 1 of 2 prompts' "
                            "rows identical, max per-set AL diff 0.025 on mtbench; on 2 of its prompts")


def test_bf16_against_fp32_answers_is_refused_with_the_fix_or_marked(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    refs = write_tiny_refs(tmp_path / "refs")
    with pytest.raises(RefsError, match=r"judge with dtype=fp32, or pass --mixed-dtype"):
        read_refs(refs, dtype="bfloat16")
    card, _ = read_refs(refs, dtype="bfloat16", mixed_dtype=True)
    assert dtype_mark(card, "bfloat16") == MARK and dtype_mark(card, "float32") is None
    cfg = load_eval_config([], ["tree=chain4", "dtype=bf16"])
    with pytest.raises(RefsError, match="matches neither bf16 nor fp32 decoding"):
        judge_export(run_dir / "export", refs, cfg, out_dir=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # refused before any work
    report, out = judge_export(run_dir / "export", refs, cfg, out_dir=tmp_path / "marked", mixed_dtype=True)
    assert report["meta"]["dtype_mark"] == MARK and json.loads((out / "field.json").read_text())["meta"][
        "dtype_mark"] == MARK
    text = (out / "field.md").read_text()
    assert text.splitlines()[0].count(f"MARKED: {MARK}") == 1 and f"MARKED: {MARK}: the replayed hidden" in text


def test_bf16_refused_by_the_command_line(smoke_run, tmp_path, capsys):
    from cli.main import main

    run_dir, _ = smoke_run
    refs = write_tiny_refs(tmp_path / "refs")
    assert main(["field", "--draft", str(run_dir / "export"), "--refs", str(refs), "--out", str(tmp_path / "o"),
                 "tree=chain4", "dtype=bf16"]) != 0
    assert "judge with dtype=fp32, or pass --mixed-dtype" in capsys.readouterr().err
    assert main(["field", "--draft", str(run_dir / "export"), "--refs", str(refs), "--out", str(tmp_path / "o"),
                 "--mixed-dtype", "tree=chain4", "dtype=bf16"]) == 0
    assert f"MARKED: {MARK}" in capsys.readouterr().out


def test_the_cost_is_said_before_the_run(smoke_run, tmp_path):
    run_dir, _ = smoke_run
    refs = write_tiny_refs(tmp_path / "refs")
    said: list[str] = []

    def announce(line):
        said.append(line)
        assert len(said) > 3 or not list((tmp_path / "f").glob("rows-*.jsonl")), "said after the run started"

    judge_export(run_dir / "export", refs, load_eval_config([], ["tree=chain4", "backend=hf"]),
                 out_dir=tmp_path / "f", subset="default", announce=announce)
    assert said[0].startswith("field: the default subset") and "--full judges all 6" in said[0]
    assert said[1].startswith("this run: 6 prompts, 6 to judge") and "min" in said[1]
    assert said[2].startswith("the full run (--full): 6 prompts")
    judge_export(run_dir / "export", refs, load_eval_config([], ["tree=chain4", "backend=hf"]),
                 out_dir=tmp_path / "f", subset="default", announce=announce)
    assert "0 to judge" in said[4] and "cache ready" in said[4]  # a finished report: nothing left to pay


def test_estimate_counts_what_is_left():
    from eval.field.refs import RefPrompt

    refs = [RefPrompt(f"p{i}", "s", [1] * 10, [2] * 30, 20, False) for i in range(4)]
    c = estimate_cost(refs, {"p0"}, lambda r: r.id == "p1", tokens_per_s=40.0, judge_s_per_token=0.03)
    assert (c["prompts"], c["to_judge"], c["to_cache"], c["cache_tokens"]) == (4, 3, 2, 80)
    assert c["cache_minutes"] == pytest.approx(80 / 40 / 60) and c["judge_minutes"] == pytest.approx(60 * 0.03 / 60)


@pytest.mark.skipif(not (STORE / "card.json").is_file(), reason="the SmolLM2 stored answers are not here")
def test_the_default_subset_covers_every_set_with_300_prompts_or_more():
    card, refs = read_refs(STORE)
    picked = default_subset(refs)
    assert len(picked) >= 300 and {r.set for r in picked} == set(card["counts"]) and len(card["counts"]) == 11
    assert picked == default_subset(list(refs))  # deterministic
    per_set = {s: [r for r in picked if r.set == s] for s in card["counts"]}
    for s, rs in per_set.items():  # each set's first prompts, in store order
        assert rs == [r for r in refs if r.set == s][: len(rs)]
    assert len(per_set["long-context"]) == -(-DEFAULT_PER_SET // 2)  # the long prompts, half as many
    assert all(len(rs) == DEFAULT_PER_SET for s, rs in per_set.items() if s != "long-context")
    tokens = sum(len(r.prompt) + len(r.answer) for r in picked) / sum(len(r.prompt) + len(r.answer) for r in refs)
    assert tokens < 0.25  # the base pass (the first run's cache) costs under a quarter of the full store's


def test_full_and_num_prompts_are_one_flag_each():
    from cli.main import _parser

    p = _parser()
    assert p.parse_args(["field", "--draft", "d", "--full"]).full
    assert p.parse_args(["field", "--draft", "d"]).num_prompts is None
    with pytest.raises(SystemExit):
        p.parse_args(["field", "--draft", "d", "--full", "--num-prompts", "3"])
