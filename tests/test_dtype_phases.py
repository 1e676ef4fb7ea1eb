"""`dtype=fast` per phase (core/dtype_phases.py, eval/engine/dtype_probe.py, core/dtype_probe_cache.py): on a CPU with
bf16 matrix instructions the bulk phases keep bf16 and decoding takes whichever dtype the probe timed faster; a CPU
without them is fp32 everywhere, CUDA bf16, an explicit dtype exactly itself, none of them probed. The probe's
result is cached per machine (CPU, torch, threads, base, backend) and a bad cache file is measured again, with a
warning. Probe records are scripted here: no timing runs."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from core.dtype_phases import PROBE_FORMAT, decode_from_probe, phase_dtypes
from core.dtype_probe_cache import cache_path, probe_key
from eval.engine.backends.fast_matmul import fp32_layout
from eval.engine.dtype_probe import resolve_phase_dtypes

BF16_CPU = "model name\t: Test EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
AVX2_CPU = "model name\t: Test EPYC\nflags\t\t: fpu sse avx2\n"
CPU = torch.device("cpu")


def record(bf16: tuple[float, float], fp32: tuple[float, float], width: int = 4) -> dict:
    """A probe record: ms per step at (1 token, `width` tokens) in each dtype."""
    return {"format": PROBE_FORMAT, "backend": "fast", "prefix": 128, "width": width, "repeats": 7,
            "ms": {"bf16": {"1": bf16[0], str(width): bf16[1]}, "fp32": {"1": fp32[0], str(width): fp32[1]}},
            "load": {"start": [0.1, 0.1, 0.1], "end": [0.1, 0.1, 0.1], "cores": 2, "loaded": False}}


class ScriptedProbe:
    """Stands in for probe_decode_speed: returns `rec` and counts its calls."""

    def __init__(self, rec: dict):
        self.rec, self.calls = rec, 0

    def __call__(self, model, kind: str) -> dict:
        assert kind == "fast"
        self.calls += 1
        return self.rec


def never(*_):
    raise AssertionError("loaded or probed where no probe belongs")


def resolve(tmp_path, probe, *, requested: str = "fast", cpuinfo: str = BF16_CPU, fingerprint: str = "base-a",
            device=CPU):
    base = SimpleNamespace(model=None, fingerprint=fingerprint)
    return resolve_phase_dtypes(requested, device, load_fp32=lambda: base, fingerprint=fingerprint, backend="fast",
                                cache_dir=tmp_path, probe=probe, cpuinfo=cpuinfo)


# AMX-box-like: bf16 wins the bulk matmuls, but a one-token step is faster in fp32 (and so is 1 + 4 tokens)
FP32_DECODES = record(bf16=(43.7, 47.0), fp32=(32.3, 41.0))
BF16_DECODES = record(bf16=(22.0, 24.0), fp32=(33.0, 37.0))


def test_fast_keeps_bf16_for_bulk_and_decodes_in_what_the_probe_timed_faster(tmp_path):
    probe = ScriptedProbe(FP32_DECODES)
    phases = resolve(tmp_path, probe)
    assert (phases.bulk, phases.decode) == ("bf16", "fp32") and probe.calls == 1
    assert phases.to_dict()["prefill"] == "fp32"  # one decode dtype per run: its prefill too
    assert "1 token bf16 43.7 / fp32 32.3 ms" in phases.why and "4 tokens bf16 47.0 / fp32 41.0 ms" in phases.why
    assert phases.probe["ms"] == FP32_DECODES["ms"]
    phases = resolve(tmp_path / "other", ScriptedProbe(BF16_DECODES))
    assert (phases.bulk, phases.decode) == ("bf16", "bf16")
    # within 5 % of each other: fp32 (noise; and fp32 decoding is the exact verdict)
    assert decode_from_probe(record(bf16=(31.0, 35.0), fp32=(32.0, 35.5))) == "fp32"


def test_a_cpu_without_bf16_instructions_is_fp32_everywhere_unprobed(tmp_path):
    phases = resolve(tmp_path, never, cpuinfo=AVX2_CPU)
    assert (phases.bulk, phases.decode, phases.probe) == ("fp32", "fp32", None)
    assert "without bf16 matrix instructions" in phases.why


def test_cuda_is_bf16_unprobed(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    phases = resolve(tmp_path, never, device=torch.device("cuda"))
    assert (phases.bulk, phases.decode, phases.probe) == ("bf16", "bf16", None)


@pytest.mark.parametrize("requested,want", [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("auto", "fp32")])
def test_an_explicit_dtype_means_exactly_that_unprobed(tmp_path, requested, want):
    phases = resolve(tmp_path, never, requested=requested)
    assert (phases.bulk, phases.decode, phases.probe) == (want, want, None)
    assert "no probe" in phases.why


def test_the_probe_is_cached_per_cpu_torch_threads_and_base(tmp_path, monkeypatch):
    probe = ScriptedProbe(FP32_DECODES)
    resolve(tmp_path, probe)
    resolve(tmp_path, probe)
    assert probe.calls == 1  # the second run reads the cache
    resolve(tmp_path, probe, fingerprint="base-b")
    assert probe.calls == 2  # another base
    resolve(tmp_path, probe, cpuinfo=BF16_CPU.replace("avx512f", "avx512f amx_bf16"))
    assert probe.calls == 3  # other CPU flags
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(saved + 1)
        resolve(tmp_path, probe)
        assert probe.calls == 4  # another thread count
    finally:
        torch.set_num_threads(saved)
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    resolve(tmp_path, probe)
    assert probe.calls == 5  # another torch
    files = list((tmp_path / "dtype_probe").glob("*.json"))
    assert len(files) == 5 and all(json.loads(f.read_text())["key"]["format"] == PROBE_FORMAT for f in files)


@pytest.mark.parametrize("bad", ["{not json", json.dumps(["a", "list"]),
                                 "WRONG KEY", "NEGATIVE TIME", "OLD FORMAT"])
def test_a_bad_cache_file_is_probed_again_with_a_warning(tmp_path, caplog, bad):
    key = probe_key(fingerprint="base-a", backend="fast", threads=torch.get_num_threads(), cpuinfo=BF16_CPU,
                    extra={"fp32_matmul": fp32_layout(CPU)})  # the key resolve_phase_dtypes reads
    path = cache_path(key, tmp_path)
    path.parent.mkdir(parents=True)
    rec = json.loads(json.dumps(BF16_DECODES))
    if bad == "WRONG KEY":
        bad = json.dumps({"key": {**key, "base": "base-z"}, "probe": rec})
    elif bad == "NEGATIVE TIME":
        rec["ms"]["fp32"]["1"] = -1.0
        bad = json.dumps({"key": key, "probe": rec})
    elif bad == "OLD FORMAT":
        bad = json.dumps({"key": key, "probe": {**rec, "format": PROBE_FORMAT - 1}})
    path.write_text(bad)
    probe = ScriptedProbe(FP32_DECODES)
    with caplog.at_level(logging.WARNING, logger="specdraft.dtype_probe"):
        phases = resolve(tmp_path, probe)
    assert probe.calls == 1 and phases.decode == "fp32"
    assert any(str(path) in r.getMessage() and "probing again" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["probe"]["ms"] == FP32_DECODES["ms"]  # rewritten with the new record


def test_phase_dtypes_refuses_fast_on_a_bf16_cpu_without_a_probe():
    with pytest.raises(ValueError, match="needs the decode probe"):
        phase_dtypes("fast", CPU, cpuinfo=BF16_CPU)
    assert phase_dtypes("fast", CPU, cpuinfo=AVX2_CPU).decode == "fp32"
