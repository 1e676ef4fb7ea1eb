"""The serving lines `specdraft tune` writes into an export (eval/tune/serving.py, eval/tune/report.py)
hold on another machine: the vLLM venv, the base, the draft and the llama.cpp build are placeholders the shell
expands, each explained once in NOTES.md; no path of the tuning machine is written. No model, no engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from eval.tune.report import notes_section
from eval.tune.serving import (
    BASE_DIR,
    VLLM_DRAFT,
    VLLM_PYTHON,
    LlamaCppEngine,
    VllmEngine,
    placeholders,
    vllm_serve_command,
)
from eval.tune.sweep import Setting

MACHINE = "/machine/only"  # where the tuning machine kept everything


def _vllm_engine() -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # what command() reads, without a vLLM venv
    engine.loaded = SimpleNamespace(family="eagle3")
    engine.job = {"base_dir": f"{MACHINE}/bases/smollm2", "max_model_len": 249}
    engine._spec = {"method": "eagle3", "model": f"{MACHINE}/runs/x/tune/t/vllm/export"}
    return engine


def _llamacpp_engine() -> LlamaCppEngine:
    engine = LlamaCppEngine.__new__(LlamaCppEngine)  # what command() reads, without a llama.cpp build
    engine.loaded = SimpleNamespace(family="eagle3")
    engine._files = (Path(f"{MACHINE}/cache/llamacpp/gguf/abc-q8_0.gguf"), Path(f"{MACHINE}/runs/x/draft.gguf"))
    engine.threads, engine.ctx, engine.slots = 1, 168, 1
    engine.cfg = SimpleNamespace(serve_llamacpp_no_repack=True)
    return engine


def _expanded(line: str, env: dict) -> list[str]:
    """The words bash makes of `line` (its command replaced by printf), with `env` set."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\n' {line.split('   #')[0]}"], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.splitlines()


def test_the_vllm_lines_name_placeholders_and_expand_to_the_served_config():
    engine = _vllm_engine()
    line = engine.command(Setting("num_speculative_tokens 2", {"num_speculative_tokens": 2}, 2.0))
    schedule = engine.schedule_command([[1, 1, 2], [2, 8, 0]])
    for text in (line, schedule):
        assert MACHINE not in text and f'"{VLLM_PYTHON}"' in text and f'--model "{BASE_DIR}"' in text
    if shutil.which("bash") is None:
        pytest.skip("no bash to expand the line")
    env = {"VLLM_PYTHON": "/opt/v env/bin/python", "BASE_DIR": "/data/base", "VLLM_DRAFT": "/data/my draft",
           "PATH": "/usr/bin:/bin"}
    words = _expanded(line.removeprefix("VLLM_CPU_KVCACHE_SPACE=1 "), env)
    assert words[0] == "/opt/v env/bin/python" and words[words.index("--model") + 1] == "/data/base"
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "/data/my draft", "num_speculative_tokens": 2}
    words = _expanded(schedule.removeprefix("VLLM_CPU_KVCACHE_SPACE=1 "), env)
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec["model"] == "/data/my draft" and spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 2],
                                                                                                 [2, 8, 0]]


def test_the_llamacpp_line_names_the_gguf_export_files():
    engine = _llamacpp_engine()
    line = engine.command(Setting("n-max 3, p-min 0", {"num_speculative_tokens": 3, "p_min": 0.0}, 3.0))
    assert MACHINE not in line
    assert line.startswith('"$LLAMA_SERVER" -m "$GGUF_DIR/base.gguf" -md "$GGUF_DIR/draft.gguf" ')
    if shutil.which("bash") is None:
        pytest.skip("no bash to expand the line")
    words = _expanded(line, {"LLAMA_SERVER": "/b/llama-server", "GGUF_DIR": "/g", "PATH": "/usr/bin:/bin"})
    assert words[:5] == ["/b/llama-server", "-m", "/g/base.gguf", "-md", "/g/draft.gguf"]


def test_notes_explain_each_placeholder_the_lines_use_once():
    vllm, llama = _vllm_engine(), _llamacpp_engine()
    speculate = {"speculate": True, "speedup_vs_ar": 1.2, "reason": "beats AR", "label": "k 2"}
    engines = {
        "vllm": {"dtype": "bfloat16", "threads": "own", "placeholders": placeholders("vllm", f"{MACHINE}/b"),
                 "choice": {**speculate, "command": vllm.command(Setting("k 2", {"num_speculative_tokens": 2}, 2))}},
        "llamacpp": {"dtype": "base q8_0, draft f16 GGUF", "threads": 1,
                     "placeholders": placeholders("llamacpp", f"{MACHINE}/b", "q8_0", "f16"),
                     "choice": {"speculate": False, "speedup_vs_ar": 1.0, "reason": "slower", "label": "AR",
                                "command": llama.command(Setting("AR", {}, 0.0))}},
    }
    notes = notes_section(engines)
    assert MACHINE not in notes
    used = set(re.findall(r"\$[A-Z_]+", "\n".join(line for line in notes.splitlines() if line.startswith("  "))))
    assert used == {"$VLLM_PYTHON", "$BASE_DIR", "$VLLM_DRAFT", "$LLAMA_SERVER", "$GGUF_DIR"}
    for name in used:  # one line each, saying what it is
        lines = [ln for ln in notes.splitlines() if ln.startswith(f"- `{name}`: ")]
        assert len(lines) == 1 and len(lines[0]) > 40, (name, lines)
    assert "`make vllm`" in notes and "`make llamacpp` builds it and prints its path" in notes
    assert "--base-type q8_0 --draft-type f16" in notes


def test_the_base_directory_is_named_relative_to_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    inside = placeholders("vllm", tmp_path / "bases" / "smollm2")[BASE_DIR]
    outside = placeholders("vllm", "/elsewhere/base")[BASE_DIR]
    assert "<cache>/bases/smollm2" in inside and str(tmp_path) not in inside
    assert "/elsewhere" not in outside
    assert vllm_serve_command(VLLM_PYTHON, BASE_DIR, 64, {"model": VLLM_DRAFT}).count("'\"$VLLM_DRAFT\"'") == 1
