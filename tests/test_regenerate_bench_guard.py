"""bench/regenerate.py times each engine in its own guard: an engine that raises is recorded in bench.json with its
error and the engines after it still run, and bench.json is on disk after every engine (and as each one starts), so
neither a failure nor a kill (the GPU kit's stage timeout sends SIGTERM) loses what finished. Engines here are fakes:
no model runs."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import regenerate  # noqa: E402

ENGINES = ["fast", "hf-cb", "hf-static", "generate"]
TOKENS = {"fast": 400, "hf-cb": 300, "hf-static": 200, "generate": 100}  # generated tokens in 1 s each


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """Runs bench/regenerate.py's main with fake engines; `fail` maps an engine to what it raises (an exception
    instance, or "sigterm": the process gets SIGTERM mid-engine). Returns (exit status, bench.json, snapshots of
    bench.json as each engine started)."""
    out = tmp_path / "bench"
    seen: dict[str, dict] = {}

    def run(fail: dict) -> tuple[int, dict, dict]:
        def fake_engine(name, base, args, out_dir, settings):
            seen[name] = json.loads((out_dir / "bench.json").read_text())  # what is on disk as it starts
            if fail.get(name) == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif name in fail:
                raise fail[name]
            path = out_dir / f"{name}.jsonl"
            path.write_text("".join(json.dumps({"id": i, "answer": "same"}) + "\n" for i in range(3)))
            meta = {"generated_tokens": TOKENS[name], "records": 3, "cut_answers": 0}
            path.with_name(path.name + ".meta.json").write_text(json.dumps(meta))
            return {"path": path, "seconds": 1.0, "version": f"fake {name}", "batch": 4}

        monkeypatch.setattr(regenerate, "_run_engine", fake_engine)
        monkeypatch.setattr(regenerate, "_available", lambda: list(ENGINES))
        monkeypatch.setattr(regenerate, "load_base", lambda *a, **k: SimpleNamespace(name="fake-base"))
        before = signal.getsignal(signal.SIGTERM)
        try:
            rc = regenerate.main(["--engines", ",".join(ENGINES), "--out", str(out), "--num-prompts", "3"])
        except SystemExit as stop:
            rc = stop.code
        finally:
            signal.signal(signal.SIGTERM, before)
        return rc, json.loads((out / "bench.json").read_text()), seen

    return run


def test_an_engine_that_raises_is_recorded_and_the_others_still_run(bench, capsys):
    rc, saved, _ = bench({"hf-cb": RuntimeError("paged cache: no room for 512 requests")})
    rows = saved["engine_results"]
    assert rc == 1 and list(rows) == ENGINES
    assert rows["hf-cb"]["status"] == "failed"
    assert "RuntimeError: paged cache: no room for 512 requests" in rows["hf-cb"]["error"]
    assert "tokens_per_second" not in rows["hf-cb"]
    for name in ("fast", "hf-static", "generate"):
        assert rows[name]["status"] == "done" and rows[name]["tokens_per_second"] == TOKENS[name], rows[name]
        assert "vs_hf-cb" not in rows[name]  # no ratio to an engine that measured nothing
    assert rows["fast"]["vs_generate"] == 4.0 and rows["fast"]["identical_to_generate"] == "3/3"
    assert "hf-cb failed" in capsys.readouterr().out


def test_bench_json_is_on_disk_after_every_engine(bench):
    rc, saved, seen = bench({"hf-static": ValueError("static cache")})
    assert rc == 1
    # as each engine starts, the ones before it are on disk, finished or failed, and it is marked running
    assert seen["fast"]["engine_results"] == {"fast": {"status": "running"}}
    assert seen["hf-cb"]["engine_results"]["fast"]["tokens_per_second"] == TOKENS["fast"]
    assert seen["generate"]["engine_results"]["hf-static"]["status"] == "failed"
    assert seen["generate"]["engine_results"]["hf-cb"]["tokens_per_second"] == TOKENS["hf-cb"]
    assert saved["engine_results"]["generate"]["vs_generate"] == 1.0


def test_a_kill_mid_engine_keeps_the_finished_ones_and_names_the_cut_one(bench):
    rc, saved, _ = bench({"hf-static": "sigterm"})
    rows = saved["engine_results"]
    assert rc != 0 and list(rows) == ["fast", "hf-cb", "hf-static"]  # generate never started
    assert rows["fast"]["tokens_per_second"] == TOKENS["fast"]
    assert rows["hf-cb"]["status"] == "done" and rows["fast"]["vs_hf-cb"] == round(400 / 300, 2)
    assert rows["hf-static"]["status"] == "running" and "SIGTERM" in rows["hf-static"]["error"]


def test_keep_going_stops_an_exception_but_not_an_interrupt(tmp_path):
    from bench.harness import Results

    results = Results(tmp_path / "r.json", {"rows": {}})
    with results.arm("rows", "a", keep_going=True) as row:
        row["x"] = 1
        raise RuntimeError("boom")
    with results.arm("rows", "b", keep_going=True) as row:
        row["x"] = 2
    with pytest.raises(KeyboardInterrupt):
        with results.arm("rows", "c", keep_going=True):
            raise KeyboardInterrupt
    saved = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert saved["a"] == {"x": 1, "error": "RuntimeError: boom"} and saved["b"] == {"x": 2}
    assert saved["c"]["error"] == "KeyboardInterrupt"
