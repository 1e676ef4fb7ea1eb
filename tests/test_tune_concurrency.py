"""`specdraft tune --concurrency` (eval/tune/concurrency.py) with the scripted engine of test_tune.py made
concurrency-aware: the count chosen per concurrency by the same noise-aware rule, each winner confirmed, vLLM's
per-batch-size schedule derived and written into the export and its vLLM speculative_config; the refusals of
--concurrency; tune's thread default agreeing with `specdraft eval`'s."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_tune import TOKENS, ScriptedEngine, ScriptedSession, scatter
from test_tune_cli import tune

from eval.tune.concurrency import parse_concurrency, run_sweeps, speculation_schedule, sweep_concurrencies
from eval.tune.sweep import AR, Measurement, Setting

CS = (1, 2, 4, 8)


class ConcurrentSession(ScriptedSession):
    def run(self, concurrency: int = 1) -> Measurement:
        e, label = self.engine, self.setting.label
        e.calls.append((label, concurrency))
        n = sum(1 for x in e.calls if x == (label, concurrency))
        tps = e.speeds[label][concurrency] * e.drift(len(e.calls), label, n)
        e.clock.t += TOKENS / tps
        steps = round(TOKENS / 1.5)
        return Measurement(TOKENS, TOKENS / tps, steps=steps, drafted=int(self.setting.knobs.get(
            "num_speculative_tokens", 0)) * steps, accepted=TOKENS - steps, outputs={"p1": [1, 2]})


class ConcurrentEngine(ScriptedEngine):
    """speeds: {label: {concurrency: tokens/s}}; settings are num_speculative_tokens k (labels "k 1", "k 2", ...)."""

    concurrencies = CS

    def settings(self):
        return [Setting(label, {"num_speculative_tokens": int(label.split()[-1])}, float(label.split()[-1]))
                for label in self.speeds if label != AR.label]

    def open(self, setting):
        self.opened.append(setting.label)
        self.clock.t += self.open_seconds
        return ConcurrentSession(self, setting)

    def describe(self):
        return {"engine": "vllm", "family": "eagle3", "version": "0.32", "dtype": "bfloat16", "threads": "own"}

    def schedule_command(self, ranges):
        return f"serve --schedule {json.dumps(ranges)}"


def _speeds():
    """AR grows with the batch; k 3 pays most for one request, k 2 at 2-3, k 1 at 4-7, nothing at 8."""
    ar = {1: 20.0, 2: 36.0, 4: 60.0, 8: 90.0}
    gain = {"k 1": {1: 1.15, 2: 1.12, 4: 1.25, 8: 0.80},
            "k 2": {1: 1.30, 2: 1.40, 4: 1.02, 8: 0.70},
            "k 3": {1: 1.55, 2: 1.10, 4: 0.85, 8: 0.60}}
    return {AR.label: ar, **{k: {c: ar[c] * g for c, g in by.items()} for k, by in gain.items()}}


def test_the_best_count_is_chosen_per_concurrency_confirmed_and_becomes_vllms_schedule():
    eng = ConcurrentEngine(_speeds(), drift=scatter(0.01))
    rec = sweep_concurrencies(eng, CS, 3, 1e9, now=eng.clock)
    chosen = {c: v["choice"]["label"] for c, v in rec["by_concurrency"].items()}
    assert chosen == {"1": "k 3", "2": "k 2", "4": "k 1", "8": AR.label}
    for v in rec["by_concurrency"].values():
        ch = v["choice"]
        assert ch["rule"]["settings_compared"] == 3
        if ch["speculate"]:  # confirmed in fresh sessions at that concurrency, its interval reported
            assert "confirmed at" in ch["reason"] and ch["interval"][0] > 1
            assert len(ch["confirmation"]["ratios"]) == 3
        else:
            assert "do not speculate" in ch["reason"]
    # each setting opened once and measured at every concurrency; the confirmation: one fresh AR + each winner
    assert eng.opened == [AR.label, "k 1", "k 2", "k 3", AR.label, "k 3", AR.label, "k 2", AR.label, "k 1"]
    assert {c for label, c in eng.calls if label == "k 2"} == set(CS)
    assert sorted(eng.closed) == sorted(eng.opened)
    sched = rec["schedule"]
    assert sched["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 3, 2], [4, 7, 1], [8, 8, 0]]
    assert sched["num_speculative_tokens"] == 3 and sched["per_concurrency"] == {"1": 3, "2": 2, "4": 1, "8": 0}
    assert sched["command"] == "serve --schedule [[1, 1, 3], [2, 3, 2], [4, 7, 1], [8, 8, 0]]"
    # the record keeps one request's view where the single-concurrency consumers read it
    assert rec["choice"]["label"] == "k 3" and rec["choice"]["schedule"] == sched
    assert rec["points"] is rec["by_concurrency"]["1"]["points"] and rec["concurrencies"] == list(CS)
    json.dumps(rec, allow_nan=False)


def test_a_winner_that_fails_its_confirmation_at_one_concurrency_drafts_nothing_there():
    """k 1 wins at 4 requests in the sweep (its first three passes there), but its fresh sessions run it at AR's
    speed: 4 falls back to "do not speculate", a 0 in the schedule; the other concurrencies keep theirs."""
    speeds = _speeds()
    eng = ConcurrentEngine(speeds, drift=scatter(0.01, also=lambda i, label, n: speeds[AR.label][4] / speeds[label][4]
                                                 if label == "k 1" and n > 3 and speeds[label][4] > 70 else 1.0))
    rec = sweep_concurrencies(eng, CS, 3, 1e9, now=eng.clock)
    four = rec["by_concurrency"]["4"]["choice"]
    assert four["speculate"] is False and four["unconfirmed"] == "k 1" and "does not exclude 1" in four["reason"]
    assert rec["schedule"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 3, 2], [4, 8, 0]]


def test_run_sweeps_takes_the_concurrency_path_and_budgets_every_concurrency():
    eng = ConcurrentEngine(_speeds(), drift=scatter(0.01), open_seconds=1.0, pass_seconds=2.0)
    out = run_sweeps([eng], 2, 1e6, now=eng.clock)
    assert out[eng.name]["schedule"]["per_concurrency"]["1"] == 3
    from eval.tune.sweep import BudgetTooSmall, check_budget

    # AR + one setting, 2 repeats at 4 concurrencies, and the confirmation: 2 * (2 * 1 + 2 * 8 * 2) s
    check_budget([eng], 2, 68)
    with pytest.raises(BudgetTooSmall):
        check_budget([eng], 2, 67)


def test_the_schedule_format_is_the_one_vllm_validates():
    def ch(k):
        return {"speculate": bool(k), "knobs": {"num_speculative_tokens": k} if k else {}}

    assert speculation_schedule({1: ch(2), 2: ch(2), 4: ch(1)})["num_speculative_tokens_per_batch_size"] == \
        [[1, 3, 2], [4, 4, 1]]  # adjacent equal counts merged; the last range ends at the last concurrency
    none = speculation_schedule({1: ch(0), 4: ch(0)})
    assert none["num_speculative_tokens_per_batch_size"] is None and none["num_speculative_tokens"] is None
    ranges = speculation_schedule({1: ch(3), 2: ch(2), 4: ch(1), 8: ch(0)})["num_speculative_tokens_per_batch_size"]
    from models.export.vllm import check_schedule

    assert check_schedule(ranges) == ranges
    for bad in ([], [[2, 4, 1]], [[1, 2, 1], [2, 3, 1]], [[1, 2, 0]], [[1, 1, -1]], "1,2"):
        with pytest.raises(ValueError, match="is not a vLLM schedule.*e.g. "):
            check_schedule(bad)
    utils = Path(".venv-vllm/lib/python3.11/site-packages/vllm/v1/spec_decode/dynamic/utils.py")
    if utils.is_file():  # vLLM's own expansion of it (a standalone file): batch size -> k
        spec = importlib.util.spec_from_file_location("vllm_dynamic_sd_utils", utils)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.build_dynamic_sd_schedule_lookup(ranges, 10, 3)[1:] == [3, 2, 2, 1, 1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("text,why", [("", "is empty"), ("4,2", "not strictly increasing"),
                                      ("1,2,2", "not strictly increasing"), ("2,4,8", "does not start at 1"),
                                      ("1,x", "not a list of whole numbers"), ("0,1", "not strictly increasing")])
def test_bad_concurrency_is_one_line_with_an_example(text, why):
    with pytest.raises(ValueError, match=why) as exc:
        parse_concurrency(text)
    assert "e.g. --concurrency 1,2,4,8" in str(exc.value) and len(str(exc.value).splitlines()) == 1
    assert parse_concurrency("1,2,4,8") == (1, 2, 4, 8) and parse_concurrency("1") == (1,)


@pytest.mark.parametrize("argv,why", [
    (["--engine", "ours", "--concurrency", "1,2"], "our decoder decodes one request at a time"),
    (["--engine", "all", "--concurrency", "1,4"], "is for the serving engines"),
    (["--engine", "vllm", "--concurrency", "1,2,4,8", "--num-prompts", "4"], "needs at least 8 prompts"),
    (["--engine", "vllm", "--concurrency", "1,4,2"], "e.g. --concurrency 1,2,4,8"),
])
def test_tune_refuses_a_concurrency_it_cannot_measure_in_one_line(tmp_path, argv, why):
    with pytest.raises(ValueError, match=why) as exc:  # before anything loads: no export, no engine needed
        tune(["--draft", str(tmp_path / "none"), *argv])
    assert len(str(exc.value).splitlines()) == 1


def _eagle3_export(tmp_path: Path) -> Path:
    import torch

    from models.base import load_base
    from models.draft import BaseView
    from models.export.specdraft import export_specdraft
    from models.families.eagle3.model import Eagle3Draft

    base = load_base("tiny", dtype="fp32")
    torch.manual_seed(0)
    return export_specdraft(Eagle3Draft(BaseView.from_model(base.model), ttt_steps=3).eval(),
                            tmp_path / "run" / "export", base.name, base.fingerprint)


def test_the_schedule_reaches_the_export_and_vllms_speculative_config(tmp_path, capsys):
    from cli.main import main
    from eval.choice.record import machine_info
    from eval.tune.report import write_export
    from models.export.vllm import TUNED_SCHEDULE_KEY, TUNED_TOKENS_KEY, read_speculative_config

    export = _eagle3_export(tmp_path)
    eng = ConcurrentEngine(_speeds(), drift=scatter(0.01))
    rec = {**sweep_concurrencies(eng, CS, 3, 1e9, now=eng.clock), "machine": machine_info(device="cpu")}
    write_export(export, {"machine": machine_info()}, {"vllm": rec})
    config = json.loads((export / "config.json").read_text())
    assert config[TUNED_TOKENS_KEY] == 3  # one request's count (serve-check, --format speculators)
    assert config[TUNED_SCHEDULE_KEY] == [[1, 1, 3], [2, 3, 2], [4, 7, 1], [8, 8, 0]]
    assert "4 in flight: 1" in (export / "NOTES.md").read_text()
    out = tmp_path / "vllm"
    assert main(["export", "--run", str(export.parent), "--format", "vllm", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "num_speculative_tokens_per_batch_size [[1, 1, 3]" in said
    spec = read_speculative_config(out)
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 3, 2], [4, 7, 1], [8, 8, 0]]
    assert spec["num_speculative_tokens"] == 3 and spec["method"] == "eagle3"
    # measured on another CPU: neither the count nor the schedule reaches the export
    write_export(export, {}, {"vllm": {**rec, "machine": {**machine_info(device="cpu"), "cpu": "Other CPU"}}})
    out2 = tmp_path / "vllm2"
    assert main(["export", "--run", str(export.parent), "--format", "vllm", "--out", str(out2)]) == 0
    spec = read_speculative_config(out2)
    assert "num_speculative_tokens_per_batch_size" not in spec and spec["num_speculative_tokens"] == 3
    # a family whose vLLM proposer drafts a fixed count (Medusa) keeps the schedule in tuning.json only
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "family": "medusa"}))
    write_export(export, {}, {"vllm": {**rec, "family": "medusa"}})
    assert TUNED_SCHEDULE_KEY not in json.loads((export / "config.json").read_text())
    from eval.tune.report import schedule_line

    assert "fixed count" in schedule_line({**rec, "family": "medusa"})


def test_the_report_shows_each_concurrency_beside_the_fixed_one_request_choice(tmp_path):
    from eval.choice.record import machine_info
    from eval.tune.report import markdown

    eng = ConcurrentEngine(_speeds(), drift=scatter(0.01))
    rec = sweep_concurrencies(eng, CS, 3, 1e9, now=eng.clock)
    context = {"export": "x", "machine": machine_info(), "num_prompts": 8, "max_new_tokens": 32, "dataset": "d",
               "repeats": 3, "alpha": 0.05, "min_gain": 0.0, "budget_minutes": 60, "wall_seconds": 60}
    text = markdown(context, {"vllm": rec})
    row8 = next(line for line in text.splitlines() if line.startswith("| 8 |"))
    k3_at_8 = rec["by_concurrency"]["8"]["points"][2]["speedup"]  # the fixed one-request choice, k 3, at 8
    assert "do not speculate" in row8 and row8.endswith(f"| {k3_at_8:.3f}x |")
    assert "serve --schedule [[1, 1, 3]" in text and "### 4 requests in flight" in text
    assert "num_speculative_tokens_per_batch_size [[1, 1, 3], [2, 3, 2], [4, 7, 1], [8, 8, 0]]" in text


def test_tune_measures_our_decoder_at_the_threads_eval_applies_its_choice_at(monkeypatch):
    """`specdraft eval` leaves torch's default threads (num_threads=0); tune without --threads does the same, so
    its recorded thread count is the one eval's applicability check sees (it was 1 against eval's all cores)."""
    import argparse

    import torch

    from eval.choice.apply import ours_here
    from eval.harness.config import EvalConfig
    from eval.tune.command import add_tune_parser, apply_threads, tune_eval_config

    parser = argparse.ArgumentParser()
    args = add_tune_parser(parser.add_subparsers(dest="command")).parse_args(["--draft", "x"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # a 2-core machine's default
        cfg = tune_eval_config(args)
        assert args.threads is None and cfg.num_threads == EvalConfig().num_threads == 0
        assert cfg.serve_llamacpp_threads == EvalConfig().serve_llamacpp_threads  # serve-check's default
        assert apply_threads(cfg) == 2 == ours_here(EvalConfig())["threads"]
        cfg = tune_eval_config(add_tune_parser(argparse.ArgumentParser().add_subparsers(dest="c")).parse_args(
            ["--draft", "x", "--threads", "1"]))
        assert apply_threads(cfg) == 1 and cfg.serve_llamacpp_threads == 1
    finally:
        torch.set_num_threads(before)


class LlamaEngine(ConcurrentEngine):
    """The scripted engine as llama.cpp: a p-min beside the count, and no per-batch-size schedule."""

    def settings(self):
        return [Setting(label, {"num_speculative_tokens": int(label.split()[-1]), "p_min": 0.0},
                        float(label.split()[-1])) for label in self.speeds if label != AR.label]

    def describe(self):
        return {"engine": "llamacpp", "family": "eagle3", "version": "b1", "dtype": "f32 GGUF", "threads": 1}

    schedule_command = None


def test_llamacpp_gets_a_choice_per_concurrency_and_no_vllm_schedule(tmp_path):
    from eval.choice.record import machine_info
    from eval.tune.report import markdown

    eng = LlamaEngine({AR.label: _speeds()[AR.label], **{k.replace("k", "n"): v for k, v in _speeds().items()
                                                          if k != AR.label}}, drift=scatter(0.01), name="llamacpp")
    rec = sweep_concurrencies(eng, CS, 3, 1e9, now=eng.clock)
    chosen = {c: v["choice"]["knobs"]["num_speculative_tokens"] if v["choice"]["speculate"] else 0
              for c, v in rec["by_concurrency"].items()}
    assert chosen == {"1": 3, "2": 2, "4": 1, "8": 0}
    context = {"export": "x", "machine": machine_info(), "num_prompts": 8, "max_new_tokens": 32, "dataset": "d",
               "repeats": 3, "alpha": 0.05, "min_gain": 0.0, "budget_minutes": 60, "wall_seconds": 60}
    text = markdown(context, {"llamacpp": rec})
    assert "Speedup vs llama.cpp AR at each concurrency" in text
    assert "no per-batch-size schedule" in text and "num_speculative_tokens_per_batch_size [[" not in text
    assert "1 in flight: 3 (" in text and "8 in flight: do not speculate" in text


class _FakeServer:
    """llama-server's /completion as _LlamaSession sees it: `prompt_ms` of prefill, tokens, draft counters."""

    def __init__(self):
        self.calls = []

    def complete(self, ids, n):
        import time

        self.calls.append(list(ids))
        time.sleep(0.05)
        return {"tokens": list(range(n)), "timings": {"prompt_n": len(ids), "prompt_ms": 20.0, "predicted_n": n,
                                                        "predicted_ms": 40.0, "draft_n": 4, "draft_n_accepted": 2}}


def test_llamacpp_sessions_send_groups_at_once_and_time_the_groups_not_the_rows():
    import time
    from types import SimpleNamespace

    from eval.tune.serving import _LlamaSession

    prompts = [SimpleNamespace(id=f"p{i}", input_ids=[1, 2, 3 + i]) for i in range(3)]
    session = object.__new__(_LlamaSession)
    session.engine = SimpleNamespace(prompts=prompts, cfg=SimpleNamespace(max_new_tokens=5))
    session.srv = _FakeServer()
    t0 = time.perf_counter()
    m = session.run(concurrency=2)  # groups (p0, p1), (p2, p0): wrapped, every group has 2 requests
    wall = time.perf_counter() - t0
    assert len(session.srv.calls) == 4 and session.srv.calls[3] == [1, 2, 3]
    assert wall < 0.18  # the two requests of a group ran at once (one at a time: 4 x 0.05 s)
    # two groups, each ~0.05 s of wall less its 0.02 s prefill; not the rows' summed 4 x 0.04 s
    assert 0.04 < m.seconds < 0.12 and m.new_tokens == 4 * 4
    one = session.run()  # one request at a time: llama.cpp's own predicted_ms per row, summed
    assert one.seconds == pytest.approx(3 * 0.04) and one.new_tokens == 3 * 4
