"""(k, w) sweep of the N-gram drafter from the command line (the same as `specdraft eval --method ngram
extra.sweep_k=[...] extra.sweep_w=[...]`); the sweep itself lives in eval/harness/ngram_sweep.py.

    python bench/ngram_sweep.py --config configs/eval/ngram.yaml --k 1 5 10 20 --w 2 4 10 \
        --out runs/ngram/sweep num_prompts=8 max_new_tokens=64 [extra.strategy=mixed]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eval.harness.config import load_eval_config
from eval.harness.ngram_sweep import sweep, write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 5, 10, 20])
    ap.add_argument("--w", type=int, nargs="+", default=[2, 4, 10])
    ap.add_argument("--out", type=Path, default=Path("runs/ngram/sweep"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = load_eval_config(a.config or ["configs/eval/ngram.yaml"], a.overrides)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    write(sweep(cfg, a.k, a.w), a.k, a.w, a.out)
    print(f"wrote {a.out}/sweep.md and sweep_heatmap.png")


if __name__ == "__main__":
    main()
