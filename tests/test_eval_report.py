"""Report aggregation math, the exact report.json key set, and the files written."""

import json

import pytest

from eval.harness.report import (
    PLOT_FILES,
    REPORT_KEYS,
    PromptResult,
    build_report,
    default_speeds,
    per_depth_counts,
    validate_report,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONTRACT_KEYS = {"method", "base_model", "device", "dataset", "num_prompts", "new_tokens", "base_steps",
               "acceptance_length", "accept_rate_per_position", "tokens_per_second", "ar_tokens_per_second",
               "hf_tokens_per_second", "speedup", "speedup_vs_hf", "draft_time_fraction", "lossless",
               "lossless_fraction"}


def results():
    # Prompt a: 3 steps, accept lengths 3,1,2 with depth-2 drafts each step -> 6 tokens.
    acc_a, prop_a = per_depth_counts([3, 1, 2], [2, 2, 2])
    a = PromptResult(id="a", new_tokens=6, base_steps=3, decode_time=2.0, prefill_time=0.5, draft_time=0.5,
                     accept_lengths=[3, 1, 2], accepted_per_depth=acc_a, proposed_per_depth=prop_a,
                     matches_greedy=True, prompt="p", output="o", tokens=[1, 2, 3, 4, 5, 6])
    # Prompt b: 2 steps, depth-3 drafts on the first only -> 5 tokens.
    acc_b, prop_b = per_depth_counts([4, 1], [3, 0])
    b = PromptResult(id="b", new_tokens=5, base_steps=2, decode_time=3.0, prefill_time=0.25, draft_time=1.5,
                     accept_lengths=[4, 1], accepted_per_depth=acc_b, proposed_per_depth=prop_b,
                     matches_greedy=False)
    return [a, b]


def test_per_depth_counts():
    assert per_depth_counts([3, 1, 2], [2, 2, 2]) == ([2, 1], [3, 3])
    assert per_depth_counts([4, 1], [3, 0]) == ([1, 1, 1], [1, 1, 1])
    assert per_depth_counts([], []) == ([], [])
    with pytest.raises(ValueError, match="offered only depth"):
        per_depth_counts([3], [1])
    with pytest.raises(ValueError, match="per verification step"):
        per_depth_counts([1, 1], [1])


def test_aggregate_math():
    r = build_report(results(), method="medusa", base_model="tiny", device="cpu", dataset="fixture",
                     ar_tokens_per_second=1.1, hf_tokens_per_second=2.2, extra={"tree_size": 7})
    assert r["num_prompts"] == 2
    assert r["new_tokens"] == 11 and r["base_steps"] == 5
    assert r["acceptance_length"] == pytest.approx(11 / 5)
    # depth 1: accepted 2 (a) + 1 (b) of 3 + 1 proposed; depth 2: 1 + 1 of 3 + 1; depth 3: 1 of 1.
    assert r["accept_rate_per_position"] == pytest.approx([3 / 4, 2 / 4, 1.0])
    assert r["tokens_per_second"] == pytest.approx(11 / 5.0)  # prefill excluded
    assert r["speedup"] == pytest.approx((11 / 5) / 1.1)
    assert r["speedup_vs_hf"] == pytest.approx((11 / 5) / 2.2)
    assert r["draft_time_fraction"] == pytest.approx(2.0 / 5.0)
    assert r["lossless"] is False and r["lossless_fraction"] == pytest.approx(0.5)
    assert r["extra"]["prefill_seconds"] == pytest.approx(0.75)
    assert r["extra"]["tree_size"] == 7 and r["extra"]["lossless_checked"] == 2
    assert set(r) == CONTRACT_KEYS | {"extra"}


def test_aggregate_edge_cases():
    ar = PromptResult(id="x", new_tokens=4, base_steps=4, decode_time=1.0, accept_lengths=[1, 1, 1, 1])
    r = build_report([ar], method="ar", base_model="tiny", device="cpu", dataset="d")
    assert r["acceptance_length"] == 1.0
    assert r["accept_rate_per_position"] == []
    assert r["speedup"] is None and r["speedup_vs_hf"] is None  # baselines not measured
    assert r["lossless"] is None and r["lossless_fraction"] is None  # not checked
    partly = [PromptResult(id="y", new_tokens=1, base_steps=1, decode_time=1.0, matches_greedy=True), ar]
    r = build_report(partly, method="m", base_model="b", device="cpu", dataset="d")
    assert r["lossless"] is True and r["lossless_fraction"] == 1.0 and r["extra"]["lossless_checked"] == 1
    with pytest.raises(ValueError, match="no results"):
        build_report([], method="m", base_model="b", device="cpu", dataset="d")


def test_prompt_result_rejects_inconsistent_bookkeeping():
    with pytest.raises(ValueError, match="exceeds proposed"):
        PromptResult(id="z", new_tokens=2, base_steps=1, decode_time=1.0, accepted_per_depth=[2],
                     proposed_per_depth=[1])
    with pytest.raises(ValueError, match="increases with depth"):
        PromptResult(id="z", new_tokens=2, base_steps=1, decode_time=1.0, accepted_per_depth=[0, 1],
                     proposed_per_depth=[1, 1])
    with pytest.raises(ValueError, match="accept length < 1"):
        PromptResult(id="z", new_tokens=2, base_steps=1, decode_time=1.0, accept_lengths=[0])


def _report():
    return build_report(results(), method="medusa", base_model="tiny", device="cpu", dataset="fixture",
                        ar_tokens_per_second=1.1, hf_tokens_per_second=2.2)


def test_write_report_files(tmp_path):
    res = results()
    report = _report()
    steps = [n for r in res for n in r.accept_lengths]
    paths = write_report(tmp_path / "eval" / "x", report, [r.to_sample() for r in res], steps,
                         report["accept_rate_per_position"], default_speeds(report), extra={"note": "hi"})
    out = tmp_path / "eval" / "x"
    saved = json.loads((out / "report.json").read_text())
    assert set(saved) == CONTRACT_KEYS | {"extra"} and tuple(k for k in saved if k != "extra") == REPORT_KEYS
    assert saved["extra"]["note"] == "hi" and saved["acceptance_length"] == pytest.approx(11 / 5)
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b"]
    first = json.loads(lines[0])
    assert {"id", "prompt", "output", "tokens", "accept_lengths", "matches_greedy"} <= set(first)
    assert first["accept_lengths"] == [3, 1, 2] and first["matches_greedy"] is True
    md = (out / "report.md").read_text()
    assert "| acceptance_length | 2.2 |" in md
    for name in PLOT_FILES.values():
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert f"]({name})" in md  # embedded
    assert paths["report_json"] == out / "report.json"
    assert paths["throughput"] == out / PLOT_FILES["throughput"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left behind


def test_write_report_handles_missing_baselines_and_no_drafts(tmp_path):
    ar = PromptResult(id="x", new_tokens=4, base_steps=4, decode_time=1.0, accept_lengths=[1, 1, 1, 1])
    report = build_report([ar], method="ar", base_model="tiny", device="cpu", dataset="d")
    write_report(tmp_path, report, [ar.to_sample()], ar.accept_lengths, [], None)
    assert json.loads((tmp_path / "report.json").read_text())["speedup"] is None
    assert all((tmp_path / name).read_bytes()[:8] == PNG_MAGIC for name in PLOT_FILES.values())


def test_missing_or_unknown_key_raises(tmp_path):
    report = _report()
    del report["speedup_vs_hf"]
    with pytest.raises(ValueError, match=r"missing \['speedup_vs_hf'\]"):
        write_report(tmp_path, report, [], [], [], None)
    assert not (tmp_path / "report.json").exists()
    report = {**_report(), "prefill_time": 1.0}
    with pytest.raises(ValueError, match=r"unknown \['prefill_time'\].*extra"):
        validate_report(report)
    with pytest.raises(ValueError, match="inf/NaN"):
        validate_report({**_report(), "speedup": float("inf")})
