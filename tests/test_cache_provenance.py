"""Cached measurements carry where, when and by what they were measured (core/keyed_cache.py: provenance), and a
record measured on another host or CPU, by other code, or on a loaded machine is measured again, never reused: the
decode-dtype probe (eval/engine/dtype_probe.py) and the untuned-shape probe (eval/tune/untuned_probe.py). Probe
records are scripted: no timing runs."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from core.dtype_phases import PROBE_FORMAT
from core.keyed_cache import code_version, host_identity, provenance, stale
from eval.engine.dtype_probe import probe_code_version, resolve_phase_dtypes

AMX_CPU = "model name\t: Test Xeon\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
QUIET = {"start": [0.2, 0.2, 0.2], "end": [0.3, 0.2, 0.2], "cores": 2, "loaded": False}
LOADED = {"start": [3.4, 2.0, 1.0], "end": [3.1, 2.0, 1.0], "cores": 2, "loaded": True}


class ScriptedProbe:
    """Stands in for probe_decode_speed: a record taken at `load`, and how often it ran."""

    def __init__(self, load: dict):
        self.load, self.calls = load, 0

    def __call__(self, model, kind: str) -> dict:
        self.calls += 1
        return {"format": PROBE_FORMAT, "backend": kind, "prefix": 128, "width": 4, "repeats": 7,
                "ms": {"bf16": {"1": 40.0, "4": 45.0}, "fp32": {"1": 30.0, "4": 38.0}}, "load": dict(self.load)}


def resolve(tmp_path, probe):
    base = SimpleNamespace(model=None, fingerprint="base-a")
    return resolve_phase_dtypes("fast", torch.device("cpu"), load_fp32=lambda: base, fingerprint="base-a",
                                backend="fast", cache_dir=tmp_path, probe=probe, cpuinfo=AMX_CPU)


def _edit_provenance(tmp_path, **changes) -> None:
    (path,) = (tmp_path / "dtype_probe").glob("*.json")
    data = json.loads(path.read_text())
    data["provenance"].update(changes)
    path.write_text(json.dumps(data))


def test_a_quiet_record_of_this_host_and_code_is_reused_with_its_provenance(tmp_path):
    probe = ScriptedProbe(QUIET)
    first = resolve(tmp_path, probe)
    again = resolve(tmp_path, probe)
    assert probe.calls == 1 and again.decode == first.decode == "fp32"
    (path,) = (tmp_path / "dtype_probe").glob("*.json")
    prov = json.loads(path.read_text())["provenance"]
    assert prov["host"] == host_identity()["host"] and prov["code"] == probe_code_version()
    assert prov["cpu"] == "Test Xeon" and prov["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_tile",
                                                                "amx_bf16"]
    assert prov["load"] == QUIET and prov["measured"].endswith("UTC")


@pytest.mark.parametrize("changes, why", [
    ({"host": "another-box"}, "measured on host 'another-box'"),
    ({"cpu_digest": "0123456789abcdef", "cpu": "AMD EPYC"}, "measured on another CPU (AMD EPYC"),
    ({"code": "0000000000000000"}, "measured by other code (version 0000000000000000"),
    ({"load": LOADED}, "measured loaded (1-minute load 3.4 on 2 cores)"),
])
def test_a_foreign_old_or_loaded_dtype_probe_record_is_measured_again(tmp_path, caplog, changes, why):
    probe = ScriptedProbe(QUIET)
    resolve(tmp_path, probe)
    _edit_provenance(tmp_path, **changes)
    with caplog.at_level(logging.INFO, logger="specdraft.dtype_probe"):
        resolve(tmp_path, probe)
    assert probe.calls == 2, "a stale record was reused"
    notes = [r.getMessage() for r in caplog.records if "not reused" in r.getMessage()]
    assert len(notes) == 1 and why in notes[0] and "measuring again" in notes[0]
    resolve(tmp_path, probe)  # the new record is this host's, this code's, quiet: reused
    assert probe.calls == 2


def test_a_record_the_probe_took_loaded_is_measured_again_at_the_next_run(tmp_path):
    probe = ScriptedProbe(LOADED)
    resolve(tmp_path, probe)
    resolve(tmp_path, probe)
    assert probe.calls == 2
    probe.load = QUIET
    resolve(tmp_path, probe)
    resolve(tmp_path, probe)
    assert probe.calls == 3


def test_a_record_without_provenance_is_measured_again(tmp_path):
    probe = ScriptedProbe(QUIET)
    resolve(tmp_path, probe)
    (path,) = (tmp_path / "dtype_probe").glob("*.json")
    data = json.loads(path.read_text())
    del data["provenance"]
    path.write_text(json.dumps(data))
    resolve(tmp_path, probe)
    assert probe.calls == 2


def test_the_code_version_follows_the_measuring_source(tmp_path):
    a, b = tmp_path / "probe.py", tmp_path / "backend.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    v1 = code_version([a, b])
    assert code_version([b, a]) == v1
    b.write_text("y = 3\n")
    assert code_version([a, b]) != v1
    prov = provenance(v1, QUIET)
    assert stale(prov, v1) is None and "other code" in stale(prov, code_version([a, b]))


# -- the untuned-shape probe -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from helpers.drafts import tiny_hydra_export

    return tiny_hydra_export(tmp_path_factory.mktemp("run"))


class Watch:
    """Stands in for core/load.py: LoadWatch in the shape probe: the load its record shows."""

    record_of = QUIET

    def record(self) -> dict:
        return dict(Watch.record_of)


def _sweep(calls: list):
    def sweep(engine, repeats, deadline, progress, tie):
        calls.append(repeats)
        points = [{"label": s.label, "knobs": s.knobs, "status": "ok", "speedup": 1.1, "acceptance_length": 1.4}
                  for s in engine.settings()]
        return {"points": points, "choice": {"speculate": True, "label": points[0]["label"],
                                             "knobs": points[0]["knobs"], "speedup_vs_ar": 1.1},
                "prompts": ["a", "b"], "max_new_tokens": 32, "repeats": repeats, "quick": repeats < 3}
    return sweep


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("changes, why", [
    ({"host": "another-box"}, "measured on host 'another-box'"),
    ({"code": "0000000000000000"}, "measured by other code"),
    (None, "measured loaded"),
])
def test_a_foreign_old_or_loaded_shape_probe_choice_is_probed_again(export, tmp_path, monkeypatch, caplog, changes,
                                                                    why):
    from eval.harness.config import load_eval_config
    from eval.harness.runner import eval_export
    from eval.tune.untuned_probe import probe_untuned_shape

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("eval.tune.untuned_probe.LoadWatch", Watch)
    Watch.record_of = LOADED if changes is None else QUIET
    calls: list = []
    monkeypatch.setattr("eval.tune.sweep.sweep_engine", _sweep(calls))

    def run(name):
        cfg = load_eval_config(["configs/eval/smoke.yaml"], ["hf_baseline=false", "dtype=fp32", "untuned_probe=true",
                                                            f"name={name}"])
        report, _ = eval_export(export, cfg, probe_untuned_shape)
        return report["extra"]["untuned"]["probe"]

    first = run("first")
    assert first["quick"] and first["repeats"] == 2  # fewer repeats than tune's rule: a quick choice
    (path,) = (tmp_path / "cache" / "shape_probe").glob("*.json")
    if changes:
        data = json.loads(path.read_text())
        data["provenance"].update(changes)
        path.write_text(json.dumps(data))
    Watch.record_of = QUIET
    with caplog.at_level(logging.INFO, logger="specdraft.untuned_probe"):
        again = run("again")
    assert len(calls) == 2 and not again["cached"], "a stale choice was reused"
    assert any(why in r.getMessage() and "not reused" in r.getMessage() for r in caplog.records)
    assert run("third")["cached"] and len(calls) == 2  # the fresh, quiet choice is reused
