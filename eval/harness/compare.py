"""`specdraft compare`: every draft of configs/compare.yaml on the same prompts, side by side, one process.

Per setting (dataset x acceptance rule) and per prompt, in this order on one loaded base: own AR decoding,
transformers `generate` (greedy settings only; it has no rejection-sampling twin), then every draft. All
methods of a prompt run back to back, so machine noise (other processes, clock changes) hits all of them
alike, and speedups are ratios measured in the same run. Each finished (prompt, method) is appended to
<out>/<setting>/prompts.jsonl at once: a killed run resumes at the first missing pair, nothing is redone.

Passes: every run of a setting is a pass with its own id, stored in each row. A pass that runs a draft on a
prompt times that prompt's baselines again first, and each draft row's speedups are against the baselines of its
own pass. Rows added later (a new draft in the config, a resumed run, `--redo`) are therefore never divided by
an AR timing from another session, when the machine may have run at another speed. `--redo LABEL` runs a
stored row again in the current pass (a killed --redo run keeps what it finished; given --redo again it starts
that row over).

At the end every draft gets a normal report (<out>/<setting>/<label>/report.json, same keys as
`specdraft eval`) whose baselines are the AR / generate numbers of its own pass, then <out>/summary.json and
docs/lab/results.md (eval/harness/results_doc.py) are regenerated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from core.hardware import device_name
from core.jsonl import read_finished_rows
from eval.engine.backends.choice import make_backend
from eval.engine.decoder import autoregressive_generate, eos_ids, speculative_generate
from eval.harness.compare_config import (
    CompareConfig,
    DraftEntry,
    compare_targets,
    draft_entries,
    load_compare_config,
    results_paths,
    searched_tree,
    setting_configs,
    vllm_setting_names,
)
from eval.harness.config import EvalConfig
from eval.harness.eval_sets import is_heldout
from eval.harness.hf_baseline import hf_generate_timed
from eval.harness.lossless import IDENTICAL, classify, format_verdict, is_exact_dtype, rejudge, verify_widths
from eval.harness.prompts import config_prompts
from eval.harness.report import build_report, write_report
from eval.harness.runner import lossless_extra, prompt_result, resolve_heldout_skip, run_context, tie_tolerance

log = logging.getLogger("specdraft.compare")
AR, HF = "ar", "hf"


@dataclasses.dataclass
class Method:
    """One row of a setting: a built drafter and what the report says about it."""

    label: str
    family: str
    drafter: object
    info: dict


def _build_methods(entries: list[DraftEntry], setting: str, ecfg: EvalConfig, base) -> list[Method]:
    """Drafters for the entries that run in `setting` (each with its own per-draft eval overrides)."""
    from eval.engine.drafters.registry import build_drafter, build_learning_free
    from models.export.load import load_export

    out = []
    for e in entries:
        if not e.runs_in(setting):
            continue
        cfg = dataclasses.replace(ecfg, **{k: ({**ecfg.extra, **v} if k == "extra" else v) for k, v in e.eval.items()})
        if e.method is not None:
            drafter, info = build_learning_free(e.method, base, cfg.extra)
            out.append(Method(e.label, e.method, drafter, {**info, **_headline(e)}))
            continue
        if e.tree_nodes is not None:
            cfg = dataclasses.replace(cfg, tree_choices=searched_tree(e.export, e.tree_nodes))
        loaded = load_export(e.export, base=base)
        drafter, info = build_drafter(loaded.draft, loaded.config, cfg)
        info = {"export": str(e.export), **info, **({"tree_search_nodes": e.tree_nodes} if e.tree_nodes else {}),
                **_headline(e)}
        out.append(Method(e.label, loaded.family, drafter, info))
    return out


def _headline(e: DraftEntry) -> dict:
    """The report's `headline` entry ([family name, tree|chain]) for the one-row-per-family table."""
    return {"headline": list(e.headline)} if e.headline else {}


def _heldout_skip(entries: list[DraftEntry], setting: str, ecfg: EvalConfig) -> EvalConfig:
    """sharegpt settings skip every conversation ANY draft compared in this setting trained on (the largest
    skip); a draft kept out of the setting (its `settings` list) has no say, e.g. one trained on all of ShareGPT
    that only runs on MT-bench."""
    from models.export.specdraft import read_export_config

    if not is_heldout(ecfg.dataset):
        return ecfg
    skips = [resolve_heldout_skip(ecfg, read_export_config(e.export)).heldout_skip or 0
             for e in entries if e.export is not None and e.runs_in(setting)]
    return dataclasses.replace(ecfg, heldout_skip=max([ecfg.heldout_skip or 0, *skips]))


class _Store:
    """A setting's stored rows: the latest row per (prompt, method), and the baseline rows of every pass.

    Rows written before passes existed have pass None and pair with each other, as they were measured then."""

    def __init__(self, rows: list[dict]):
        self.done: dict[tuple[str, str], dict] = {}
        self.baselines: dict[tuple[str | None, str, str], dict] = {}
        for row in rows:
            self.add(row)

    def add(self, row: dict) -> None:
        self.done[(row["prompt"], row["method"])] = row
        if row["method"] in (AR, HF):
            self.baselines[(row.get("pass"), row["prompt"], row["method"])] = row

    def paired(self, pid: str, row: dict, baseline: str) -> dict | None:
        """The `baseline` row (AR or HF) timed in the same pass as `row`, else None."""
        return self.baselines.get((row.get("pass"), pid, baseline))


def run_setting(name: str, ecfg: EvalConfig, entries: list[DraftEntry], base, out_dir: Path,
                engine_columns: Callable | None = None, redo: tuple[str, ...] = (),
                fp32_base: Callable | None = None) -> dict:
    """Run (or resume) one setting; returns {label: report} for the drafts plus the baselines' tokens/s.

    engine_columns: runs a serving engine on this setting's prompts afterwards (the CLI passes vLLM's,
    eval/serving/compare_vllm.py; the harness never imports an engine): called as
    engine_columns(name, ecfg, methods, entries, reports, done, prompts, base, out_dir, redo=, this_pass=), its
    result goes under the returned dict's "vllm" key ({"error": message} when the engine could not run).
    redo: labels to run again although stored (with fresh baselines beside them). fp32_base: () -> the base in fp32
    on the same device, for the verdict's re-decode of every low-precision output that differs from plain
    decoding (eval/harness/lossless.py: rejudge)."""
    model, tok = base.model, base.tokenizer
    ecfg = _heldout_skip(entries, name, ecfg)
    methods = _build_methods(entries, name, ecfg, base)
    backend, eos = make_backend(ecfg.backend, model), eos_ids(model, tok)
    prompts = config_prompts(ecfg, tok)
    greedy = ecfg.temperature == 0
    sdir = out_dir / name
    sdir.mkdir(parents=True, exist_ok=True)
    store = sdir / "prompts.jsonl"
    rows = _Store(read_finished_rows(store))
    done = rows.done
    this_pass = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"  # also names files: no colons
    # One generator per method, seeded per prompt, so a resumed run samples what an uninterrupted one would.
    sampling = dict(temperature=ecfg.temperature, top_p=ecfg.top_p)

    def gen_for(label: str, pid: str) -> torch.Generator:
        # zlib.crc32, not hash(): str hashes change per process (PYTHONHASHSEED), crc32 does not.
        return torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{ecfg.seed}/{label}/{pid}".encode()))

    def run_one(label: str, p, n: int):
        if label == AR:
            return autoregressive_generate(backend, p.input_ids, max_new_tokens=n, eos_ids=eos,
                                           generator=gen_for(label, p.id), record_top2=greedy, **sampling)
        if label == HF:
            return hf_generate_timed(model, p.input_ids, n, eos)
        m = next(m for m in methods if m.label == label)
        return speculative_generate(backend, m.drafter, p.input_ids, max_new_tokens=n, eos_ids=eos,
                                    acceptance=ecfg.acceptance, typical_eps=ecfg.typical_eps,
                                    typical_delta=ecfg.typical_delta, generator=gen_for(label, p.id), **sampling)

    baselines = [AR] + ([HF] if greedy and ecfg.hf_baseline else [])
    labels = baselines + [m.label for m in methods]
    todo = []
    for p in prompts:  # a prompt with drafts to run gets its baselines timed again, right before them
        drafts = [m.label for m in methods if (p.id, m.label) not in done or m.label in redo]
        todo += [(p, lab) for lab in baselines if drafts or (p.id, lab) not in done] + [(p, lab) for lab in drafts]
    if todo and ecfg.warmup_tokens > 0:  # one-off costs (allocator, oneDNN kernels) stay out of the timings
        for lab in labels:
            run_one(lab, prompts[0], ecfg.warmup_tokens)
    with store.open("a") as f:
        for p, lab in tqdm(todo, desc=f"compare {name}", unit="run", dynamic_ncols=True):
            t0 = time.perf_counter()
            g = run_one(lab, p, ecfg.max_new_tokens)
            row = {"prompt": p.id, "method": lab, "pass": this_pass, "wall": time.perf_counter() - t0}
            if lab == HF:
                row.update(tokens=list(g.tokens), decode_time=g.seconds, prefill_time=g.prefill_seconds)
            else:
                row.update(tokens=list(g.tokens), decode_time=g.decode_time, prefill_time=g.prefill_time,
                           base_steps=g.base_steps, draft_time=g.draft_time, tree_nodes=g.tree_nodes,
                           accept_lengths=list(g.accepted_lengths), accept_counts=list(g.accept_counts),
                           proposed_counts=list(g.proposed_counts))
                if lab == AR and greedy:  # the tie-aware losslessness evidence (eval/harness/lossless.py)
                    row.update(top2_gaps=g.top2_gaps, runner_up=g.runner_up, near_ties=g.near_ties)
            f.write(json.dumps(row) + "\n")
            f.flush()
            rows.add(row)
    tol = _tolerance(ecfg, backend, model, prompts, sdir)
    redecoded = None
    if greedy and not is_exact_dtype(next(model.parameters()).dtype):
        redecoded = _redecode_fp32(name, ecfg, entries, prompts, methods, rows, sdir, fp32_base)
    out = _write_reports(name, ecfg, prompts, methods, rows, base, sdir, greedy, tol, redecoded)
    if engine_columns is not None:
        out["vllm"] = engine_columns(name, ecfg, methods, entries, out["reports"], done, prompts, base, out_dir,
                                     redo=redo, this_pass=this_pass)
        (sdir / "setting.json").write_text(json.dumps({k: v for k, v in out.items() if k != "reports"}, indent=1))
    return out


def _tolerance(ecfg: EvalConfig, backend, model, prompts, sdir: Path) -> tuple[float | None, dict]:
    """The setting's tie tolerance, measured once and kept in <setting>/tie_tolerance.json (a resumed run
    reuses it, so every report of the setting is judged with the same number). A file measured at other verify
    widths than today's (every width up to 64 nodes; older files measured width 16 only) is measured again."""
    path = sdir / "tie_tolerance.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        measure, want = saved["measure"], list(verify_widths(64))
        if not measure or measure.get("exact_dtype") is not None or measure.get("widths") == want:
            return saved["tolerance"], measure
        print(f"compare: {path} was measured at verify widths {measure.get('widths', [16])}, not {want}: "
              "measuring it again", flush=True)
    tol, info = tie_tolerance(ecfg, backend, model, prompts)
    path.write_text(json.dumps({"tolerance": tol, "measure": info}))
    return tol, info


def _tps(rows: list[dict]) -> float | None:
    secs = sum(r["decode_time"] for r in rows)
    return sum(len(r["tokens"]) - 1 for r in rows) / secs if secs > 0 else None  # prefill token excluded


def _redecode_fp32(name, ecfg, entries, prompts, methods, rows: _Store, sdir: Path, fp32_base) -> dict | str:
    """{(prompt id, label): fp32 re-decode} for every draft output that differs from own AR in this low-precision
    setting, kept in <setting>/fp32_redecode.jsonl (resumable); a string saying why when it cannot run."""
    if not ecfg.redecode_fp32:
        return "off (redecode_fp32=false): differing prompts judged by the measured tolerance"
    if fp32_base is None:
        return "not available for this run: differing prompts judged by the measured tolerance"
    done = rows.done
    path = sdir / "fp32_redecode.jsonl"
    saved = {(r["prompt"], r["method"]): r for r in read_finished_rows(path)}
    todo = [(p, m) for p in prompts for m in methods
            if done[(p.id, m.label)]["tokens"] != done[(p.id, AR)]["tokens"] and (p.id, m.label) not in saved]
    if todo:
        base32 = fp32_base()
        twins = {m.label: m for m in _build_methods(entries, name, ecfg, base32)}
        backend, eos = make_backend(ecfg.backend, base32.model), eos_ids(base32.model, base32.tokenizer)
        plain: dict[str, object] = {}
        with path.open("a") as f:
            for p, m in tqdm(todo, desc=f"compare {name}: fp32 re-decode of differing outputs", unit="run",
                             dynamic_ncols=True):
                if p.id not in plain:
                    plain[p.id] = autoregressive_generate(backend, p.input_ids, max_new_tokens=ecfg.max_new_tokens,
                                                          eos_ids=eos, record_top2=True)
                a = plain[p.id]
                sp = speculative_generate(backend, twins[m.label].drafter, p.input_ids,
                                          max_new_tokens=ecfg.max_new_tokens, eos_ids=eos, acceptance=ecfg.acceptance)
                row = {"prompt": p.id, "method": m.label, "spec": list(sp.tokens), "plain": list(a.tokens),
                       "top2_gaps": a.top2_gaps, "runner_up": a.runner_up, "near_ties": a.near_ties}
                f.write(json.dumps(row) + "\n")
                f.flush()
                saved[(p.id, m.label)] = row
    return saved


def _write_reports(name, ecfg, prompts, methods, rows: _Store, base, sdir, greedy, tol=(None, {}),
                   redecoded: dict | str | None = None) -> dict:
    """Every draft's report from the stored rows. The setting's own AR / generate numbers are each prompt's most
    recent timing; each draft's speedups are against the baselines timed in its own rows' passes (_Store.paired)."""
    tok, done = base.tokenizer, rows.done
    ar_rows = [done[(p.id, AR)] for p in prompts]
    hf_rows = [done[(p.id, HF)] for p in prompts if (p.id, HF) in done]
    ar_tps, hf_tps = _tps(ar_rows), (_tps(hf_rows) if len(hf_rows) == len(prompts) else None)
    # Two plain greedy decoders (own AR, generate) agreeing token for token: the ceiling of "lossless" in this
    # dtype (in bf16 a different kernel or batch shape flips argmax at near-ties; in fp32 it is 1.0).
    ar_hf = (sum(done[(p.id, HF)]["tokens"] == done[(p.id, AR)]["tokens"] for p in prompts) / len(prompts)
             if hf_tps else None)
    out = {"setting": name, "config": dataclasses.asdict(ecfg), "num_prompts": len(prompts),
           "ar_tokens_per_second": ar_tps, "hf_tokens_per_second": hf_tps, "ar_matches_generate_fraction": ar_hf,
           "reports": {}}
    for m in methods:
        results, tree_nodes, divs, pair_ar, pair_hf = [], 0, [], [], []
        for p in prompts:
            r = done[(p.id, m.label)]
            a = rows.paired(p.id, r, AR) or done[(p.id, AR)]  # same tokens in every pass; the timing is its pass's
            pair_ar.append(a)
            pair_hf.append(rows.paired(p.id, r, HF))
            tree_nodes += r["tree_nodes"]
            g = _Gen(r)
            div = None
            if greedy:
                d = classify(r["tokens"], a["tokens"], a.get("top2_gaps"), a.get("runner_up"), tol[0],
                             a.get("near_ties"))
                z = redecoded.get((p.id, m.label)) if isinstance(redecoded, dict) else None
                if z is not None and d.kind != IDENTICAL:  # the judge: the same output decoded again in fp32
                    d = rejudge(d, z["spec"], z["plain"], z["top2_gaps"], z["runner_up"], z["near_ties"])
                divs.append(d)
                div = divs[-1].to_dict()
            results.append(prompt_result(p, g, tok, (r["tokens"] == a["tokens"]) if greedy else None, div))
        extra = {"label": m.label, "setting": name, **run_context(ecfg, base, results, tree_nodes),
                 "heldout_skip": ecfg.heldout_skip,
                 "hf_matches_spec_fraction": (sum(done[(p.id, HF)]["tokens"] == done[(p.id, m.label)]["tokens"]
                                                  for p in prompts) / len(prompts)) if hf_tps else None,
                 **lossless_extra(divs, *tol), **m.info,
                 **({"fp32_redecode": redecoded} if isinstance(redecoded, str) and divs and
                    any(d.kind != IDENTICAL for d in divs) else {})}
        extra["baseline_passes"] = sorted({str(r.get("pass")) for r in pair_ar})
        m_hf = _tps(pair_hf) if hf_tps and all(pair_hf) else None
        report = build_report(results, method=m.family, base_model=base.name,
                              device=device_name(next(base.model.parameters()).device), dataset=ecfg.dataset,
                              ar_tokens_per_second=_tps(pair_ar), hf_tokens_per_second=m_hf, extra=extra)
        steps = [n for r in results for n in r.accept_lengths]
        write_report(sdir / m.label, report, [r.to_sample() for r in results], steps,
                     report["accept_rate_per_position"])
        out["reports"][m.label] = report
    (sdir / "setting.json").write_text(json.dumps({k: v for k, v in out.items() if k != "reports"}, indent=1))
    return out


class _Gen:
    """A stored prompts.jsonl row seen through the decoder's result interface (what eval.harness.runner.prompt_result
    reads)."""

    def __init__(self, row: dict):
        self.tokens = row["tokens"]
        self.base_steps, self.decode_time = row["base_steps"], row["decode_time"]
        self.prefill_time, self.draft_time = row["prefill_time"], row["draft_time"]
        self.accepted_lengths = row["accept_lengths"]
        self.accept_counts, self.proposed_counts = row["accept_counts"], row["proposed_counts"]


def run_compare(cfg: CompareConfig, engine_columns: Callable[[CompareConfig], Callable] | None = None,
                field_rows: Callable[..., dict] | None = None) -> dict:
    """Every setting of `cfg`, resumable. engine_columns(cfg) gives the per-setting serving-engine runner (see
    run_setting) for the settings that ask for vLLM columns; without it such a config is refused. field_rows
    (eval/field/compare.py: judge_rows, handed down by the CLI) judges the rows on `field_refs`' stored answers."""
    from core.hardware import resolve_device
    from models.base import load_base

    settings = setting_configs(cfg)
    entries = draft_entries(cfg, list(settings))
    unknown = sorted(set(cfg.redo) - {e.label for e in entries})
    if unknown:
        raise ValueError(f"redo / --redo {unknown}: no such draft label; labels: {[e.label for e in entries]}")
    with_vllm = vllm_setting_names(cfg, settings)
    if with_vllm and engine_columns is None:
        raise ValueError(f"settings {sorted(with_vllm)} ask for vLLM columns, which need the serving layer: run them "
                         "through `specdraft compare`")
    columns = engine_columns(cfg) if with_vllm else None
    if cfg.field_refs and field_rows is None:
        raise ValueError("field_refs asks for the field benchmark's column, which sits above the harness: run it "
                         "through `specdraft compare`")
    dtypes = {(c.dtype, c.backend, c.device) for c in settings.values()}
    if len(dtypes) != 1:
        raise ValueError(f"every setting must use one base dtype/backend/device (loaded once), got {sorted(dtypes)}")
    dtype, _, device = dtypes.pop()
    base = load_base(cfg.base_path, dtype=dtype, device=resolve_device(device))
    twin: list = []  # the fp32 base, loaded once, only when a low-precision output differs from plain decoding

    def fp32_base():
        if not twin:
            twin.append(load_base(cfg.base_path, dtype="fp32", device=resolve_device(device)))
        return twin[0]

    out_dir = Path(cfg.out_dir)
    summary = {"base": base.name, "base_fingerprint": base.fingerprint, "settings": {}}
    for name, ecfg in settings.items():
        res = run_setting(name, ecfg, entries, base, out_dir, columns if name in with_vllm else None, tuple(cfg.redo),
                          fp32_base=fp32_base)
        res["base_dtype"] = str(base.model.dtype).removeprefix("torch.")  # what dtype "fast"/"auto" resolved to
        summary["settings"][name] = res
        for label, v in (res.get("vllm") or {}).get("drafts", {}).items():
            if "error" in v:
                print(f"[{name}] vLLM + {label}: could not run: {v['error']}", flush=True)
                continue
            print(f"[{name}] vLLM + {label}: acceptance length {v['acceptance_length']:.2f}, "
                  f"{v['speedup_vs_vllm_ar'] or float('nan'):.2f}x vs vLLM AR | acceptance vs ours: "
                  f"{'agrees' if v['acceptance_check']['ok'] else 'DIFFERS'} (max |diff| "
                  f"{v['acceptance_check']['max_abs_diff']:.3f})", flush=True)
        log.info("setting %s done: %s", name, {k: round(r["acceptance_length"], 2) for k, r in res["reports"].items()})
        for label, r in res["reports"].items():
            print(f"[{name}] {label}: acceptance length {r['acceptance_length']:.2f}, speedup "
                  f"{r['speedup'] or float('nan'):.2f}x vs own AR | {format_verdict(r)}", flush=True)
        # after every setting, so the tables can be regenerated (--results-only) from a partial run
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if cfg.field_refs:  # every row's exact simulated acceptance on the stored answers, beside the decoded tables
        summary["field"] = field_rows(cfg, settings, entries, out_dir)
        for label, row in summary["field"].items():
            print(f"[field] {label}: simulated acceptance length {row['mean_over_sets']:.3f} (mean over "
                  f"{len(row['sets'])} sets, {row['prompts']} prompts)", flush=True)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def run_compare_cli(args, engine_columns: Callable[[CompareConfig], Callable] | None = None,
                    field_rows: Callable[..., dict] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configs = args.config or ["configs/compare.yaml"]
    cfg = load_compare_config(configs, args.overrides)
    if args.redo and args.results_only:
        raise ValueError("--redo runs rows again and --results-only runs nothing: give one of them")
    if args.only and sorted(set(args.redo) - set(args.only)):
        raise ValueError(f"--redo {sorted(set(args.redo) - set(args.only))}: not among the --only rows {args.only}")
    if args.only:  # rerun some rows: same prompts, same settings, fresh baselines in the same run
        labels = [d.get("label") for d in [*cfg.drafts, *cfg.extra_drafts]]
        if sorted(set(args.only) - set(labels)):
            raise ValueError(f"--only {sorted(set(args.only) - set(labels))}: no such draft label; labels: {labels}")
        cfg.drafts = [d for d in cfg.drafts if d.get("label") in args.only]
        cfg.extra_drafts = [d for d in cfg.extra_drafts if d.get("label") in args.only]
    cfg.redo = [*cfg.redo, *args.redo]
    summary = None if args.results_only else run_compare(cfg, engine_columns, field_rows)
    from eval.harness.results_doc import write_results

    md_path, img_prefix = results_paths(cfg, getattr(args, "update_docs", False))
    md = write_results(Path(cfg.out_dir), md_path, img_prefix, " --config ".join(configs), cfg.results_section,
                       cfg.results_training_title, compare_targets(cfg))
    print(f"wrote {md}")
    # vLLM that could not run, or disagrees with our decoder on acceptance: the tables are written, the exit is not 0
    bad = []
    for name, st in (summary or {}).get("settings", {}).items():
        v = st.get("vllm")
        if v and "error" in v:
            bad.append(f"{name}: {v['error']}")
        elif v:
            bad += [f"{name}: {k}: {d['error']}" if "error" in d else f"{name}: {k} acceptance differs from ours"
                    for k, d in v["drafts"].items() if "error" in d or not d["acceptance_check"]["ok"]]
    for line in bad:
        print(f"specdraft compare: vLLM columns: {line}", file=sys.stderr)
    return 1 if bad else 0
