"""`specdraft field-refs` (the stored base answers), `specdraft field` (a draft's greedy acceptance simulated on them)
and `specdraft field-paired` (two field reports' paired difference): the field benchmark (docs/howto/evaluate.md, "The
field benchmark")."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DEFAULT_REFS = "datasets/smollm2-field-refs"


def add_field_parsers(sub) -> None:
    from eval.field.sets import FIELD_SETS

    p = sub.add_parser("field-refs", help="the base's greedy fp32 answers to the field sets, stored for `specdraft "
                       "field` (resumable)")
    p.add_argument("--base", default="smollm2", help="the base (a name models.base.load_base knows, or a directory)")
    p.add_argument("--out", default=DEFAULT_REFS, help="the store directory (kept in the repository)")
    p.add_argument("--sets", default=",".join(FIELD_SETS),
                   help=f"comma-separated (default all: {','.join(FIELD_SETS)})")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="longer prompts are skipped with a count")
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoded at once")
    p.add_argument("--engine", default="fast", choices=["fast"], help="fast: our batched static-cache engine")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="fp32: the exact reference")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")


def add_field_judge_parser(sub) -> None:
    from eval.field.simulation import AGREEMENT_SAMPLE, DEFAULT_PER_SET

    p = sub.add_parser("field", help="a draft's greedy acceptance simulated on the stored base answers (no base "
                       "forward per step), per set with 95 %% intervals, one table and plot")
    p.add_argument("--draft", required=True, help="an export directory (runs/<run>/export, drafts/<name>/export)")
    p.add_argument("--refs", default=DEFAULT_REFS, help="the stored answers (specdraft field-refs)")
    p.add_argument("--sets", default="", help="comma-separated sets of the stored answers (default: all)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-prompts", type=int, default=None,
                      help=f"the first N prompts of each set (default: the default subset, each set's first "
                      f"{DEFAULT_PER_SET}, a set of long prompts half as many: ~300 prompts over every set)")
    size.add_argument("--full", action="store_true", help="every stored answer (1,088 in the SmolLM2 store)")
    p.add_argument("--agreement-sample", type=int, default=AGREEMENT_SAMPLE, metavar="N",
                   help="after a batched (lockstep) run, re-decode N of its prompts one at a time and record the "
                   "agreement in the report (0 = not measured; the report then says so)")
    p.add_argument("--mixed-dtype", action="store_true",
                   help="judge in a dtype other than the stored answers' (e.g. dtype=bf16 against fp32 answers); "
                   "refused without it, every output marked with it")
    p.add_argument("--out", default=None, help="report directory (default <export>/../field/<dtype>-<shape>)")
    p.add_argument("--against", default=None, help="another field report directory judged on the same stored "
                   "answers: paired intervals of this draft minus that one")
    p.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                   help="a draft whose family has a batched field path (its models/families/<family>/lockstep.py: "
                   "EAGLE-3, Hydra, Medusa, DFlash, DSpark, Domino): step many prompts together, the draft's matrix "
                   "products batched over them (default on; --no-lockstep: one prompt at a time through the decoder "
                   "loop, the reference)")
    p.add_argument("--lockstep-width", type=int, default=None, metavar="B",
                   help="prompts stepped together per rank with --lockstep (default: eval/field/simulation.py's "
                   "LOCKSTEP_WIDTH)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="eval config keys: the draft's shape "
                   "(tree=, tree_choices=, extra.eagle3_mode=chain extra.num_speculative_tokens=4, ...), dtype=, "
                   "threads")


def cmd_field(args) -> int:
    import torch

    from eval.field.report import field_markdown
    from eval.field.simulation import LOCKSTEP_WIDTH, judge_export
    from eval.harness.config import load_eval_config

    cfg = load_eval_config([], args.overrides)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()] or None
    report, out = judge_export(Path(args.draft), Path(args.refs), cfg, sets=sets, num_prompts=args.num_prompts,
                               out_dir=Path(args.out) if args.out else None, label=args.draft,
                               lockstep=(args.lockstep_width or LOCKSTEP_WIDTH) if args.lockstep else 0,
                               subset="all" if args.full else "default", agreement=args.agreement_sample,
                               mixed_dtype=args.mixed_dtype, announce=lambda line: print(line, file=sys.stderr,
                                                                                         flush=True))
    if report.get("partial"):
        print(f"field: rank {report['rank']} done; the last rank to finish writes {out}/field.md")
        return 0
    print(field_markdown(report) + f"\nwrote {out}/field.json, field.md, field.png")
    if args.against:
        command = "specdraft " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["field"] else ""
        print_pair(write_pair(out, Path(args.against), args.against, command), args.draft, args.against)
    return 0


def write_pair(a: Path, b: Path, b_name: str, command: str, out: Path | None = None) -> dict:
    """paired.json (default in report directory a): a minus b on their common prompts, each side's path, the
    command that wrote it."""
    import json

    from core.atomic import write_json_atomic
    from eval.field.report import paired, path_label, read_rows

    metas = [json.loads((d / "field.json").read_text())["meta"] if (d / "field.json").is_file() else {}
             for d in (a, b)]
    pair = {"against": b_name, "command": command, **paired(read_rows(a), read_rows(b)),
            "paths": [path_label(m) if m else "unknown (no field.json)" for m in metas],
            "dtypes": [m.get("dtype") for m in metas]}
    write_json_atomic(out or a / "paired.json", pair)
    return pair


def print_pair(pair: dict, a_name: str, b_name: str) -> None:
    print(f"\n{a_name} minus {b_name} on {pair['prompts']} common prompts (95 % paired bootstrap):")
    for s, v in pair["sets"].items():
        print(f"  {s}: {v['diff']:+.3f} ({v['interval'][0]:+.3f}..{v['interval'][1]:+.3f})")
    if pair["mean_interval"]:
        lo, hi = pair["mean_interval"]
        print(f"  mean over sets: {pair['mean_diff']:+.3f} ({lo:+.3f}..{hi:+.3f})")


def add_field_paired_parser(sub) -> None:
    p = sub.add_parser("field-paired", help="paired intervals of two field reports on their common prompts "
                       "(paired.json), from their rows: no model is loaded")
    p.add_argument("report", help="a field report directory (rows-*.jsonl): the minuend")
    p.add_argument("against", help="the other report directory")
    p.add_argument("--name", default=None, help="how paired.json names `against` (default: the path given)")
    p.add_argument("--out", default=None, help="default <report>/paired.json")


def cmd_field_paired(args) -> int:
    command = "specdraft " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["field-paired"] else ""
    pair = write_pair(Path(args.report), Path(args.against), args.name or args.against, command,
                      Path(args.out) if args.out else None)
    print_pair(pair, args.report, args.name or args.against)
    print(f"wrote {args.out or Path(args.report) / 'paired.json'}")
    return 0


def cmd_field_refs(args) -> int:
    import torch

    from core.hardware import resolve_device
    from eval.field.refs import build_refs
    from models.base import load_base

    if args.threads:
        torch.set_num_threads(args.threads)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    base = load_base(args.base, dtype=args.dtype, device=resolve_device("auto"))
    command = "specdraft " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["field-refs"] else \
        f"specdraft field-refs --base {args.base} --out {args.out}"
    card = build_refs(Path(args.out), base, sets=sets, max_new_tokens=args.max_new_tokens,
                      max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, engine_name=args.engine,
                      command=command)
    print(f"wrote {args.out}: {card['prompts']} prompts over {len(card['counts'])} sets "
          f"({', '.join(f'{s} {n}' for s, n in card['counts'].items())}); skipped as too long: "
          f"{card['skipped_too_long'] or 'none'}; {card['build_seconds'] / 60:.1f} min")
    return 0


__all__ = ["add_field_parsers", "add_field_judge_parser", "add_field_paired_parser", "cmd_field", "cmd_field_paired",
           "cmd_field_refs"]
