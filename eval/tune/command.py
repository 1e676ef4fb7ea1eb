"""`specdraft tune`: the fastest speculation setting of a draft on each engine, measured against that engine's AR
in the same run, written into the export (docs/howto/serve.md, "Tune").

    specdraft tune --draft runs/<run>/export [--engine ours|vllm|llamacpp|all] [--prompts mtbench|sharegpt|X.jsonl]
                   [--budget-minutes N] [--num-prompts N] [--max-new-tokens N] [--repeats N] [--threads N]
                   [--alpha A] [--min-gain G] [--concurrency 1,2,4,8]
                   [--field-refs DIR] [--field-prompts N] [--field-all]

Our decoder (eval/tune/ours.py) and the serving engines (eval/tune/serving.py) go to the engine-agnostic sweep
(eval/tune/sweep.py, eval/tune/concurrency.py); our decoder's acceptance side is then read from the field benchmark
where stored answers for the base exist (eval/tune/field.py); outputs by eval/tune/report.py. cli/main.py adds this
parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from core.load import LoadWatch
from eval.choice.record import MIN_REPEATS
from eval.choice.stats import DEFAULT_ALPHA, DEFAULT_MIN_GAIN
from eval.tune.field import DEFAULT_FIELD_PROMPTS
from eval.tune.sweep import DEFAULT_REPEATS, BudgetTooSmall, EngineUnavailable, check_budget

ENGINE_CHOICES = ("ours", "vllm", "llamacpp", "all")


def add_tune_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("tune", help="sweep each engine's speculation settings against its own AR and write the "
                       "fastest (or 'do not speculate') into the export")
    p.add_argument("--draft", required=True, help="an export directory (runs/<run>/export)")
    p.add_argument("--engine", default="ours", choices=ENGINE_CHOICES,
                   help="ours (our decoder), vllm (.venv-vllm, `make vllm`), llamacpp (`make llamacpp`), all")
    p.add_argument("--prompts", default=None, help="mtbench, sharegpt (held out) or a .jsonl of prompts (default: "
                   "the eval config's dataset)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per pass (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="paired AR / setting passes per setting, "
                   f"and of the winner's confirmation (at least {MIN_REPEATS}: the noise is measured from them; "
                   f"default {DEFAULT_REPEATS})")
    p.add_argument("--budget-minutes", type=float, default=60.0, help="wall-clock budget for the whole sweep; a "
                   "budget that cannot fit one setting per engine is refused (default 60)")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="chance of calling any setting faster than "
                   f"it is, shared over the settings compared (Bonferroni; default {DEFAULT_ALPHA})")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN, help="a minimum effect size: speculate only "
                   "when the speedup over AR clears 1 + this at the --alpha level, and its confirmation's interval "
                   f"too (default {DEFAULT_MIN_GAIN}: any gain the noise lets us show)")
    p.add_argument("--threads", type=int, default=None, help="the thread count you evaluate / serve with: torch "
                   "threads for our decoder, -t/-td for llama.cpp (default: the eval config's, as `specdraft eval` and "
                   "`serve-check` use them: num_threads, 0 = torch's default of all cores, for ours; "
                   "serve_llamacpp_threads, 1, for llama.cpp; vLLM uses its own)")
    p.add_argument("--concurrency", default="1", help="vLLM and llama.cpp: requests in flight at once, strictly "
                   "increasing from 1, e.g. 1,2,4,8: each setting is measured at each (llama.cpp: one server with "
                   "that many slots, -np), the best count chosen per concurrency and kept per concurrency in "
                   "tuning.json, and vLLM's num_speculative_tokens_per_batch_size schedule written (default 1: one "
                   "request)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds an engine may take to start or to run one "
                   "pass before the setting counts as hung (default 900)")
    p.add_argument("--field-refs", default=None, metavar="DIR", help="our decoder: stored base answers "
                   "(`specdraft field-refs`) on which the settings that matter get their exact greedy acceptance "
                   "length, simulated (default: datasets/smollm2-field-refs when present and made with the draft's "
                   "base; another base's is one note and tune goes on without them)")
    p.add_argument("--field-prompts", type=int, default=DEFAULT_FIELD_PROMPTS, metavar="N",
                   help=f"stored answers per set to simulate (default {DEFAULT_FIELD_PROMPTS}; 0: no field columns)")
    p.add_argument("--field-all", action="store_true", help="simulate every measured setting, not only those that "
                   "beat AR, the choice and the decoded fastest")
    p.add_argument("--name", default="tune", help="report directory: <run>/tune/<name>/")
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help="eval config deltas (default configs/eval/mtbench.yaml): dtype, backend, GGUF types, ...")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="eval config overrides, e.g. dtype=bf16")
    return p


def _check_installed(engines: tuple[str, ...]) -> None:
    """Before any model work: a missing engine is one line naming its make target."""
    from eval.serving.llamacpp_paths import LlamaCppError, converter_python, llama_server
    from eval.serving.serve_check import ServeCheckError, vllm_python

    try:
        if "vllm" in engines:
            vllm_python()
        if "llamacpp" in engines:
            llama_server()
            converter_python()
    except (ServeCheckError, LlamaCppError) as exc:
        raise EngineUnavailable(str(exc).splitlines()[0]) from None


def tune_eval_config(args):
    """The eval config tune measures with: --config / overrides, then tune's own flags (prompts, tokens, threads)."""
    from core.paths import CONFIGS
    from eval.harness.config import load_eval_config

    cfg = load_eval_config(args.config or [str(CONFIGS / "eval" / "mtbench.yaml")], args.overrides)
    changes = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "hf_baseline": False,
               "name": args.name}
    if args.threads is not None:  # else the config's own, which `specdraft eval` / serve-check use too
        changes.update(serve_llamacpp_threads=args.threads, num_threads=args.threads)
    if args.prompts:
        changes["dataset"] = args.prompts
    if cfg.temperature != 0:
        raise ValueError("tune measures greedy decoding (batch 1); use temperature=0")
    return dataclasses.replace(cfg, **changes)


def decode_dtype(cfg, names, draft_dir: Path):
    """The eval config with the dtype the base loads in. Our decoder alone: `dtype=fast` as `specdraft eval`
    resolves it (eval/harness/run_dtype.py: the decode probe's dtype on this CPU), so that the eval applies the
    choice; with a serving engine too, the base is shared and keeps `fast`'s plain meaning (core/hardware.py:
    fast_dtype), which serve-check matches their choices against."""
    from core.dtype_phases import needs_probe
    from core.hardware import resolve_device
    from eval.harness.run_dtype import export_decode_dtypes, format_dtypes

    if tuple(names) == ("ours",):
        cfg, dtypes = export_decode_dtypes(cfg, draft_dir)
        print(f"tune: {format_dtypes(dtypes.to_dict())}", flush=True)
    elif "ours" in names and needs_probe(cfg.dtype, resolve_device(cfg.device)):
        print("tune: our decoder is tuned beside serving engines on one base, in fast's bulk dtype; `specdraft eval "
              "dtype=fast` decodes in the decode probe's dtype, which may differ: tune --engine ours alone for a "
              "choice that eval applies", flush=True)
    return cfg


def apply_threads(cfg) -> int:
    """torch's threads for our decoder as `specdraft eval` sets them (eval/harness/runner.py: num_threads, 0 =
    torch's default), so that a tuned choice is measured at the count the eval applies it at; returns them."""
    import torch

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    return torch.get_num_threads()


def _build_engines(names, loaded, cfg, out_dir: Path, timeout: float, threads: int, concurrencies=(1,)) -> list:
    from eval.harness.prompts import config_prompts
    from eval.serving.serve_check import base_hf_dir, check_fingerprint
    from eval.tune.ours import OursEngine

    engines = []
    if "ours" in names:
        engines.append(OursEngine(loaded, cfg))
    if "vllm" in names or "llamacpp" in names:
        from eval.tune.serving import LlamaCppEngine, VllmEngine

        prompts = config_prompts(cfg, loaded.base.tokenizer)
        base_dir = base_hf_dir(loaded.base, out_dir)
        check_fingerprint(loaded.config, base_dir, "the export")
        if "vllm" in names:
            engines.append(VllmEngine(loaded, cfg, prompts, base_dir, out_dir / "vllm", timeout, concurrencies))
        if "llamacpp" in names:
            engines.append(LlamaCppEngine(loaded, cfg, prompts, base_dir, out_dir / "llamacpp", timeout, threads,
                                          concurrencies=concurrencies))
    return engines


def progress_bar(engines, desc: str = "tune"):
    """A tqdm bar (labelled `desc`) over every setting of `engines` and the `progress(label, record)` callback the
    sweep calls per setting (also `specdraft demo`'s tree sweep and `specdraft eval`'s untuned shape probe)."""
    from tqdm import tqdm

    total = 0
    for e in engines:
        try:
            total += len(e.settings())
        except EngineUnavailable:
            pass
    bar = tqdm(total=total, desc=desc, unit="setting", dynamic_ncols=True)

    def progress(label: str, record: dict | None) -> None:
        status = "" if record is None else (f"{record['speedup']:.2f}x AR" if record.get("status") == "ok"
                                            else record.get("status", ""))
        bar.set_postfix_str(f"{label}: {status}", refresh=False)
        bar.update(1)

    return bar, progress


def cmd_tune(args) -> int:
    from core.hardware import resolve_device
    from eval.choice.record import engine_device, machine_info
    from eval.harness.runner import resolve_heldout_skip
    from eval.tune.concurrency import parse_concurrency, run_sweeps
    from eval.tune.field import check_field_args, plan_field
    from eval.tune.report import field_line, schedule_line, write_export, write_report
    from models.export.load import load_export
    from models.export.specdraft import read_export_config

    names = ("ours", "vllm", "llamacpp") if args.engine == "all" else (args.engine,)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or (args.threads is not None and args.threads < 1):
        raise ValueError("--num-prompts, --max-new-tokens and --threads must be at least 1")
    concurrencies = parse_concurrency(args.concurrency)
    if concurrencies != (1,):
        if "ours" in names:
            raise ValueError(f"--concurrency {args.concurrency} is for the serving engines (--engine vllm or "
                             "llamacpp): our decoder decodes one request at a time (batch 1); give --concurrency 1 "
                             f"with --engine {args.engine}")
        if args.num_prompts < concurrencies[-1]:
            raise ValueError(f"--concurrency {args.concurrency} needs at least {concurrencies[-1]} prompts to keep "
                             f"{concurrencies[-1]} different requests in flight; give --num-prompts "
                             f"{concurrencies[-1]} or more")
    if args.repeats < MIN_REPEATS:
        raise ValueError(f"--repeats {args.repeats}: give at least {MIN_REPEATS}, the noise a speedup is judged "
                         "against is measured from the repeats")
    if not 0 < args.alpha < 1 or args.min_gain < 0:
        raise ValueError("--alpha must lie in (0, 1) and --min-gain be at least 0")
    field_prompts = args.field_prompts if "ours" in names else 0  # the field replays our decoder only
    check_field_args(args.field_refs, field_prompts)
    draft_dir = Path(args.draft)
    try:
        _check_installed(names)
        cfg = resolve_heldout_skip(tune_eval_config(args), read_export_config(draft_dir))
        apply_threads(cfg)
        cfg = decode_dtype(cfg, names, draft_dir)
        loaded = load_export(draft_dir, base_path=cfg.base_path, dtype=cfg.dtype, device=resolve_device(cfg.device),
                             chat_template=cfg.chat_template)
        out_dir = draft_dir.resolve().parent / "tune" / cfg.name
        # before the sweep: stored answers that cannot be read fail now, not after an hour of timing
        field_plan, field_note = plan_field(args.field_refs, field_prompts, loaded.base.fingerprint)
        engines = _build_engines(names, loaded, cfg, out_dir, args.timeout, cfg.serve_llamacpp_threads,
                                 concurrencies)
        ours = next((e for e in engines if e.name == "ours"), None)
        if field_note and ours is not None:
            ours.notes.append(field_note)  # in the report's notes (describe() hands the list to the record)
            print(field_note, file=sys.stderr)
        budget_s = args.budget_minutes * 60
        check_budget(engines, args.repeats, budget_s)  # before the progress bar lists (and searches) settings
        bar, progress = progress_bar(engines)
        t0 = time.monotonic()
        watch = LoadWatch()  # the load beside the sweeps: a loaded tune's ratios go into no card
        with bar:
            records = run_sweeps(engines, args.repeats, budget_s - (time.monotonic() - t0), progress,
                                 alpha=args.alpha, min_gain=args.min_gain)
        sweep_seconds = time.monotonic() - t0  # what the budget covers; the field's simulation comes after
    except (EngineUnavailable, BudgetTooSmall) as exc:
        print(f"specdraft tune: {exc}", file=sys.stderr)
        return 3
    if field_plan is not None and ours is not None:
        from eval.tune.field import add_field_columns

        add_field_columns(ours, records.get("ours"), field_plan, out_dir / "field", every=args.field_all)
    context = {"export": str(draft_dir), "machine": machine_info(), "dataset": cfg.dataset,
               "num_prompts": cfg.num_prompts, "max_new_tokens": cfg.max_new_tokens, "repeats": args.repeats,
               "alpha": args.alpha, "min_gain": args.min_gain, "budget_minutes": args.budget_minutes,
               "wall_seconds": sweep_seconds,
               # "specdraft", not argv[0]: where the script was installed is this machine's path
               "command": shlex.join(["specdraft", *sys.argv[1:]]),
               "concurrencies": list(concurrencies), "load": watch.record()}
    for name, rec in records.items():
        rec["tuned"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        rec["load"] = context["load"]
        rec["machine"] = machine_info(device=engine_device(name, cfg.device))  # where a choice applies
    write_report(out_dir, context, records)
    tuning = write_export(draft_dir, context, records)
    for name, rec in records.items():
        c = rec.get("choice")
        if c is None:
            print(f"{name}: {rec['status']}: {rec.get('error')}")
        else:
            what = c["label"] if c["speculate"] else "do not speculate"
            ci = f", {c['interval'][0]:.2f}-{c['interval'][1]:.2f}x" if c.get("interval") else ""
            print(f"{name}: {what} ({c['speedup_vs_ar']:.2f}x its AR{ci}; {c['reason']})")
            if rec.get("field"):
                print(f"{name}: {field_line(rec)}")
            for bug in c.get("bugs") or []:
                print(f"{name}: BUG: {bug} changed the tokens in {rec.get('dtype')} (see tuning.json)")
            if rec.get("schedule"):
                print(f"{name}: {schedule_line(rec)}")
    print(f"wrote {tuning} and {draft_dir / 'NOTES.md'}; report: {out_dir / 'report.md'}")
    return 0
