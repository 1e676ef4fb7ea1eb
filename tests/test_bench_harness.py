"""bench/harness.py: timing on a scripted clock (median, spread, warm-up left out, the paired A B / B A order),
ratios only from one run's numbers, and a results file that holds every finished arm after a later arm raises or
the process is killed outright."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench/ is scripts, not an installed package

from bench.harness import Results, Stopwatch, peak_memory, ratio, time_fn, time_once, time_paired  # noqa: E402


class ScriptedClock:
    """A clock that advances only when a call under test says how long it took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def call_taking(self, durations: list[float]):
        it = iter(durations)

        def fn():
            self.now += next(it)
        return fn


def test_time_fn_median_and_spread_on_a_scripted_clock():
    clock = ScriptedClock()
    fn = clock.call_taking([100.0, 3.0, 1.0, 2.0, 5.0, 4.0])  # the first (100 s) is the warm-up
    t = time_fn(fn, warmup=1, repeats=5, clock=clock)
    assert t.times == [3.0, 1.0, 2.0, 5.0, 4.0]
    assert t.median == 3.0 and t.min == 1.0 and t.max == 5.0
    assert t.spread == pytest.approx((5.0 - 1.0) / 3.0)
    assert t.summary()["median_s"] == 3.0 and t.summary()["repeats"] == 5


def test_sync_runs_before_every_clock_read():
    clock, log = ScriptedClock(), []
    fn = clock.call_taking([1.0] * 4)
    time_fn(lambda: (log.append("call"), fn()), warmup=1, repeats=3, clock=clock, sync=lambda: log.append("sync"))
    assert log == ["call", "sync"] + ["call", "sync"] * 3


def test_time_once_returns_the_value_and_its_seconds():
    clock = ScriptedClock()
    value, seconds = time_once(lambda: (setattr(clock, "now", clock.now + 7.5), "done")[1], clock=clock)
    assert value == "done" and seconds == 7.5


def test_paired_timing_interleaves_and_gives_each_its_own_times():
    clock, order = ScriptedClock(), []

    def ref():
        order.append("A")
        clock.now += 2.0

    def arm():
        order.append("B")
        clock.now += 1.0

    a, b = time_paired(ref, arm, warmup=1, repeats=4, clock=clock)
    assert order == ["A", "B", "A", "B", "B", "A", "A", "B", "B", "A"]  # warm-up, then A B / B A / A B / B A
    assert a.times == [2.0] * 4 and b.times == [1.0] * 4
    assert ratio(a.median, b.median) == 2.0


def test_a_load_step_mid_run_hits_both_arms_of_a_paired_run():
    """The machine slows down 3x halfway: interleaving keeps the ratio of the medians near the true 2x, where
    timing all of A, then all of B, would report 2/3 (B alone pays the slowdown)."""
    clock, calls = ScriptedClock(), [0]

    def work(cost):
        def fn():
            calls[0] += 1
            clock.now += cost * (3.0 if calls[0] > 6 else 1.0)
        return fn

    a, b = time_paired(work(2.0), work(1.0), warmup=0, repeats=6, clock=clock)
    assert ratio(a.median, b.median) == 2.0
    calls[0] = 0
    seq_a = time_fn(work(2.0), warmup=0, repeats=6, clock=clock)
    seq_b = time_fn(work(1.0), warmup=0, repeats=6, clock=clock)
    assert ratio(seq_a.median, seq_b.median) == pytest.approx(0.67)


def test_ratio_of_nothing_is_none():
    assert ratio(1.0, 0.0) is None and ratio(3.0, 2.0) == 1.5


def test_results_file_keeps_finished_arms_when_a_later_arm_raises(tmp_path):
    path = tmp_path / "out" / "bench.json"
    results = Results(path, {"device": "cpu", "rows": {}})
    with results.arm("rows", "first") as row:
        row["tok_s"] = 10.0
    assert json.loads(path.read_text())["rows"] == {"first": {"tok_s": 10.0}}  # on disk before the next arm
    with pytest.raises(RuntimeError, match="boom"):
        with results.arm("rows", "second") as row:
            row["started"] = True
            raise RuntimeError("boom")
    saved = json.loads(path.read_text())
    assert saved["device"] == "cpu" and saved["rows"]["first"] == {"tok_s": 10.0}
    assert saved["rows"]["second"]["started"] is True and "RuntimeError: boom" in saved["rows"]["second"]["error"]
    assert not list(path.parent.glob("*.tmp*"))  # the atomic write leaves no temp file behind


def test_results_file_keeps_finished_arms_when_the_process_is_killed(tmp_path):
    """SIGKILL (a stage's timeout) runs no handler: what is on disk is what the arms before it wrote."""
    path = tmp_path / "bench.json"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from bench.harness import Results
        results = Results({str(path)!r}, {{"rows": {{}}}})
        for name in ["a", "b", "c"]:
            with results.arm("rows", name) as row:
                if name == "c":
                    os.kill(os.getpid(), signal.SIGKILL)
                row["done"] = name
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert json.loads(path.read_text())["rows"] == {"a": {"done": "a"}, "b": {"done": "b"}}


def test_put_makes_missing_levels_and_saves(tmp_path):
    results = Results(tmp_path / "r.json")
    results.put("ratios", "fast_vs_ref", 1.5)
    assert json.loads((tmp_path / "r.json").read_text()) == {"ratios": {"fast_vs_ref": 1.5}}
    Results(None, {}).put("x", 1)  # no path: nothing written, no error


def test_peak_memory_sees_a_cpu_allocation():
    import torch

    with peak_memory("cpu") as small:
        pass
    with peak_memory("cpu") as big:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    assert big.kind == "cpu_peak_rss" and big.bytes > 0
    if big.reset and small.reset:  # VmHWM reset at entry: the block's own peak shows
        assert big.delta_bytes > 32 * 2**20 and small.delta_bytes < 16 * 2**20


def test_stopwatch_reads_phases_after_a_sync():
    clock, log = ScriptedClock(), []
    watch = Stopwatch(sync=lambda: log.append("sync"), clock=clock, cpu_clock=clock)
    clock.now += 1.5
    assert watch.wall() == 1.5
    clock.now += 2.0
    assert watch.wall() == 3.5 and watch.cpu() == 3.5
    assert log == ["sync"] * 4


def harness_users(bench_dir: Path = REPO / "bench") -> dict[str, bool]:
    """Every script of bench/ (the harness aside): does it import bench.harness?"""
    import ast

    out = {}
    for path in sorted(bench_dir.glob("*.py")):
        if path.name == "harness.py":
            continue
        tree = ast.parse(path.read_text())
        out[path.name] = any(isinstance(n, ast.ImportFrom) and n.module == "bench.harness" for n in ast.walk(tree))
    return out


def test_every_bench_script_times_and_records_through_the_harness():
    """A script with its own clock or its own results file drifts from the rest (no warm-up, ratios across runs,
    a JSON half-written when a stage is killed): each one imports bench.harness (docs/howto/contribute.md)."""
    users = harness_users()
    assert users and not [name for name, uses in users.items() if not uses]


def test_the_check_sees_a_script_without_the_harness(tmp_path):
    (tmp_path / "own_clock.py").write_text("import time\nt0 = time.perf_counter()\n")
    (tmp_path / "ok.py").write_text("from bench.harness import time_fn\n")
    assert harness_users(tmp_path) == {"ok.py": True, "own_clock.py": False}
