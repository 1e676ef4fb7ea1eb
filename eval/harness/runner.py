"""`specdraft eval`: one draft (or learning-free method) on one prompt set, with both baselines in the
same run, written as report.json / report.md / samples.jsonl / plots (docs/howto/evaluate.md).

Per prompt, in this order and on the same engine: speculative decoding, own AR decoding (the speed
baseline and the losslessness reference), transformers `generate` (greedy). Every method gets one
untimed warm-up generation first.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from core.hardware import device_name, resolve_device
from core.load import LoadWatch
from core.load import describe as describe_load
from core.paths import CONFIGS as _CONFIGS
from data.sharegpt import PACKAGED_SOURCE
from eval.engine.backends.choice import choose_backend, make_backend
from eval.engine.decoder import autoregressive_generate, eos_ids, speculative_generate
from eval.harness.config import EvalConfig, load_eval_config
from eval.harness.eval_sets import is_heldout
from eval.harness.hf_baseline import hf_generate_timed
from eval.harness.lossless import (
    IDENTICAL,
    classify,
    format_verdict,
    is_exact_dtype,
    measure_tolerance,
    rejudge,
    verdict,
    verify_widths,
)
from eval.harness.prompts import config_prompts
from eval.harness.report import PromptResult, build_report, write_report
from eval.harness.run_dtype import decode_dtypes, export_decode_dtypes, format_dtypes
from eval.harness.suite import load_suite, run_suite
from eval.harness.untuned import probe_clause, untuned_line
from models.registry import learning_free_families

log = logging.getLogger("specdraft.eval")
CONFIGS = _CONFIGS / "eval"


def prompt_result(prompt, gen, tokenizer, matches: bool | None, divergence: dict | None = None) -> PromptResult:
    n_new = len(gen.tokens) - 1  # the prefill's token is not a decode-step token (see eval/engine/decoder.py)
    return PromptResult(
        id=prompt.id, new_tokens=n_new, base_steps=gen.base_steps, decode_time=gen.decode_time,
        prefill_time=gen.prefill_time, draft_time=gen.draft_time, accept_lengths=list(gen.accepted_lengths),
        accepted_per_depth=list(gen.accept_counts), proposed_per_depth=list(gen.proposed_counts),
        matches_greedy=matches, category=prompt.category, prompt=prompt.text,
        output=tokenizer.decode(gen.tokens), tokens=list(gen.tokens), divergence=divergence)


def tie_tolerance(cfg: EvalConfig, backend, model, prompts: list, max_nodes: int = 64) -> tuple[float | None, dict]:
    """The bf16/fp16 rounding tolerance for the tie-aware losslessness check (eval/harness/lossless.py), measured
    on this base + dtype + device over the first cfg.tie_prompts prompts, at every verify width a tree of up to
    `max_nodes` nodes runs at (the drafter's max_nodes; 64 covers every static tree); 0 in fp32 (exact
    verdict); None when the run has no greedy plain-decoding reference."""
    if not cfg.ar_baseline or cfg.temperature > 0:
        return None, {}
    dtype = next(model.parameters()).dtype
    if is_exact_dtype(dtype) or cfg.tie_prompts == 0:
        return 0.0, {"exact_dtype": is_exact_dtype(dtype)}
    m = measure_tolerance(backend, [p.input_ids for p in prompts[: cfg.tie_prompts]],
                          new_tokens=min(32, cfg.max_new_tokens), widths=verify_widths(max_nodes))
    return m["tolerance"], m


def redecode_fp32(cfg: EvalConfig, prompts: list, divs: list, results: list, twin) -> dict:
    """Judge every prompt whose low-precision output differed from plain decoding by an exact re-decode
    (eval/harness/lossless.py: rejudge): `twin()` gives (the base in fp32 on the same device, the same drafter on
    it: same draft, tree, options); per differing prompt, speculative and plain decoding again, same length.
    Updates divs[i] and results[i].divergence in place; returns what the report records (how many, seconds, or
    why it did not run). Untimed: the speed figures are the low-precision run's."""
    flagged = [i for i, d in enumerate(divs) if d.kind != IDENTICAL]
    if not flagged:
        return {}
    if not cfg.redecode_fp32:
        return {"fp32_redecode": "off (redecode_fp32=false): differing prompts judged by the measured tolerance"}
    if twin is None:
        return {"fp32_redecode": "not available for this run: differing prompts judged by the measured tolerance"}
    t0 = time.perf_counter()
    try:
        base32, drafter32 = twin()
    except (RuntimeError, ValueError, OSError) as err:  # e.g. no memory for an fp32 copy of a large base
        log.warning("fp32 re-decode unavailable (%s): differing prompts judged by the measured tolerance", err)
        return {"fp32_redecode": f"failed to load the fp32 twin: {err}"}
    backend = make_backend(cfg.backend, base32.model)
    eos = eos_ids(base32.model, base32.tokenizer)
    for i in tqdm(flagged, desc="fp32 re-decode of differing prompts", unit="prompt", dynamic_ncols=True):
        ids = prompts[i].input_ids
        s = speculative_generate(backend, drafter32, ids, max_new_tokens=cfg.max_new_tokens, eos_ids=eos,
                                 acceptance=cfg.acceptance, temperature=0.0)
        a = autoregressive_generate(backend, ids, max_new_tokens=cfg.max_new_tokens, eos_ids=eos, record_top2=True,
                                    temperature=0.0)
        divs[i] = rejudge(divs[i], s.tokens, a.tokens, a.top2_gaps, a.runner_up, a.near_ties)
        results[i].divergence = divs[i].to_dict()
    del base32, drafter32, backend
    return {"fp32_redecode": {"prompts": len(flagged), "seconds": time.perf_counter() - t0}}


def lossless_extra(divergences: list, tolerance: float | None, measured: dict) -> dict:
    """The report's extra keys of the tie-aware verdict (counts, tolerance, how it was measured)."""
    if not divergences:
        return {}
    return {**verdict(divergences, tolerance), "tie_tolerance_measure": measured}


def evaluate(cfg: EvalConfig, base, drafter, method: str, out_dir: Path, info: dict | None = None,
             fp32_twin=None) -> dict:
    """Run `drafter` on cfg's prompts with `base` (a models.base.LoadedBase); write and return the report.
    fp32_twin: () -> (base, drafter) in fp32 on the same device, the same draft and shape; in bf16 / fp16 every
    prompt that differs from plain decoding is re-decoded with it (redecode_fp32), the verdict's judge."""
    model, tok = base.model, base.tokenizer
    device = next(model.parameters()).device
    backend = make_backend(cfg.backend, model)
    eos = eos_ids(model, tok)
    prompts = config_prompts(cfg, tok)
    greedy = cfg.temperature == 0
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, generator=gen)

    def spec(ids, n):
        return speculative_generate(backend, drafter, ids, max_new_tokens=n, eos_ids=eos, acceptance=cfg.acceptance,
                                    typical_eps=cfg.typical_eps, typical_delta=cfg.typical_delta, **sampling)

    def ar(ids, n):
        return autoregressive_generate(backend, ids, max_new_tokens=n, eos_ids=eos, record_top2=greedy, **sampling)

    if cfg.warmup_tokens > 0:  # one-off costs (allocator, oneDNN kernels, compile) stay out of the timings
        w = prompts[0].input_ids
        spec(w, cfg.warmup_tokens)
        if cfg.ar_baseline:
            ar(w, cfg.warmup_tokens)
        if cfg.hf_baseline:
            hf_generate_timed(model, w, cfg.warmup_tokens, eos)

    # untimed; seconds (a few short decodes per verify width)
    tol, tol_info = tie_tolerance(cfg, backend, model, prompts, getattr(drafter, "max_nodes", 64))
    results, ar_tokens, ar_time, hf_tokens, hf_time, hf_match, divs = [], 0, 0.0, 0, 0.0, [], []
    # Dynamic-tree drafters (ReDrafter) count tokens before/after prefix sharing; only the timed prompts count.
    packed0, unpacked0 = (getattr(drafter, k, 0) for k in ("total_tokens_packed", "total_tokens_unpacked"))
    t_start = time.perf_counter()
    watch = LoadWatch()  # the load beside the timed loop: a ratio taken above the core count is "loaded"
    tree_nodes = 0  # nodes verified over all timed steps (root included): the verification cost side
    for p in tqdm(prompts, desc=f"eval {method} on {cfg.dataset}", unit="prompt", dynamic_ncols=True):
        s = spec(p.input_ids, cfg.max_new_tokens)
        tree_nodes += s.tree_nodes
        matches, div = None, None
        if cfg.ar_baseline:
            a = ar(p.input_ids, cfg.max_new_tokens)
            ar_tokens += len(a.tokens) - 1
            ar_time += a.decode_time
            matches = (s.tokens == a.tokens) if greedy else None
            if greedy:
                divs.append(classify(s.tokens, a.tokens, a.top2_gaps, a.runner_up, tol, a.near_ties))
                div = divs[-1].to_dict()
        if cfg.hf_baseline and greedy:
            h = hf_generate_timed(model, p.input_ids, cfg.max_new_tokens, eos)
            hf_tokens += len(h.tokens) - 1
            hf_time += h.seconds
            hf_match.append(list(h.tokens) == s.tokens)
        results.append(prompt_result(p, s, tok, matches, div))
    wall = time.perf_counter() - t_start
    load = watch.record()
    low_precision = not is_exact_dtype(next(model.parameters()).dtype)
    redecoded = redecode_fp32(cfg, prompts, divs, results, fp32_twin) if divs and low_precision else {}

    ar_tps = ar_tokens / ar_time if ar_time > 0 else None
    hf_tps = hf_tokens / hf_time if hf_time > 0 else None
    extra = {**run_context(cfg, base, results, tree_nodes), "wall_seconds": wall, "load": load, **redecoded,
             "hf_matches_spec_fraction": (sum(hf_match) / len(hf_match)) if hf_match else None,
             **lossless_extra(divs, tol, tol_info), **(info or {})}
    if hasattr(drafter, "total_tokens_unpacked"):
        packed = drafter.total_tokens_packed - packed0
        unpacked = drafter.total_tokens_unpacked - unpacked0
        extra.update(tokens_verified=packed, tokens_without_prefix_sharing=unpacked,
                     compression_ratio=unpacked / packed if packed else None)
    report = build_report(results, method=method, base_model=base.name, device=device_name(device),
                          dataset=cfg.dataset, ar_tokens_per_second=ar_tps, hf_tokens_per_second=hf_tps,
                          extra=extra)
    steps = [n for r in results for n in r.accept_lengths]
    write_report(out_dir, report, [r.to_sample() for r in results], steps, report["accept_rate_per_position"])
    return report


def run_context(cfg: EvalConfig, base, results: list[PromptResult], tree_nodes: int) -> dict:
    """The report's `extra` keys that describe how a run decoded (shared by `specdraft eval` and `compare`):
    engine, dtype, sampling rule, thread count, base fingerprint, and verified nodes per base step."""
    backend, why = choose_backend(cfg.backend, base.model)
    return {"backend": backend, "backend_reason": why,
            "dtype": str(next(base.model.parameters()).dtype).removeprefix("torch."),
            "acceptance": cfg.acceptance, "temperature": cfg.temperature, "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens, "threads": torch.get_num_threads(),
            "base_fingerprint": base.fingerprint,
            "tree_nodes_per_step": tree_nodes / max(1, sum(r.base_steps for r in results))}


def resolve_heldout_skip(cfg: EvalConfig, export_cfg: dict) -> EvalConfig:
    """For a held-out set (dataset=sharegpt, eval/harness/eval_sets.py), skip exactly the conversations the draft
    was trained on (held-out prompts), and refuse a skip that would evaluate on training data."""
    if not is_heldout(cfg.dataset):
        return cfg
    trained = export_cfg.get("train_data") or {}
    # A self-distilled file (data/self_distill.py) holds the base's answers to the first N ShareGPT prompts.
    trained = trained.get("derived_from") or trained
    if trained.get("source") != PACKAGED_SOURCE:  # trained on another file: its conversations are not ShareGPT's
        return cfg if cfg.heldout_skip is not None else dataclasses.replace(cfg, heldout_skip=0)
    used = trained.get("max_records")
    if used is None:
        raise ValueError("this draft was trained on every ShareGPT conversation (data.max_records=None), so none "
                         "is held out; evaluate on dataset=mtbench, or train with data.max_records=N")
    if cfg.heldout_skip is None:
        return dataclasses.replace(cfg, heldout_skip=used)
    if cfg.heldout_skip < used:
        raise ValueError(f"heldout_skip={cfg.heldout_skip} would evaluate on conversations the draft was trained on "
                         f"(data.max_records={used}); use heldout_skip>={used} or leave it unset")
    return cfg


def eval_export(export_dir: Path, cfg: EvalConfig, shape_probe=None) -> tuple[dict, Path]:
    """Load base + draft from an export (base rebuilt from its config.json) and evaluate it. shape_probe(loaded, cfg,
    export_dir, here) -> {"label", "knobs", ...}: the shape to decode when no tuning.json choice applies here
    (`specdraft eval` passes eval/tune/untuned_probe.py: probe_untuned_shape, which sits above this layer); None or
    untuned_probe=false: the export's default shape."""
    from eval.choice.apply import apply_knobs, ours_here, tuned_eval_config, untuned_speed
    from eval.engine.drafters.registry import build_drafter, drafter_family
    from models.export.load import load_export
    from models.export.specdraft import read_export_config

    export_dir = Path(export_dir)
    suite = load_suite(cfg.suite, cfg.suite_sets) if cfg.suite else None  # a bad name fails before any load
    held = next((s.dataset for s in suite.sets if is_heldout(s.dataset)), None) if suite is not None else None
    if held is not None:
        # the held-out sets (ShareGPT) skip what the draft trained on, as dataset=sharegpt does
        skip = resolve_heldout_skip(dataclasses.replace(cfg, dataset=held), read_export_config(export_dir))
        cfg = dataclasses.replace(cfg, heldout_skip=skip.heldout_skip)
    cfg = resolve_heldout_skip(cfg, read_export_config(export_dir))  # a bad heldout_skip fails before any load
    cfg, dtypes = export_decode_dtypes(cfg, export_dir)  # dtype=fast: the decode probe's dtype on this machine
    print(f"eval: {format_dtypes(dtypes.to_dict())}", flush=True)
    loaded = load_export(export_dir, base_path=cfg.base_path, dtype=cfg.dtype, device=resolve_device(cfg.device),
                         chat_template=cfg.chat_template)
    untuned = untuned_speed(cfg, export_dir, loaded.family)  # the export's default shape: said in the first line
    cfg, tuned = tuned_eval_config(cfg, export_dir, loaded.family)  # the shape `specdraft tune` chose, if any
    if tuned:
        print(f"eval: {tuned}", flush=True)
    probed = None
    if untuned and cfg.untuned_probe and shape_probe is not None:  # not the export's default: a probed shape
        probed = shape_probe(loaded, cfg, export_dir, ours_here(cfg))
        cfg = apply_knobs(cfg, probed["knobs"])
        print(f"eval: no tuning.json choice applies here; decoding {probe_clause(probed)}", flush=True)
    drafter, info = build_drafter(loaded.draft, loaded.config, cfg)
    info["dtypes"] = dtypes.to_dict()
    if tuned:
        info["tuning"] = tuned
    if untuned:
        info["untuned"] = {**untuned, "shape": drafter_family(loaded.family).shape(info)}
        if probed is not None:
            info["untuned"]["probe"] = {k: v for k, v in probed.items() if k != "knobs"}
    device = next(loaded.base.model.parameters()).device

    @functools.cache  # loaded once per eval, and only when some output differs (a suite's sets share it)
    def fp32_twin():  # the same export, tree and options, in fp32 on the same device (the verdict's re-decode)
        twin = load_export(export_dir, base_path=cfg.base_path, dtype="fp32", device=device,
                           chat_template=cfg.chat_template)
        return twin.base, build_drafter(twin.draft, twin.config, cfg)[0]

    if suite is not None:
        out_dir = export_dir.parent / "eval" / f"suite-{suite.name}"
        info = {"export": str(export_dir), **info}
        return run_suite(suite, cfg, loaded.base, drafter, loaded.family, out_dir, info,
                         functools.partial(evaluate, fp32_twin=fp32_twin), cfg.suite_prompts), out_dir
    out_dir = export_dir.parent / "eval" / cfg.name
    report = evaluate(cfg, loaded.base, drafter, loaded.family, out_dir, {"export": str(export_dir), **info},
                      fp32_twin=fp32_twin)
    return report, out_dir


LEARNING_FREE_METHODS = learning_free_families()  # the families declaring FamilyFacts.trainable = False


def eval_method(method: str, cfg: EvalConfig) -> tuple[dict, Path]:
    """A learning-free method (no export): load the base (cfg.base_path, default smollm2), build the
    drafter from cfg.extra, evaluate; writes under <run_dir or runs/<method>>/eval/<name>/."""
    from eval.engine.drafters.registry import build_learning_free, method_options
    from models.base import load_base

    opts = method_options(method, cfg.extra)  # fail on an unknown method or a typo before loading anything
    cfg, dtypes = decode_dtypes(cfg, cfg.base_path or cfg.method_base)  # dtype=fast: the decode probe's dtype
    base = load_base(cfg.base_path or cfg.method_base, dtype=cfg.dtype, device=resolve_device(cfg.device),
                     chat_template=cfg.chat_template or None)
    drafter, info = build_learning_free(method, base, cfg.extra)
    info["dtypes"] = dtypes.to_dict()
    if cfg.prompt_lookup:  # transformers' prompt lookup drafting w tokens per step
        info["prompt_lookup"] = prompt_lookup_peer(cfg, base, int(opts["w"]))
    out_dir = Path(cfg.run_dir or f"runs/{method}") / "eval" / cfg.name
    def fp32_twin():  # the same method and options on the base in fp32 (the verdict's re-decode)
        base32 = load_base(cfg.base_path or cfg.method_base, dtype="fp32", device=next(base.model.parameters()).device,
                           chat_template=cfg.chat_template or None)
        return base32, build_learning_free(method, base32, cfg.extra)[0]

    return evaluate(cfg, base, drafter, method, out_dir, info, fp32_twin=fp32_twin), out_dir


def sweep_method(method: str, cfg: EvalConfig) -> Path:
    """The (k, w) grid of a learning-free method (sweep_k / sweep_w lists): table + heat map
    under <run_dir or runs/<method>>/eval/<name>/sweep/."""
    import importlib
    import importlib.util

    from eval.engine.drafters.registry import method_options
    from models.registry import SPECS

    opts = method_options(method, cfg.extra)
    role = f"{SPECS[method].package}.sweep"  # the family's role module `sweep`, found by its fixed name
    if importlib.util.find_spec(role) is None:
        raise ValueError(f"--method {method!r} has no (k, w) sweep (no role module {role})")
    sweep, write = (getattr(importlib.import_module(role), f) for f in ("sweep", "write"))
    ks = [int(k) for k in cfg.sweep_k or [opts["k"]]]
    ws = [int(w) for w in cfg.sweep_w or [opts["w"]]]
    out_dir = Path(cfg.run_dir or f"runs/{method}") / "eval" / cfg.name / "sweep"
    write(sweep(cfg, ks, ws), ks, ws, out_dir)
    return out_dir


def prompt_lookup_peer(cfg: EvalConfig, base, num_tokens: int) -> dict:
    """transformers' prompt lookup decoding (greedy) on the same prompts: the off-the-shelf n-gram peer.
    Returns its decode tokens/s (prefill excluded, as for every other number in the report)."""
    from eval.harness.hf_baseline import prompt_lookup_generate_timed

    model, tok = base.model, base.tokenizer
    eos = eos_ids(model, tok)
    prompts = config_prompts(cfg, tok)
    if cfg.warmup_tokens > 0:
        prompt_lookup_generate_timed(model, prompts[0].input_ids, cfg.warmup_tokens, eos,
                                     prompt_lookup_num_tokens=num_tokens)
    n_tok, secs = 0, 0.0
    for p in tqdm(prompts, desc="prompt lookup peer", unit="prompt", dynamic_ncols=True):
        g = prompt_lookup_generate_timed(model, p.input_ids, cfg.max_new_tokens, eos,
                                         prompt_lookup_num_tokens=num_tokens)
        n_tok += len(g.tokens) - 1  # same counting as the other methods: the prefill's token is excluded
        secs += g.seconds
    return {"prompt_lookup_num_tokens": num_tokens, "tokens_per_second": n_tok / secs if secs > 0 else None}


def format_summary(report: dict, out_dir: Path) -> str:
    def f(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    ex = report.get("extra") or {}
    load_note = describe_load(ex.get("load"))
    if (ex.get("load") or {}).get("loaded"):
        load_note += "; the ratios shared the CPU: compare them with no target, copy them into no card"
    shape = ""
    if ex.get("tree_nodes_per_step") is not None:  # the verification cost side of the acceptance length
        name = f"tree {ex['tree']}, " if ex.get("tree") not in (None, "custom") else ""
        shape = f" ({name}{ex['tree_nodes_per_step']:.1f} tokens verified per step, root included)"
    first = untuned_line(ex.get("untuned"))
    return ((f"{first}\n" if first else "") +
            f"{report['method']} on {report['dataset']} ({report['num_prompts']} prompts, {report['device']}, "
            f"{ex.get('dtype', '?')}, {ex.get('backend', '?')} backend):\n"
            f"  acceptance length {f(report['acceptance_length'])}{shape}\n"
            f"  {f(report['tokens_per_second'], '.1f')} tok/s"
            f" | own AR {f(report['ar_tokens_per_second'], '.1f')} tok/s | HF generate "
            f"{f(report['hf_tokens_per_second'], '.1f')} tok/s\n"
            f"  speedup {f(report['speedup'])}x vs own AR, {f(report['speedup_vs_hf'])}x vs HF generate "
            f"({load_note})\n"
            f"  {format_verdict(report)}\n" +
            (f"  {format_dtypes(ex['dtypes'])}\n" if ex.get("dtypes") else "") +
            f"  report: {out_dir / 'report.md'}")


def run_eval_cli(args, shape_probe=None) -> int:
    """`specdraft eval`; shape_probe: see eval_export."""
    configs = args.config or [str(CONFIGS / "mtbench.yaml")]
    cfg = load_eval_config(configs, args.overrides)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.method and (cfg.sweep_k or cfg.sweep_w):
        out_dir = sweep_method(args.method, cfg)
        print((out_dir / "sweep.md").read_text() + f"\nwrote {out_dir}/sweep.md, sweep.json, sweep_heatmap.png")
        return 0
    if args.method:
        report, out_dir = eval_method(args.method, cfg)
        print(format_summary(report, out_dir))
        return 0
    if not args.draft:
        raise ValueError("pass --draft runs/<run>/export (a trained export) or --method NAME")
    if getattr(args, "suite", None):
        cfg = dataclasses.replace(cfg, suite=args.suite)
    if cfg.suite:
        load_suite(cfg.suite, cfg.suite_sets)  # an unknown suite or set: one line, before any work
    report, out_dir = eval_export(Path(args.draft), cfg, shape_probe)
    if cfg.suite:
        from eval.harness.suite_report import SUITE_FILES, suite_markdown

        print(suite_markdown(report) + f"\nwrote {out_dir}/{SUITE_FILES['json']}, {SUITE_FILES['md']}, "
              f"{SUITE_FILES['plot']}")
        return 0
    print(format_summary(report, out_dir))
    return 0
