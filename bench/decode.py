"""Decoding speed on the real base, all measured side by side in one run (same prompts, same process):
own AR decoding (the `fast` engine, no drafts) vs transformers `generate` (greedy), and a trained draft's
speculative decoding vs both.

    python bench/decode.py                                      # own AR vs HF generate only
    python bench/decode.py --draft runs/demo/export             # + the demo's Medusa heads
    python bench/decode.py --draft runs/demo/export --prompts 20 --new-tokens 128 --tree chain4

It drives the same code as `specdraft eval` (eval/harness/runner.py), whose report (under <run>/eval/bench-decode/,
or runs/bench-decode/ without a draft) times the arms interleaved in one process; the ratios are taken between
that run's numbers (bench/harness.py: ratio) and, with --out, written to a bench JSON (bench/harness.py: Results).
Targets: own AR >= 1.5x HF generate; Medusa >= 1.3x own AR on MT-bench.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, ratio  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", help="export directory of a trained draft (runs/<run>/export)")
    p.add_argument("--base", default="smollm2", help="base model when no --draft is given")
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--backend", default="fast", choices=["fast", "hf"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--tree", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default=None, help="bench JSON (e.g. runs/bench-decode/bench.json); default: none")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from eval.engine.drafters.drafter import NoDrafter
    from eval.harness.config import load_eval_config
    from eval.harness.runner import eval_export, evaluate, format_summary
    from models.base import load_base

    overrides = ["name=bench-decode", f"dataset={args.dataset}", f"num_prompts={args.prompts}",
                 f"max_new_tokens={args.new_tokens}", f"backend={args.backend}", f"dtype={args.dtype}",
                 f"tree={args.tree}"]
    cfg = load_eval_config([], overrides)
    results = Results(args.out, {"args": vars(args), "rows": {}})
    with results.arm("rows", "draft" if args.draft else "ar") as row:
        if args.draft:
            report, out_dir = eval_export(Path(args.draft), cfg)
        else:
            base = load_base(args.base, dtype=args.dtype)
            out_dir = Path("runs") / "bench-decode"
            report = evaluate(cfg, base, NoDrafter(), "ar", out_dir)
        ar, hf = report["ar_tokens_per_second"], report["hf_tokens_per_second"]
        row.update(report=str(out_dir / "report.json"), method=report["method"],
                   tokens_per_second=report["tokens_per_second"], ar_tokens_per_second=ar,
                   hf_tokens_per_second=hf, ar_vs_hf=ratio(ar or 0.0, hf or 0.0),
                   speedup=report["speedup"], speedup_vs_hf=report["speedup_vs_hf"])
    print(format_summary(report, out_dir))
    if row["ar_vs_hf"]:
        print(f"own AR / HF generate: {row['ar_vs_hf']:.2f}x (target >= 1.5)")
    if args.draft and report["speedup"]:
        print(f"{report['method']} / own AR: {report['speedup']:.2f}x (target >= 1.3); "
              f"/ HF generate: {report['speedup_vs_hf']:.2f}x")


if __name__ == "__main__":
    main()
