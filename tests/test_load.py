"""Load readings beside timings (core/load.py) and their mark in the eval summary."""

from __future__ import annotations

from pathlib import Path

import core.load as load
from eval.harness.runner import format_summary


def test_a_load_above_the_core_count_is_loaded(monkeypatch):
    monkeypatch.setattr(load, "cores", lambda: 2)
    monkeypatch.setattr(load, "load_average", lambda: [1.5, 1.0, 1.0])
    w = load.LoadWatch()
    assert load.is_loaded(w.record()) is False
    monkeypatch.setattr(load, "load_average", lambda: [4.2, 3.0, 2.0])
    rec = w.record()  # quiet at the start, loaded at the end: the span shared the CPU
    assert rec["loaded"] is True and load.describe(rec).startswith("LOADED: load average up to 4.2 on 2 cores")
    assert load.is_loaded(None) is None and load.describe(None) == "load not recorded"


def test_the_summary_marks_loaded_ratios():
    report = {"method": "m", "dataset": "d", "num_prompts": 1, "device": "cpu", "acceptance_length": 1.5,
              "tokens_per_second": 2.0, "ar_tokens_per_second": 1.0, "hf_tokens_per_second": 1.0, "speedup": 2.0,
              "speedup_vs_hf": 2.0, "lossless": True,
              "extra": {"load": {"start": [5.0, 1, 1], "end": [5.0, 1, 1], "cores": 2, "loaded": True}}}
    assert "LOADED" in format_summary(report, Path("x")) and "no card" in format_summary(report, Path("x"))
    report["extra"]["load"]["loaded"] = False
    assert "quiet" in format_summary(report, Path("x"))
