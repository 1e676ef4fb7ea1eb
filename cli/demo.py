"""`specdraft demo`: the main job on this machine, end to end, on the real small base.

0. size the work to this machine: a few seconds' probe of the base's forward speed in the dtype the run uses
   (cli/demo_probe.py), then a plan (conversations, max length, epochs, eval prompts; cli/demo_plan.py) that fits
   the time budget, printed in one line; plan keys the user sets (`specdraft demo data.max_records=...`) are kept
   and their cost is printed;
1. train a one-head Hydra draft on SmolLM2-135M-Instruct + a ShareGPT subset (configs/hydra.yaml +
   configs/demo.yaml): the frozen base runs once over the data into the hidden-state cache, then several
   cheap epochs train the head from it, with a wall-time budget so it fits a laptop CPU;
2. choose the tree on this machine (cli/demo_tune.py): the head's top-1, top-2 or top-3, each decoded side by side
   with own AR on a few held-out conversations; the cheapest one no other beats by more than the noise wins (what
   verifying 2-4 tokens costs depends on the CPU and the dtype); a tree the user sets (eval.tree_choices=...) is
   kept as given;
3. print the held-out per-head accuracy table (written by training to runs/demo/heldout.json);
4. decode MT-bench prompts with the bundled speculative decoder and that tree (configs/eval/demo.yaml, dtype
   `fast`: on a CPU with bf16 matrix instructions whichever of bf16 and fp32 a few seconds' probe of the base's decode
   steps finds faster (core/dtype_phases.py), fp32 on other CPUs; a dtype the user forces through train.precision or
   base.dtype is kept), with own-AR and transformers-generate baselines side by side in the same run, and print
   acceptance length (with the tree size), both speedups and the losslessness verdict in words;
5. (bf16 only; an fp32 run is exact already) the exact fp32 judge: every MT-bench prompt whose bf16 output differed
   from plain decoding was already decoded again in fp32 inside step 4 (same tree, same length: numeric rounding or a
   real mismatch, eval/harness/lossless.py), and two more prompts are decoded in fp32 with the run's own tree and
   length: there the speculative output must equal plain greedy decoding token for token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from cli import CONFIGS

RECIPE = "hydra.yaml"  # the family recipe configs/demo.yaml is stacked on


def _family(cfg) -> str:
    from models.registry import DRAFT_MODELS

    return DRAFT_MODELS[cfg.draft.family].run_title(cfg.draft)


def run_demo(overrides: list[str]) -> int:
    """`overrides`: `key=value` for the training recipe, or `eval.key=value` for configs/eval/demo.yaml."""
    from cli.train_decode import make_decode_eval
    from core.config_loader import ConfigError
    from eval.harness.config import load_eval_config
    from train.config import load_train_config
    from train.loop import train

    train_overrides = [o for o in overrides if not o.startswith("eval.")]
    eval_overrides = [o.removeprefix("eval.") for o in overrides if o.startswith("eval.")]
    configs = [str(CONFIGS / RECIPE), str(CONFIGS / "demo.yaml")]
    cfg = load_train_config(configs, train_overrides)  # a bad override fails here, before the probe
    try:  # and a bad eval.* one
        load_eval_config([str(CONFIGS / "eval" / "demo.yaml")], eval_overrides)
    except ConfigError as err:
        raise ConfigError(f"an eval.* override (for configs/eval/demo.yaml): {err}") from None
    t0 = time.perf_counter()
    plan, dtype = plan_for_this_machine(cfg, _user_plan_keys(overrides), tree_sweep=not _sets_tree(eval_overrides),
                                        eval_overrides=eval_overrides)
    planned = plan.overrides()
    cfg = load_train_config(configs, [f"{k}={v}" for k, v in planned.items() if not k.startswith("eval.")]
                            + train_overrides)
    heads = f"{cfg.draft.num_heads} {_family(cfg)} head{'s' if cfg.draft.num_heads > 1 else ''}"
    cache = "the base's hidden states cached once, then " if cfg.data.hidden_cache else ""
    epochs = f"{cfg.train.epochs:g} epoch{'' if cfg.train.epochs == 1 else 's'}"
    source = "ShareGPT" if cfg.data.source == "sharegpt" else f"{cfg.data.source}'s"
    print(f"[demo 1/5] training {heads} on {cfg.base.path} with {cfg.data.max_records} {source} conversations "
          f"of up to {cfg.data.max_length} tokens ({cache}{epochs}, budget {cfg.train.max_minutes:g} min of "
          "training)", flush=True)
    run_dir = train(cfg, decode_eval=make_decode_eval(cfg))  # train.decode_eval_prompts=N decodes snapshots
    t_train = time.perf_counter() - t0
    t_tune = 0.0
    # Decoding: where the training's dtype came from `fast`, `fast` again, which for decoding is the probe's faster
    # dtype on this CPU (core/dtype_phases.py; the tree sweep and the eval resolve it alike, from one cached probe);
    # a dtype the user forced (train.precision=fp32, base.dtype=bf16) is kept for every phase.
    eval_args = [f"dtype={eval_dtype(cfg, dtype)}", f"num_prompts={planned['eval.num_prompts']}"]
    check_tree: list[str] = []  # the user's tree (in eval_overrides) or the tuned one, fixed for the fp32 check
    if _sets_tree(eval_overrides):
        print("[demo 2/5] the tree: yours (eval.tree / eval.tree_choices), not tuned", flush=True)
    else:
        from cli.demo_tune import TUNE_PROMPTS, TUNE_TOKENS, describe, tune_demo_tree

        print(f"[demo 2/5] choosing the tree on this machine: the head's top-1 / top-2 / top-3 against own AR, "
              f"{TUNE_PROMPTS} held-out conversations x {TUNE_TOKENS} tokens", flush=True)
        t = time.perf_counter()
        choice = tune_demo_tree(run_dir / "export", [*eval_args, *eval_overrides])
        t_tune = time.perf_counter() - t
        print(f"[demo 2/5] {describe(choice)}", flush=True)
        # A chosen tree reaches the eval through tuning.json (configs/eval/demo.yaml's own tree set aside, so the
        # eval says which tuning it applies); with no tree beating AR the demo still decodes with the top-1.
        tree = str(choice["tree_choices"]).replace(" ", "")
        eval_args += ["tree_choices=null"] if choice["speculate"] else [f"tree_choices={tree}", "use_tuning=false"]
        # the fp32 check decodes the same tree: tuning.json's choice was measured in the run's dtype, so an fp32 eval
        # would not apply it and would fall back to another tree
        check_tree = [f"tree_choices={tree}", "use_tuning=false"]
    t = time.perf_counter()
    out_dir = evaluate_demo_run(run_dir, [*eval_args, *eval_overrides], check_overrides=check_tree)
    t_eval = time.perf_counter() - t
    total = time.perf_counter() - t0
    table = phase_table(plan, actual_phases(run_dir, total, t_tune, t_eval))
    print(format_phase_table(table, plan.total_s, total))
    if out_dir is not None:
        _save_phases(out_dir / "report.json", table, plan, total)
    print(f"demo finished in {total / 60:.1f} min (probe, training incl. set-up {t_train / 60:.1f} min; planned "
          f"{plan.total_s / 60:.1f}); run directory {run_dir}")
    return 0


def actual_phases(run_dir: Path, total_s: float, tune_s: float, eval_s: float) -> dict[str, float | None]:
    """Seconds each of the plan's phases (cli/demo_plan.py: PHASES) took: the cache build and training from the
    run's phase_seconds.json (train/loop.py; training = the loop, the export and the held-out table), the tree sweep
    and the decoding as the demo timed them, set-up = the rest (probes, loading, tokenizing, DeepSpeed's start). A
    phase the run did not time is None (an older run directory)."""
    try:
        ran = json.loads((run_dir / "phase_seconds.json").read_text())
    except (OSError, ValueError):
        ran = {}
    cache = ran.get("cache")
    training = ran["loop"] + ran["finish"] if "loop" in ran and "finish" in ran else None
    timed = [x for x in (cache, training) if x is not None]
    setup = total_s - sum(timed) - tune_s - eval_s if len(timed) == 2 else None
    return {"set-up": setup, "cache": cache, "training": training, "tree sweep": tune_s, "decoding": eval_s}


def phase_table(plan, actual: dict[str, float | None]) -> list[dict]:
    """Per phase: planned and actual minutes and the plan's error in % of the plan ((actual - planned) / planned)."""
    from cli.demo_plan import PHASES

    planned = plan.phases()
    rows = []
    for name in PHASES:
        p, a = planned[name], actual.get(name)
        err = None if a is None or p <= 0 else round(100 * (a - p) / p, 1)
        rows.append({"phase": name, "planned_min": round(p / 60, 2), "actual_min": None if a is None else
                     round(a / 60, 2), "error_pct": err})
    return rows


def format_phase_table(rows: list[dict], planned_total_s: float, total_s: float) -> str:
    """The demo's closing lines: each phase's planned and actual minutes and the error, then the total."""
    lines = ["[demo plan vs actual] minutes per phase (error = actual against plan):"]
    for r in rows:
        if r["actual_min"] is None:
            lines.append(f"  {r['phase']:<11} planned {r['planned_min']:5.1f}  actual     ?")
            continue
        err = "" if r["error_pct"] is None else f"  {r['error_pct']:+6.1f} %"
        lines.append(f"  {r['phase']:<11} planned {r['planned_min']:5.1f}  actual {r['actual_min']:5.1f}{err}")
    err = 100 * (total_s - planned_total_s) / planned_total_s
    lines.append(f"  {'total':<11} planned {planned_total_s / 60:5.1f}  actual {total_s / 60:5.1f}  {err:+6.1f} %")
    return "\n".join(lines)


def _save_phases(report_path: Path, rows: list[dict], plan, total_s: float) -> None:
    """The plan against what it took, into the demo's report.json ("demo_plan": the plan's line, speed, phases)."""
    from core.atomic import write_json_atomic
    from core.load import load_average

    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError):
        return
    report["demo_plan"] = {"line": plan.line(), "kind": plan.dtype, "probe_tok_s": plan.tok_s,
                           "decode_tok_s": plan.decode_tok_s, "phases": rows,
                           "planned_total_min": round(plan.total_s / 60, 2), "actual_total_min": round(total_s / 60, 2),
                           "load_at_end": load_average()}
    write_json_atomic(report_path, report)


def eval_dtype(cfg, dtype: str) -> str:
    """The dtype the demo's decoding asks for: where the training's dtype came from `fast`, `fast` again (for
    decoding, the decode probe's faster dtype on this CPU); a dtype the user forced is kept for every phase."""
    asked = cfg.base.dtype if cfg.base.dtype != "auto" else cfg.train.precision
    return "fast" if asked == "fast" else dtype


def _sets_tree(eval_overrides: list[str]) -> bool:
    """Whether the user chose the demo's tree (eval.tree=... / eval.tree_choices=...): then it is not tuned."""
    return any(o.split("=", 1)[0].strip() in ("tree", "tree_choices") for o in eval_overrides)


def _user_plan_keys(overrides: list[str]) -> dict[str, str]:
    """{plan key: value} of the overrides that set one of cli.demo_plan.PLAN_KEYS."""
    from cli.demo_plan import PLAN_KEYS

    pairs = (o.split("=", 1) for o in overrides if "=" in o)
    return {k.strip(): v.strip() for k, v in pairs if k.strip() in PLAN_KEYS}


def plan_for_this_machine(cfg, user: dict[str, str], tree_sweep: bool = True, eval_overrides: list[str] = ()):
    """Probe this machine's base speed in the run's dtype (the bulk forward) and its one-token decode speed as the
    demo's eval decodes (its dtype; `eval_overrides`: the user's eval.* keys, e.g. a backend), and plan the demo on
    them; prints the plan line. tree_sweep: the demo sweeps its trees before decoding (priced in the plan). Returns
    (plan, the dtype name the run uses: "bf16" | "fp32" | ...)."""
    import gc

    from cli.demo_plan import class_speed, cost_dtype, cost_kind, make_plan, speed_class
    from cli.demo_probe import decode_speed, machine_key, probe_forward_speed, remember_class, remembered_class
    from core.hardware import resolve_device
    from models.base import load_base
    from train.ds_config import resolve_precision

    if cfg.train.num_threads:  # the probe must see the threads training will use
        torch.set_num_threads(cfg.train.num_threads)
    device = resolve_device("auto")  # what training picks (train/distributed.py): CUDA when there is one
    precision = resolve_precision(cfg.train.precision, device)
    dtype = precision if cfg.base.dtype == "auto" else cfg.base.dtype  # the base's dtype in the cache build
    # Loading the base converts the packaged GGUF on the first run (~20 s), which training would do otherwise.
    base = load_base(cfg.base.path, dtype=dtype, device=device, chat_template=cfg.data.chat_template or None)
    measured = probe_forward_speed(base.model)
    del base
    gc.collect()
    key = machine_key(dtype, device)
    k = speed_class(measured, remembered_class(key))
    remember_class(key, k)
    decoding, decode_dtype, source = decode_speed(cfg.base.path, [f"dtype={eval_dtype(cfg, dtype)}",
                                                                  *eval_overrides], device,
                                                  chat_template=cfg.data.chat_template or None)
    decode_class, decode_note = None, f"decoding priced from the bulk probe: {source}"
    if decoding:
        decode_key = f"{machine_key(decode_dtype, device)} decode"
        decode_class = speed_class(decoding, remembered_class(decode_key))
        remember_class(decode_key, decode_class)
        decode_note = f"one-token decoding {decoding:.1f} tok/s in {decode_dtype}, from {source}"
    plan = make_plan(class_speed(k), cost_kind(dtype, device.type), user=user, soft_loss=cfg.loss.teacher_weight > 0,
                     tree_sweep=tree_sweep, decode_tok_s=None if decode_class is None else class_speed(decode_class),
                     decode_dtype=cost_dtype(decode_dtype))
    print(f"[demo plan] {plan.line()} (measured {measured:.0f} tok/s; {decode_note})", flush=True)
    return plan, dtype


def evaluate_demo_run(run_dir: Path, overrides: list[str] | None = None,
                      check_overrides: list[str] | None = None) -> Path:
    """Steps 3-5 of the demo on a finished run: held-out table, MT-bench decoding, exact check, summary; returns the
    MT-bench report's directory.
    overrides: for configs/eval/demo.yaml (the plan's dtype and prompt count, the user's eval.* keys);
    check_overrides: what the fp32 check adds so that it decodes the run's own tree (the tuned one, fixed)."""
    from core.hardware import resolve_device, resolve_dtype
    from eval.harness.config import load_eval_config
    from eval.harness.lossless import format_verdict
    from eval.harness.runner import eval_export, format_summary
    from train.heldout import format_heldout_table

    heldout = run_dir / "heldout.json"
    print("[demo 3/5] held-out accuracy of the draft (teacher forced, next to a trivial predictor)", flush=True)
    if heldout.exists():
        print(format_heldout_table(json.loads(heldout.read_text())), flush=True)
    overrides = list(overrides or [])
    eval_cfg = load_eval_config([str(CONFIGS / "eval" / "demo.yaml")], overrides)
    if eval_cfg.dtype == "fast":  # configs/eval/demo.yaml's: the decode probe's dtype on this CPU (fp32 without
        # bf16 instructions: then the run itself is the exact check)
        from eval.harness.run_dtype import export_decode_dtypes

        eval_cfg, _ = export_decode_dtypes(eval_cfg, run_dir / "export")
    dtype = resolve_dtype(eval_cfg.dtype, resolve_device(eval_cfg.device))
    print(f"[demo 4/5] speculative decoding on {eval_cfg.num_prompts} {eval_cfg.dataset} prompts "
          f"({eval_cfg.max_new_tokens} new tokens each, {str(dtype).removeprefix('torch.')}), own AR and HF generate "
          "in the same run", flush=True)
    report, out_dir = eval_export(run_dir / "export", eval_cfg)
    exact = None
    if dtype != torch.float32:
        check_cfg = load_eval_config([str(CONFIGS / "eval" / "demo.yaml")], [*overrides, *(check_overrides or []),
            "dtype=fp32", "num_prompts=2", "hf_baseline=false", "warmup_tokens=4", "name=mtbench-demo-fp32-check"])
        redecoded = (report.get("extra") or {}).get("lossless_redecoded", 0)
        also = f" (the {redecoded} that differed in bf16 were re-decoded in fp32 in step 4)" if redecoded else ""
        print(f"[demo 5/5] exact losslessness check in fp32 on {check_cfg.num_prompts} prompts with the run's tree "
              f"and length{also}", flush=True)
        exact, _ = eval_export(run_dir / "export", check_cfg)
    else:
        print("[demo 5/5] the decoding above ran in fp32 (the decode probe timed it as fast as bf16 here, no bf16 "
              "instructions on this CPU, or train.precision=fp32): its verdict is the exact losslessness check",
              flush=True)

    print("\n" + "=" * 100)
    print(format_summary(report, out_dir))
    if exact is not None:
        print(f"  fp32 check: {format_verdict(exact)}")
    return out_dir
