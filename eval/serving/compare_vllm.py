"""The vLLM columns of `specdraft compare`: vLLM serves the same drafts on the same prompts.

For every setting named in `vllm_settings` (greedy), after our decoder has run it:
1. vLLM AR on the setting's prompts (token ids as our decoder saw them), batch 1, the compare's dtype.
2. For every draft entry with `vllm: true`: vLLM + that draft, drafting the same chain as our row (Medusa: top-1
   of each head; EAGLE-3: its chain mode; N-gram: one prompt-lookup row, our strategy=longest_match). The row's
   chain length becomes vLLM's num_speculative_tokens, so both engines run the same draft shape.
3. Per-position acceptance of vLLM against our row (per draft made, as vLLM counts: eval/serving/serve_check_report.py)
   must agree within `vllm_tolerance`; a mismatch is a format or semantics bug, reported, never hidden.

Each engine runs in a subprocess of .venv-vllm (eval/serve_check.run_engine; the main package never imports
vllm). Results are kept in <out>/<setting>/vllm/<engine>.result.json: a resumed compare reruns only the missing
engines. A pass that starts a draft engine runs vLLM AR again just before the first one (vllm_ar-<pass>.result.json,
or vllm_ar.result.json when no AR ran before), and each draft result names the AR run it is timed against
("paired_ar", written by the runner with the result), so a draft added in a later session is never divided by an
AR timing from another session. The setting's summary gets a "vllm" entry that eval/harness/results_doc.py turns
into the vLLM table.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from eval.engine.drafters.registry import drafter_family
from models.registry import family_facts, vllm_families

log = logging.getLogger("specdraft.compare")
def num_speculative_tokens(family: str, info: dict, drafter) -> int:
    """Drafted tokens per step of a row shaped like vLLM's draft (a chain of top-1 tokens, as the family declares
    it), or a ValueError saying how to make it one."""
    if family not in vllm_families():
        raise ValueError(f"vLLM 0.32 has no method for a {family} draft (it serves {', '.join(vllm_families())}); "
                         "drop `vllm: true` from this row")
    return drafter_family(family).num_speculative_tokens(info, drafter)


def speculative_config(entry, family: str, info: dict, depth: int, base, base_dir: Path, workdir: Path
                       ) -> tuple[dict, dict]:
    """vLLM's speculative_config for a compare row and the further engine arguments its export needs; a trained
    draft is exported once to workdir/export-<label> and must have been trained on the base in base_dir (the
    directory vLLM serves)."""
    from eval.serving.serve_check import check_fingerprint
    from models.export.formats import export_vllm
    from models.export.load import load_export
    from models.export.specdraft import read_export_config
    from models.export.vllm import (
        SPECULATIVE_CONFIG_FILE,
        read_engine_args,
        read_speculative_config,
        untuned,
        vllm_ngram_config,
    )

    if not family_facts(family).trainable:  # learning-free: no export, the method's options are its config
        return vllm_ngram_config({"w": depth, "q": info["q"], "q_min": info["q_min"]}), {}
    out = workdir / f"export-{entry.label}"
    if not (out / SPECULATIVE_CONFIG_FILE).is_file():
        loaded = load_export(entry.export, base=base)
        # The row's chain is `depth` at one request: tune's count and per-batch-size schedule (a shipped draft's
        # config.json may carry both) would change what vLLM drafts and part it from our decoder's row. fp32 files,
        # whatever the run dtype.
        export_vllm(loaded.draft.float(), out, untuned(loaded.config), loaded.view)
    check_fingerprint(read_export_config(entry.export), base_dir, str(entry.export))
    return {**read_speculative_config(out), "num_speculative_tokens": depth}, read_engine_args(out)


def _cached(path: Path, prompt_ids: list[str]) -> dict | None:
    """A finished engine result for exactly these prompts, else None (a changed prompt set reruns it)."""
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if result.get("error") or [r["id"] for r in result.get("results", [])] != prompt_ids:
        return None
    return result


def run_vllm_setting(name: str, ecfg, methods: list, entries: list, reports: dict, done: dict, prompts: list,
                     base, out_dir: Path, *, timeout: float, tolerance: float, enforce_eager: bool = False,
                     this_pass: str, redo: tuple[str, ...] = ()) -> dict:
    """vLLM AR + every `vllm: true` row of one setting; returns the setting's "vllm" summary entry.

    methods: eval.harness.compare.Method rows built for this setting; reports: {label: our report}; done: the setting's
    stored (prompt, method) rows (our AR and draft outputs); redo: labels whose engines run again although
    stored; this_pass: the compare pass's id (names a freshly timed vLLM AR)."""
    import torch

    from eval.engine.decoder import eos_ids
    from eval.serving.serve_check import DTYPES, ServeCheckError, base_hf_dir, run_engine, vllm_python
    from eval.serving.serve_check_report import agreement, compare_acceptance, our_engine_numbers, vllm_engine_numbers

    vllm_python()  # a missing venv fails before any export or engine work, with `make vllm` in the message
    workdir = (out_dir / name / "vllm").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    base_dir = base_hf_dir(base, workdir)  # once: for the tiny base this saves the model to workdir
    by_label = {m.label: m for m in methods}
    rows = [e for e in entries if e.vllm and e.label in by_label]
    plans = []
    for e in rows:
        m = by_label[e.label]
        try:
            depth = num_speculative_tokens(m.family, m.info, m.drafter)
        except ValueError as exc:
            raise ValueError(f"compare row {e.label!r} has `vllm: true` but {exc}") from None
        plans.append((e, m, depth, *speculative_config(e, m.family, m.info, depth, base, base_dir, workdir)))

    dtype = DTYPES[next(base.model.parameters()).dtype]
    longest = max(len(p.input_ids) for p in prompts)
    depth_max = max([d for _, _, d, _, _ in plans] or [0])
    job = {"base_dir": str(base_dir), "dtype": dtype, "max_new_tokens": ecfg.max_new_tokens,
           "warmup_tokens": ecfg.warmup_tokens, "stop_token_ids": eos_ids(base.model, base.tokenizer),
           "prompts": [{"id": p.id, "input_ids": list(p.input_ids)} for p in prompts],
           "max_model_len": longest + ecfg.max_new_tokens + depth_max + 16, "seed": ecfg.seed,
           "enforce_eager": enforce_eager}
    ids = [p.id for p in prompts]

    def engine(label: str, spec: dict | None, engine_args: dict | None = None, paired_ar: str | None = None) -> dict:
        print(f"[compare {name}] vLLM engine {label} on {len(prompts)} prompts", flush=True)
        return run_engine({**job, "label": label, "speculative_config": spec, "engine_args": engine_args,
                           "paired_ar": paired_ar}, workdir, timeout)

    # Every stored vLLM AR run of these prompts, by label; this pass's own run joins it once a draft engine needs it.
    ar_results = {p.name.removesuffix(".result.json"): r for p in workdir.glob("vllm_ar*.result.json")
                  if (r := _cached(p, ids)) is not None}
    fresh_ar: list[str] = []

    def this_pass_ar() -> str:
        """Runs vLLM AR in this pass (once, right before the first draft engine that starts); its label."""
        if not fresh_ar:
            label = f"vllm_ar-{this_pass}" if ar_results else "vllm_ar"
            ar_results[label] = engine(label, None)
            fresh_ar.append(label)
        return fresh_ar[0]

    results = {}
    for e, _, _, spec, engine_args in plans:
        results[e.label] = None if e.label in redo else _cached(workdir / f"vllm-{e.label}.result.json", ids)
        if results[e.label] is not None:
            continue
        ar_run = this_pass_ar()  # vLLM AR that cannot run fails the setting's vLLM columns (compare.py says why)
        try:
            results[e.label] = engine(f"vllm-{e.label}", spec, engine_args, paired_ar=ar_run)
        except ServeCheckError as exc:  # one draft vLLM cannot load: the others still run, the table says why
            log.error("vLLM + %s (%s): %s", e.label, name, exc)
            results[e.label] = exc
    # The setting's vLLM AR figure: this pass's run, else the latest stored one (pass ids start with the time).
    if not ar_results:
        this_pass_ar()
    ar_label = fresh_ar[0] if fresh_ar else max(ar_results, key=lambda lab: "" if lab == "vllm_ar" else lab)
    ar_result = ar_results[ar_label]
    ar = vllm_engine_numbers(ar_result)
    our_ar = {p.id: list(done[(p.id, "ar")]["tokens"]) for p in prompts}
    out = {"vllm_version": ar_result.get("vllm_version"), "dtype": dtype, "num_prompts": len(prompts),
           "threads": torch.get_num_threads(), "tolerance": tolerance,
           "ar": {"run": ar_label, "tokens_per_second": ar["tokens_per_second"], "timing": ar["timing"],
                  "agreement_with_our_ar": agreement(ar["outputs"], our_ar)},
           "drafts": {}}
    for e, m, depth, spec, engine_args in plans:
        result = results[e.label]
        if isinstance(result, ServeCheckError):
            out["drafts"][e.label] = {"family": m.family, "depth": depth, "speculative_config": spec,
                                      "engine_args": engine_args, "error": str(result).splitlines()[0]}
            continue
        v = vllm_engine_numbers(result)
        samples = [{"id": p.id, "tokens": done[(p.id, e.label)]["tokens"]} for p in prompts]
        ours = our_engine_numbers(reports[e.label], samples, ar=False)
        acc = compare_acceptance(v["accept_rate_per_position"], ours["accept_rate_per_position"], tolerance)
        tps = v["tokens_per_second"]
        ar_run = result.get("paired_ar") or "vllm_ar"  # results from before pairing: the one AR run there was
        if ar_run in ar_results:
            d_ar = vllm_engine_numbers(ar_results[ar_run])
        else:  # its pass's AR result is gone (deleted by hand): the latest, and the table names it
            ar_run, d_ar = ar_label, ar
        out["drafts"][e.label] = {
            "family": m.family, "depth": depth, "speculative_config": spec, "engine_args": engine_args,
            "acceptance_length": v["acceptance_length"], "accept_rate_per_position": v["accept_rate_per_position"],
            "tokens_per_second": tps, "num_drafts": v["num_drafts"],
            "speedup_vs_vllm_ar": tps / d_ar["tokens_per_second"] if tps and d_ar["tokens_per_second"] else None,
            "vllm_ar_tokens_per_second": d_ar["tokens_per_second"],
            "vllm_ar_run": ar_run,
            "agreement_with_vllm_ar": agreement(d_ar["outputs"], v["outputs"]),
            "ours_acceptance_length": ours["acceptance_length"],
            "ours_accept_rate_per_position": ours["accept_rate_per_position"],
            "acceptance_check": acc}
        if not acc["ok"]:
            log.error("vLLM and our decoder disagree on %s (%s): per-position acceptance %s vs %s", e.label, name,
                      acc["vllm"], acc["ours"])
    (workdir / "vllm.json").write_text(json.dumps(out, indent=1))
    return out


def vllm_columns(cfg) -> Callable:
    """The per-setting runner `specdraft compare` hands the harness (eval.harness.compare.run_setting's
    engine_columns) for a CompareConfig: vLLM with the config's timeout, tolerance and eager flag; an engine that
    cannot run becomes {"error": message}, so our own rows and tables are kept and say why the vLLM columns are
    missing."""
    from eval.serving.serve_check import ServeCheckError

    def run(name, ecfg, methods, entries, reports, done, prompts, base, out_dir, *, redo, this_pass) -> dict:
        try:
            return run_vllm_setting(name, ecfg, methods, entries, reports, done, prompts, base, out_dir,
                                    timeout=cfg.vllm_timeout, tolerance=cfg.vllm_tolerance,
                                    enforce_eager=cfg.vllm_enforce_eager, redo=redo, this_pass=this_pass)
        except ServeCheckError as exc:
            log.error("vLLM columns of %s: %s", name, exc)
            return {"error": str(exc)}

    return run
