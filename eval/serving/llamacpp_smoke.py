"""`make llamacpp`'s last step: the built llama-server serves one short greedy completion on each quantized base,
the packaged Q4_1 SmolLM2 and its Q8_0 conversion (the one tune and serve-check use), with llama.cpp's extra CPU
buffer types on (no -nr). Quantized weights are where ggml's CPU matrix kernels (repacked layouts, AMX tiles on a
Xeon) run; f32 GGUFs never reach them, so a build that serves f32 can still die on every quantized GGUF. A server
that dies or does not answer fails the make with how it died (exit code, signal name) and the last lines of its log.

    python -m eval.serving.llamacpp_smoke [--threads N] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eval.serving.llamacpp_paths import LlamaCppError, llamacpp_root
from eval.serving.llamacpp_server import LlamaServer, runtime_args

# 16 prompt tokens: a prompt batch of several rows, the shape that runs ggml's tiled (AMX) matmuls (one row takes
# the vector path). Plain ids inside SmolLM2's vocabulary: no tokenizer needed.
SMOKE_PROMPT = list(range(1000, 1016))
SMOKE_TOKENS = 4
LOG_LINES = 12  # of the server's log, in a failure


@dataclass
class SmokeResult:
    name: str  # the base's GGUF type (q4_1, q8_0)
    gguf: Path
    ok: bool
    detail: str  # ok: what it answered; else how the server died (or what it answered wrong) + its last log lines
    seconds: float
    tokens: list[int] = field(default_factory=list)


def death_reason(returncode: int) -> str:
    """How a process ended, from Popen's returncode: a negative code is the signal that killed it (the shell's exit
    code for it is 128 + the signal: 132 for SIGILL)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = f"{signal.Signals(-returncode).name} (signal {-returncode}, "
    except ValueError:
        name = f"signal {-returncode} ("
    return f"killed by {name}exit code {128 - returncode} in a shell)"


class _Watched(LlamaServer):
    """A LlamaServer that tells a server that died by itself from one stop() had to kill (it hung)."""

    hung = False

    def _fail(self, what: str):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(2)  # a server that is dying as its socket closes is reaped, not called hung
            except subprocess.TimeoutExpired:
                self.hung = True
        super()._fail(what)


def smoke_one(name: str, gguf: Path, log_path: Path, threads: int = 1, timeout: float = 300.0,
              binary: Path | None = None) -> SmokeResult:
    """Start llama-server on `gguf` (extra buffer types on), ask for SMOKE_TOKENS greedy tokens after SMOKE_PROMPT,
    stop it. Never raises for a server that fails: the result says how."""
    srv = _Watched(runtime_args(["-m", str(gguf)], threads, ctx=256, no_repack=False), log_path, timeout,
                   binary=binary)
    t0 = time.monotonic()
    phase = "while starting"
    try:
        with srv:
            phase = "at the completion request"
            out = srv.complete(SMOKE_PROMPT, SMOKE_TOKENS)
    except LlamaCppError as exc:
        rc = srv.proc.returncode if srv.proc is not None else None
        if rc is not None and not srv.hung:
            what = f"llama-server {death_reason(rc)} {phase}"
        else:
            what = str(exc).split("; command:", 1)[0]
        tail = list(srv.tail)[-LOG_LINES:]
        detail = f"{what}\n  command: {' '.join(srv.args)}\n  last lines of its log ({log_path}):\n" \
            + "\n".join(f"    {line}" for line in tail)
        return SmokeResult(name, gguf, False, detail, time.monotonic() - t0)
    secs = time.monotonic() - t0
    tokens = [int(t) for t in out.get("tokens") or []]
    prompt_n = (out.get("timings") or {}).get("prompt_n")
    if prompt_n != len(SMOKE_PROMPT) or not tokens:
        return SmokeResult(name, gguf, False, f"llama-server answered, but not the request: prompt_n={prompt_n} "
                           f"(sent {len(SMOKE_PROMPT)}), tokens={tokens}", secs, tokens)
    return SmokeResult(name, gguf, True, f"{len(tokens)} tokens {tokens}", secs, tokens)


def quantized_bases() -> list[tuple[str, Path]]:
    """The packaged Q4_1 SmolLM2 GGUF and its Q8_0 conversion (made once by llama.cpp's converter, cached)."""
    from types import SimpleNamespace

    from eval.serving.llamacpp_gguf import base_gguf
    from models.base import SMOLLM2_NAME
    from models.smollm2_gguf import ensure_smollm2_dir, smollm2_gguf_path

    base_dir, fingerprint = ensure_smollm2_dir()
    base = SimpleNamespace(name=SMOLLM2_NAME, fingerprint=fingerprint)
    return [("q4_1", smollm2_gguf_path()), ("q8_0", base_gguf(base, base_dir, "q8_0"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.serving.llamacpp_smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="-t / -tb (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the start and for the request")
    args = ap.parse_args(argv)
    logs = llamacpp_root() / "smoke"
    failed = []
    for name, gguf in quantized_bases():
        r = smoke_one(name, gguf, logs / f"{name}.log", args.threads, args.timeout)
        print(f"[llamacpp smoke] {name} {gguf.name}: " + (f"ok, {r.detail} in {r.seconds:.1f} s" if r.ok else
                                                          "FAILED"), flush=True)
        if not r.ok:
            failed.append(r)
            print(f"  {r.detail}", file=sys.stderr, flush=True)
    if failed:
        print(f"[llamacpp smoke] llama-server failed on {', '.join(r.name for r in failed)}; the build under "
              f"{llamacpp_root()} does not serve quantized GGUFs (launch/build_llamacpp.sh)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
