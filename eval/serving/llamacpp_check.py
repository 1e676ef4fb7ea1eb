"""llama.cpp beside our decoder in `specdraft serve-check --engine llamacpp` (docs/howto/serve.md).

On the GGUFs of the base our decoder ran (serve_llamacpp_base_type, default f32: token-exact with our fp32
decoder) and of the draft (serve_llamacpp_draft_type), one llama-server per run, batch 1 (-np 1), greedy:
  llamacpp_ar     the base alone
  llamacpp_draft  + the draft, --spec-type = its family's (draft-eagle3, draft-dflash), --spec-draft-n-max = the
                  chain our row ran (EAGLE-3: its ttt_steps; DFlash: block_size - 1, the whole block)
  llamacpp_ngram  llama.cpp's learning-free ngram-simple (n = serve_ngram_q, m = the n-gram row length)
Prompts are our own token ids (the eval config's prompts rendered with our chat template), sent as ids: the
server adds no BOS and does no tokenization, and each response's timings.prompt_n is checked against the id
count. Each run has one untimed warm-up request. The draft's mean acceptance (accepted / drafted tokens; llama.cpp
has no per-position counters) is compared with ours, and llama.cpp + draft must reproduce llama.cpp AR exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eval.serving.llamacpp_gguf import base_gguf, draft_gguf, serve_args, spec_draft_n_max
from eval.serving.llamacpp_paths import LLAMACPP_PIN, llama_server
from eval.serving.llamacpp_server import LlamaServer, runtime_args
from eval.serving.serve_check_report import (
    agreement,
    compare_mean_acceptance,
    llamacpp_engine_numbers,
    outputs_identical,
)


@dataclasses.dataclass
class LlamaCppJob:
    """What every llama.cpp run of one serve-check shares."""

    prompts: list  # eval.harness.prompts Prompt objects (id, input_ids)
    max_new_tokens: int
    warmup_tokens: int
    threads: int
    no_repack: bool  # -nr (serve_llamacpp_no_repack)
    ctx: int  # -c: the longest prompt + new tokens + the draft's depth + slack
    workdir: Path
    timeout: float


def run_llamacpp(job: LlamaCppJob, label: str, server_args: list[str]) -> dict:
    """One llama-server over every prompt; the raw per-prompt results (tokens, timings)."""
    server_args = [str(a) for a in server_args]
    args = runtime_args(server_args, job.threads, job.ctx, job.no_repack)
    print(f"[serve-check] {label}: llama-server {' '.join(server_args)}", flush=True)
    results = []
    with LlamaServer(args, job.workdir / f"{label}.log", job.timeout) as srv:
        if job.warmup_tokens > 0:  # one-off costs (allocation, repacking) stay out of the timings
            srv.complete(job.prompts[0].input_ids, job.warmup_tokens)
        for i, p in enumerate(job.prompts):
            print(f"[serve-check] {label}: prompt {i + 1}/{len(job.prompts)} {p.id}", flush=True)
            out = srv.complete(p.input_ids, job.max_new_tokens)
            results.append({"id": p.id, "tokens": list(out.get("tokens") or []), "timings": out["timings"],
                            "prompt_len": len(p.input_ids), "stop_type": out.get("stop_type")})
    return {"label": label, "results": results, "server_args": args}


def llamacpp_side(plan, job: LlamaCppJob, cfg, ours: dict, tolerance: float) -> tuple[dict, dict]:
    """Every llama.cpp run of a serve-check plan -> (engine numbers by label, the report's "llamacpp" section)."""
    from models.registry import llamacpp_families

    llama_server()  # fail before converting anything when llama.cpp is not built
    base_file = base_gguf(plan.base, plan.base_dir, cfg.serve_llamacpp_base_type)
    draft_file = None
    servable = plan.draft_model is not None and plan.name in llamacpp_families()
    if servable:
        draft_file = draft_gguf(plan.draft_model, plan.export_cfg, plan.base_dir, job.workdir / "draft.gguf",
                                cfg.serve_llamacpp_draft_type)
    engines = {"llamacpp_ar": llamacpp_engine_numbers(run_llamacpp(job, "llamacpp_ar", ["-m", base_file]))}
    if draft_file is not None:
        n_max = spec_draft_n_max(plan.draft_model, plan.name, plan.depth)
        if n_max != plan.depth:  # llama.cpp would draft another chain than the one our row ran
            raise ValueError(f"our {plan.compared} is not what llama.cpp drafts for this {plan.name} draft "
                             f"(--spec-draft-n-max {n_max}); serve-check compares equal chains")
        args = serve_args(str(base_file), str(draft_file), plan.name, n_max)
        engines["llamacpp_draft"] = llamacpp_engine_numbers(run_llamacpp(job, "llamacpp_draft", args))
    w = cfg.serve_ngram_w or plan.depth
    ngram_args = ["-m", base_file, "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(cfg.serve_ngram_q),
                  "--spec-ngram-simple-size-m", str(w), "--spec-draft-n-max", str(w)]
    engines["llamacpp_ngram"] = llamacpp_engine_numbers(run_llamacpp(job, "llamacpp_ngram", ngram_args))

    section = {"pin": LLAMACPP_PIN, "base_gguf": str(base_file), "base_type": cfg.serve_llamacpp_base_type,
               "draft_gguf": str(draft_file) if draft_file else None,
               "draft_type": cfg.serve_llamacpp_draft_type if draft_file else None, "threads": job.threads,
               "prompt_tokens_as_sent": all(e["prompt_tokens_as_sent"] for e in engines.values()),
               "ngram": {"size_n": cfg.serve_ngram_q, "size_m": w}, "check": None, "identical": None,
               "compared": plan.compared,
               "note": ("llama.cpp's ngram-simple (the LATEST earlier match of the last n tokens) is not our "
                        "n-gram rule, so its acceptance is shown, not checked")}
    ar_out = engines["llamacpp_ar"]["outputs"]
    if "llamacpp_draft" in engines:
        section["check"] = compare_mean_acceptance(engines["llamacpp_draft"]["mean_accept_rate"],
                                                   ours.get("mean_accept_rate"), tolerance)
        section["identical"] = outputs_identical(ar_out, engines["llamacpp_draft"]["outputs"])
    else:
        section["note"] += (f"; llama.cpp cannot serve a {plan.name} draft (it serves "
                            f"{', '.join(llamacpp_families())}), so only its AR and n-gram run")
    section["ngram_identical"] = outputs_identical(ar_out, engines["llamacpp_ngram"]["outputs"])
    # Ours (greedy, lossless: = our AR) against llama.cpp AR: identical with f32 GGUFs and our fp32 decoder.
    section["ours_agreement"] = agreement(ar_out, ours.get("outputs") or {})
    return engines, section
