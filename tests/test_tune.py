"""`specdraft tune`'s sweep with a scripted engine (eval/harness/tune.py): programmed speeds, acceptances, noise,
crashes and hangs; no model, no serving engine. The clock is the test's own, so budgets are exact."""

from __future__ import annotations

import json

import pytest

from eval.harness.tune import (
    AR,
    BudgetTooSmall,
    EngineUnavailable,
    Measurement,
    PointFailed,
    Setting,
    check_budget,
    choose,
    machine_info,
    read_tuning,
    run_sweeps,
    sweep_engine,
    tuned_choice,
    write_tuning,
)

TOKENS = 120  # tokens per pass of the scripted prompt set


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ScriptedSession:
    def __init__(self, engine, setting):
        self.engine, self.setting, self.closed = engine, setting, False

    def run(self) -> Measurement:
        e, label = self.engine, self.setting.label
        e.calls.append(label)
        if label in e.hang_on_run:  # what an adapter reports when the engine stops answering
            raise PointFailed(f"{label}: no answer within 30 s, killed", [f"{label} log line {i}" for i in range(30)])
        n = len([c for c in e.calls if c == label])
        tps = e.speeds[label] * e.drift(len(e.calls), label, n)
        e.clock.t += TOKENS / tps
        steps = round(TOKENS / e.acceptance.get(label, 1.0))
        drafted = int(self.setting.knobs.get("n", 0)) * steps
        return Measurement(TOKENS, TOKENS / tps, steps=steps, drafted=drafted, accepted=TOKENS - steps,
                           outputs={"p1": [1, 2, 3], "p2": [4, 5] if label not in e.wrong else [4, 6]})

    def close(self):
        self.closed = True
        self.engine.closed.append(self.setting.label)


class ScriptedEngine:
    """speeds: tokens/s by setting label (AR under AR.label); acceptance: tokens per step by label; crash_on_open /
    hang_on_run: labels that fail there; drift(call index, label, nth run of the label) -> a speed multiplier."""

    def __init__(self, speeds, acceptance=None, crash_on_open=(), hang_on_run=(), wrong=(), drift=None,
                 name="scripted", open_seconds=1.0, pass_seconds=2.0, clock=None):
        self.name, self.speeds, self.acceptance = name, speeds, acceptance or {}
        self.crash_on_open, self.hang_on_run, self.wrong = set(crash_on_open), set(hang_on_run), set(wrong)
        self.drift = drift or (lambda i, label, n: 1.0)
        self.open_seconds, self.pass_seconds = open_seconds, pass_seconds
        self.clock = clock or FakeClock()
        self.calls, self.closed, self.opened = [], [], []

    def describe(self):
        return {"engine": self.name, "version": "1.0", "dtype": "float32", "threads": 1}

    def settings(self):
        return [Setting(label, {"n": int(label.split()[-1])}, float(label.split()[-1]))
                for label in self.speeds if label != AR.label]

    def open(self, setting):
        self.opened.append(setting.label)
        self.clock.t += self.open_seconds
        if setting.label in self.crash_on_open:
            raise PointFailed(f"engine exited with code -11 starting {setting.label}",
                              ["loading draft", "Segmentation fault"])
        return ScriptedSession(self, setting)

    def command(self, setting):
        return f"serve --n {setting.knobs.get('n', 0)}"


def sweep(engine, repeats=2, noise=0.03, budget=1e9):
    return sweep_engine(engine, repeats, noise, engine.clock.t + budget, now=engine.clock)


def by_label(record):
    return {p["label"]: p for p in record["points"]}


def test_picks_the_fastest_with_margins_over_ar_and_runner_up():
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 22.0, "chain 2": 27.0, "chain 3": 24.0},
                         acceptance={"chain 1": 1.3, "chain 2": 1.6, "chain 3": 1.7})
    rec = sweep(eng)
    c = rec["choice"]
    assert c["label"] == "chain 2" and c["speculate"] and c["reason"] == "fastest"
    assert c["speedup_vs_ar"] == pytest.approx(27 / 20)
    assert c["runner_up"] == "chain 3" and c["margin_over_runner_up"] == pytest.approx(27 / 20 - 24 / 20)
    assert c["command"] == "serve --n 2"
    p = by_label(rec)["chain 2"]
    assert p["acceptance_length"] == pytest.approx(1.6, rel=0.01) and p["tokens_per_second"] == pytest.approx(27)
    assert p["accepted_per_drafted"] == pytest.approx((TOKENS - 75) / (2 * 75))
    assert p["same_tokens_as_ar"] == 1.0 and rec["ar"]["tokens_per_second"] == pytest.approx(20)


def test_interleaves_ar_and_each_setting_abba_and_closes_every_session():
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 25.0, "chain 2": 21.0})
    sweep(eng, repeats=3)
    assert eng.calls == [AR.label, "chain 1", "chain 1", AR.label, AR.label, "chain 1",
                         AR.label, "chain 2", "chain 2", AR.label, AR.label, "chain 2"]
    assert sorted(eng.closed) == sorted([AR.label, "chain 1", "chain 2"])


def test_pairing_cancels_a_machine_that_slows_down():
    """The machine halves its speed half-way through; a paired ratio still sees chain 1 at 1.25x AR, while the
    raw speeds of the later setting would look slower than AR's early runs."""
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 25.0, "chain 2": 30.0},
                         drift=lambda i, label, n: 1.0 if i <= 4 else 0.5)
    rec = sweep(eng)
    pts = by_label(rec)
    assert pts["chain 1"]["speedup"] == pytest.approx(1.25) and pts["chain 2"]["speedup"] == pytest.approx(1.5)
    assert pts["chain 2"]["tokens_per_second"] < 20  # raw speed under the slow machine
    assert rec["choice"]["label"] == "chain 2"


def test_a_difference_inside_the_noise_is_a_tie_and_the_cheaper_setting_wins():
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 26.0, "chain 3": 26.4})
    c = sweep(eng, noise=0.05)["choice"]
    assert c["label"] == "chain 1" and c["fastest"] == "chain 3" and "cheaper setting wins" in c["reason"]
    # outside the noise the faster, dearer setting wins
    c = sweep(ScriptedEngine({AR.label: 20.0, "chain 1": 26.0, "chain 3": 29.0}), noise=0.05)["choice"]
    assert c["label"] == "chain 3"


def test_measured_scatter_widens_the_noise_beyond_the_floor():
    """chain 3 alternates 1.0x / 1.6x AR across repeats (median 1.3, half-range 0.3): inside that noise chain 1
    (1.2x, steady) is a tie, so the cheaper chain 1 wins although chain 3's median is higher."""
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 24.0, "chain 3": 26.0},
                         drift=lambda i, label, n: (20 / 26 if n % 2 else 32 / 26) if label == "chain 3" else 1.0)
    rec = sweep(eng, repeats=2, noise=0.01)
    pts = by_label(rec)
    assert pts["chain 3"]["noise"] == pytest.approx(0.3) and pts["chain 3"]["speedup"] == pytest.approx(1.3)
    assert rec["choice"]["label"] == "chain 1"


def test_do_not_speculate_is_a_written_result(tmp_path):
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 20.3, "chain 2": 15.0})
    rec = sweep(eng, noise=0.03)
    c = rec["choice"]
    assert c["label"] == AR.label and c["speculate"] is False and "do not speculate" in c["reason"]
    assert c["command"] == "serve --n 0"
    write_tuning(tmp_path, {"export": str(tmp_path)}, {"scripted": rec})
    got = tuned_choice(tmp_path, "scripted")
    assert got["speculate"] is False and got["label"] == AR.label


def test_a_crashing_and_a_hanging_point_are_recorded_and_the_sweep_goes_on():
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 24.0, "chain 2": 30.0, "chain 3": 22.0},
                         crash_on_open={"chain 2"}, hang_on_run={"chain 3"})
    rec = sweep(eng)
    pts = by_label(rec)
    assert pts["chain 2"]["status"] == "failed" and "code -11" in pts["chain 2"]["error"]
    assert pts["chain 2"]["log_tail"] == ["loading draft", "Segmentation fault"]
    assert pts["chain 3"]["status"] == "failed" and "no answer within 30 s" in pts["chain 3"]["error"]
    assert len(pts["chain 3"]["log_tail"]) == 20 and pts["chain 3"]["log_tail"][-1] == "chain 3 log line 29"
    assert "chain 3" in eng.closed  # the hung session was closed (its process group killed by the adapter)
    assert pts["chain 1"]["status"] == "ok" and rec["choice"]["label"] == "chain 1"


def test_an_ar_that_dies_mid_setting_is_reopened():
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 24.0, "chain 2": 26.0})
    real_run = ScriptedSession.run
    died = []

    def run(self):
        if self.setting is AR and len(eng.calls) == 3 and not died:
            died.append(1)
            eng.calls.append("AR died")
            raise PointFailed("AR: engine died", ["oom"])
        return real_run(self)

    ScriptedSession.run = run
    try:
        rec = sweep(eng)
    finally:
        ScriptedSession.run = real_run
    pts = by_label(rec)
    assert pts["chain 1"]["status"] == "failed" and "AR died during this setting" in pts["chain 1"]["error"]
    assert eng.opened.count(AR.label) == 2 and pts["chain 2"]["status"] == "ok"
    assert rec["choice"]["label"] == "chain 2"


def test_an_engine_whose_ar_cannot_start_is_a_failed_record():
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 24.0}, crash_on_open={AR.label})
    rec = sweep(eng)
    assert rec["status"] == "failed" and rec["choice"] is None and "Segmentation fault" in rec["log_tail"]


def test_a_lossy_setting_is_flagged():
    rec = sweep(ScriptedEngine({AR.label: 20.0, "chain 1": 24.0}, wrong={"chain 1"}))
    assert by_label(rec)["chain 1"]["same_tokens_as_ar"] == 0.5


def test_budget_too_small_is_refused_up_front_with_the_minimum():
    a = ScriptedEngine({AR.label: 20.0, "chain 1": 24.0}, name="a", open_seconds=30, pass_seconds=60)
    b = ScriptedEngine({AR.label: 20.0, "chain 1": 24.0}, name="b", open_seconds=60, pass_seconds=30)
    need = (2 * 30 + 2 * 2 * 60) + (2 * 60 + 2 * 2 * 30)  # AR + one setting, 2 repeats, per engine
    with pytest.raises(BudgetTooSmall, match=r"--budget-minutes 9 or more") as exc:
        check_budget([a, b], 2, need - 1)
    assert "a 5.0, b 4.0" in str(exc.value)
    check_budget([a, b], 2, need)  # exactly enough: accepted
    with pytest.raises(BudgetTooSmall):
        run_sweeps([a, b], 2, 0.03, need - 1, now=a.clock)
    assert a.calls == [] and b.calls == []  # nothing ran


def test_settings_past_the_budget_are_skipped_not_started():
    eng = ScriptedEngine({AR.label: 20.0, "chain 1": 24.0, "chain 2": 25.0, "chain 3": 40.0},
                         open_seconds=1.0, pass_seconds=6.0)
    # AR open 1 s + chain 1 (open 1 s + 4 passes of ~5-6 s) fits in 30 s; chain 2 would not
    rec = sweep(eng, budget=30.0)
    pts = by_label(rec)
    assert pts["chain 1"]["status"] == "ok"
    assert pts["chain 2"]["status"] == pts["chain 3"]["status"] == "skipped"
    assert "chain 3" not in eng.opened and rec["choice"]["label"] == "chain 1"


def test_run_sweeps_records_an_engine_that_cannot_serve_the_draft():
    class NoMethod(ScriptedEngine):
        def settings(self):
            raise EngineUnavailable("vLLM has no method for a hydra draft")

    clock = FakeClock()
    out = run_sweeps([ScriptedEngine({AR.label: 20.0, "chain 1": 24.0}, name="ours", clock=clock),
                      NoMethod({AR.label: 20.0}, name="vllm", clock=clock)], 2, 0.03, 600, now=clock)
    assert out["ours"]["choice"]["label"] == "chain 1"
    assert out["vllm"]["status"] == "unservable" and "hydra" in out["vllm"]["error"]


def test_tuning_json_round_trip_merges_engines_and_refuses_a_damaged_file(tmp_path):
    assert read_tuning(tmp_path) is None and tuned_choice(tmp_path, "ours") is None
    ours = sweep(ScriptedEngine({AR.label: 20.0, "chain 1": 24.0}))
    vllm = sweep(ScriptedEngine({AR.label: 18.0, "chain 1": 17.0, "chain 2": 25.0}, name="vllm"))
    write_tuning(tmp_path, {"machine": machine_info("model name : Test CPU\nflags : avx2 avx512_bf16\n")},
                 {"ours": ours})
    write_tuning(tmp_path, {"machine": machine_info("model name : Test CPU\nflags : avx2\n")}, {"vllm": vllm})
    data = json.loads((tmp_path / "tuning.json").read_text())
    assert set(data["engines"]) == {"ours", "vllm"} and data["machine"]["cpu"] == "Test CPU"
    assert data["machine"]["avx512_bf16"] is False  # the later run's machine
    assert tuned_choice(tmp_path, "vllm")["knobs"] == {"n": 2} and tuned_choice(tmp_path, "ours")["speculate"]
    assert tuned_choice(tmp_path, "llamacpp") is None
    (tmp_path / "tuning.json").write_text("{not json")
    with pytest.raises(ValueError, match="tuning.json is not valid JSON.*rerun `specdraft tune`"):
        read_tuning(tmp_path)


def test_choose_with_nothing_measured_does_not_speculate():
    c = choose([{"label": "chain 1", "status": "failed"}], 0.03)
    assert c["speculate"] is False and "nothing shown to beat AR" in c["reason"]
