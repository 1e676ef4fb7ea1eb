"""One `llama-server` as a subprocess on a free local port: start, wait until healthy, complete token-id prompts,
stop. Standard library only (HTTP/JSON). A server that dies or hangs raises LlamaCppError with the last lines of
its log; nothing waits without a deadline, and the process group is always killed on exit."""

from __future__ import annotations

import collections
import http.client
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from core.net import free_port
from eval.serving.llamacpp_paths import LlamaCppError, llama_server


def runtime_args(server_args: list, threads: int, ctx: int, no_repack: bool = True) -> list[str]:
    """`server_args` (model, draft, speculative options) plus how it runs: `threads` for batch and decode (for the
    draft too when one is given with -md), a context of `ctx` tokens, no web UI, and -nr (no weight repacking, no
    AMX buffers: a build by an older build_llamacpp.sh dies with SIGILL in its AMX kernels) unless `no_repack` is
    False."""
    server_args, t = [str(a) for a in server_args], str(threads)
    args = [*server_args, "-t", t, "-tb", t, "-c", str(ctx), "--no-webui", *(["-nr"] if no_repack else [])]
    return args + (["-td", t, "-tbd", t] if "-md" in server_args else [])


class LlamaServer:
    """`with LlamaServer(args, log_path, timeout) as srv: srv.complete(ids, n)`.

    args: llama-server arguments after the binary (model, threads, speculative options); host, port and
    `-np slots` (requests it decodes at once, each in its own slot of the context) are added here. timeout:
    seconds for the start and for each request."""

    def __init__(self, args: list[str], log_path: Path, timeout: float, binary: Path | None = None, slots: int = 1):
        self.binary = binary or llama_server()
        self.port = free_port()
        self.args = [str(self.binary), *map(str, args), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(int(slots))]
        self.log_path = Path(log_path)
        self.timeout = float(timeout)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc: subprocess.Popen | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Own session: stop() kills the whole group, never leaving a server behind.
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                hint = ("; illegal instruction: this build uses an instruction this machine refuses (built on "
                        "another CPU, or by a build_llamacpp.sh older than its no-AMX build, whose AMX kernels die "
                        "on quantized weights): rebuild with `make llamacpp`, or serve with -nr (--no-repack, eval "
                        "key serve_llamacpp_no_repack=true)") if rc in (-4, 132) else ""
                self._fail(f"llama-server exited with code {rc} while starting{hint}")
            try:
                status, _ = self._request("GET", "/health", None, timeout=5)
                if status == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        self._fail(f"llama-server did not become healthy within {self.timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if self.proc is not None:
            self._reader.join(5)

    def _pump(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.tail.append(line.rstrip())

    def _fail(self, what: str):
        self.stop()
        raise LlamaCppError(f"{what}; command: {' '.join(self.args)}\nlast lines of its log ({self.log_path}):\n"
                            + "\n".join(self.tail))

    # -- requests -------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw else {})
        finally:
            conn.close()

    def complete(self, input_ids: list[int], n_predict: int, **options) -> dict:
        """Greedy /completion on token ids (sent as ids: no BOS, no template, no re-tokenization).

        Returns the server's JSON: `tokens` (generated ids), `timings` (prompt_n, predicted_n, predicted_ms, and
        draft_n / draft_n_accepted when a draft ran), `stop_type`. cache_prompt is off so every request
        processes its whole prompt (and prompt_n proves the ids arrived as sent)."""
        body = {"prompt": [int(t) for t in input_ids], "n_predict": int(n_predict), "temperature": 0.0,
                "top_k": 1, "cache_prompt": False, "return_tokens": True, "stream": False, **options}
        try:
            status, out = self._request("POST", "/completion", body, timeout=self.timeout)
        except (OSError, http.client.HTTPException) as exc:
            alive = self.proc.poll() is None
            self._fail(f"/completion failed ({type(exc).__name__}: {exc}); the server "
                       + ("is still running (hung past the timeout?)" if alive else
                          f"died with exit code {self.proc.returncode}"))
        if status != 200:
            self._fail(f"/completion answered HTTP {status}: {json.dumps(out)[:500]}")
        return out


def verify_costs(args: list[str], prompts: list[list[int]], widths: list[int], log_path: Path, reps: int = 3,
                 timeout: float = 900.0) -> dict[int, float]:
    """What a verify step of width w costs on the server `args` starts: prompt_ms of a request whose prompt extends
    a cached context by w tokens (cache_prompt on: only those are evaluated), keyed by the number of tokens the
    server says it evaluated (timings.prompt_n), median over prompts x reps."""
    import statistics

    out: dict[int, list[float]] = {}
    with LlamaServer(args, log_path, timeout) as srv:
        for ids in prompts:
            ids = list(ids)
            for _ in range(reps):
                for w in widths:
                    srv.complete(ids, 1, cache_prompt=True)  # the context, cached
                    extra = ids[-w:] if len(ids) >= w else ids[:w]
                    r = srv.complete(ids + extra, 1, cache_prompt=True)["timings"]
                    out.setdefault(int(r["prompt_n"]), []).append(r["prompt_ms"])
    return {w: statistics.median(v) for w, v in sorted(out.items())}
