"""The serving line `specdraft tune` writes for vLLM users (eval/tune/serving.py: vllm_serve_command), run as
written: the OpenAI server from .venv-vllm starts and answers one request, without and with a speculative_config
(marker `vllm`: needs `make vllm`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_fixtures import medusa_export_on_servable_base

from core.net import free_port
from eval.serving.serve_check import ServeCheckError, vllm_python
from eval.tune.serving import vllm_serve_command


def test_the_line_names_the_module_and_a_memory_share_the_cpu_build_can_start_with():
    line = vllm_serve_command(Path("/v/bin/python"), "/m/base", 512, {"method": "medusa", "num_speculative_tokens": 2})
    assert "/v/bin/python -m vllm.entrypoints.openai.api_server --model /m/base --max-model-len 512" in line
    assert "--gpu-memory-utilization 0.5" in line and "vllm serve" not in line
    assert json.loads(line.split("--speculative-config ", 1)[1].strip("'")) == {"method": "medusa",
                                                                               "num_speculative_tokens": 2}
    assert vllm_serve_command(Path("p"), "b", 64).endswith("plain decoding")


def _have_vllm() -> bool:
    try:
        return vllm_python().is_file()
    except ServeCheckError:
        return False


def _ask(port: int, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="no vLLM venv: `make vllm` (or set SPECDRAFT_VLLM_VENV)")
@pytest.mark.parametrize("speculate", [False, True])
def test_the_printed_line_serves_one_request(tmp_path, speculate):
    from models.export.formats import export_vllm
    from models.export.load import load_export
    from models.export.vllm import read_speculative_config

    export = medusa_export_on_servable_base(tmp_path)
    base_dir = tmp_path / "base"
    spec = None
    if speculate:
        loaded = load_export(export)
        out = export_vllm(loaded.draft.float(), tmp_path / "vllm", loaded.config, loaded.view)
        spec = {**read_speculative_config(out), "num_speculative_tokens": 2}
    port = free_port()
    line = vllm_serve_command(vllm_python(), base_dir, 256, spec).split("   #")[0] + f" --port {port}"
    proc = subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"the server exited: {proc.stdout.read()[-3000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 10 minutes"
                time.sleep(2)
        answer = _ask(port, str(base_dir))
        assert answer["choices"] and answer["usage"]["completion_tokens"] > 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
