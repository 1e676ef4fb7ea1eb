"""(k, w) sweep of the N-gram drafter from the command line (the same as `specdraft eval --method ngram
sweep_k=[...] sweep_w=[...]`); the sweep itself lives in models/families/ngram/sweep.py (own AR and every cell on one
backend in one process; speedups are ratios of that run's numbers).

    python bench/ngram_sweep.py --config configs/eval/ngram.yaml --k 1 5 10 20 --w 2 4 10 \
        --out runs/ngram/sweep num_prompts=8 max_new_tokens=64 [extra.strategy=mixed]

Writes sweep.md / sweep_heatmap.png / sweep.json under --out, and bench.json (bench/harness.py: Results) with the
grid and the sweep's wall time (time_once), on disk even when the sweep fails (its error then in the row).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bench.harness import Results, time_once  # noqa: E402
from eval.harness.config import load_eval_config  # noqa: E402
from models.families.ngram.sweep import sweep, write  # noqa: E402


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
    results = Results(a.out / "bench.json", {"overrides": a.overrides, "k": a.k, "w": a.w})
    with results.arm("sweep") as row:
        result, seconds = time_once(lambda: sweep(cfg, a.k, a.w))
        row.update(result, wall_seconds=round(seconds, 1))
    write(result, a.k, a.w, a.out)
    print(f"wrote {a.out}/sweep.md, sweep_heatmap.png and bench.json")


if __name__ == "__main__":
    main()
