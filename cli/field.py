"""`specdraft field-refs` (the stored base answers) and `specdraft field` (a draft's exact greedy acceptance on them):
the field benchmark (docs/howto/evaluate.md, "The field benchmark")."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DEFAULT_REFS = "datasets/smollm2-field-refs"


def add_field_parsers(sub) -> None:
    from eval.harness.field_sets import FIELD_SETS

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
    p = sub.add_parser("field", help="a draft's exact greedy acceptance on the stored base answers (simulated: no "
                       "base forward per step), per set with 95 %% intervals, one table and plot")
    p.add_argument("--draft", required=True, help="an export directory (runs/<run>/export, drafts/<name>/export)")
    p.add_argument("--refs", default=DEFAULT_REFS, help="the stored answers (specdraft field-refs)")
    p.add_argument("--sets", default="", help="comma-separated sets of the stored answers (default: all)")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of each set (default: all)")
    p.add_argument("--out", default=None, help="report directory (default <export>/../field/<dtype>-<shape>)")
    p.add_argument("--against", default=None, help="another field report directory judged on the same stored "
                   "answers: paired intervals of this draft minus that one")
    p.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                   help="an EAGLE-3 draft: step many prompts together, the draft's matrix products batched over them "
                   "(default on; --no-lockstep: one prompt at a time through the decoder loop, the reference)")
    p.add_argument("--lockstep-width", type=int, default=None, metavar="B",
                   help="prompts stepped together per rank with --lockstep (default: eval/harness/field.py's "
                   "LOCKSTEP_WIDTH)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="eval config keys: the draft's shape "
                   "(tree=, tree_choices=, extra.eagle3_mode=chain extra.chain_length=4, ...), dtype=, threads")


def cmd_field(args) -> int:
    import json

    import torch

    from eval.harness.config import load_eval_config
    from eval.harness.field import LOCKSTEP_WIDTH, judge_export
    from eval.harness.field_report import field_markdown, paired, read_rows

    cfg = load_eval_config([], args.overrides)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()] or None
    report, out = judge_export(Path(args.draft), Path(args.refs), cfg, sets=sets, num_prompts=args.num_prompts,
                               out_dir=Path(args.out) if args.out else None, label=args.draft,
                               lockstep=(args.lockstep_width or LOCKSTEP_WIDTH) if args.lockstep else 0)
    if report.get("partial"):
        print(f"field: rank {report['rank']} done; the last rank to finish writes {out}/field.md")
        return 0
    print(field_markdown(report) + f"\nwrote {out}/field.json, field.md, field.png")
    if args.against:
        pair = paired(read_rows(out), read_rows(Path(args.against)))
        (out / "paired.json").write_text(json.dumps({"against": args.against, **pair}, indent=1))
        print(f"\n{args.draft} minus {args.against} on {pair['prompts']} common prompts (95 % paired bootstrap):")
        for s, v in pair["sets"].items():
            print(f"  {s}: {v['diff']:+.3f} ({v['interval'][0]:+.3f}..{v['interval'][1]:+.3f})")
        if pair["mean_interval"]:
            lo, hi = pair["mean_interval"]
            print(f"  mean over sets: {pair['mean_diff']:+.3f} ({lo:+.3f}..{hi:+.3f})")
    return 0


def cmd_field_refs(args) -> int:
    import torch

    from core.hardware import resolve_device
    from eval.harness.field_refs import build_refs
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


__all__ = ["add_field_parsers", "add_field_judge_parser", "cmd_field", "cmd_field_refs"]
